"""The new mergekit methods through Snakemake, as users run them: the committed workflow with
params.yaml's method switched to a joint-statistics method (model_stock: all-or-none reads,
a joint scan) and to a randomized, row-ranked one (della), each at a 25% budget, then
`mergepipe verify`. The methods' math is checked elsewhere (tests/test_mergekit_*.py); this
checks that the workflow's rules carry any registered method end to end."""
from __future__ import annotations

import re

import pytest

from mergepipe.output.manifest import verify_outputs
from tests.helpers.workflow import MODEL, job_counts, make_workspace, smk

CASES = {"model_stock": "{filter_wise: false}", "della": "{lambda: 1.0, density: 0.5, epsilon: 0.1}"}


@pytest.mark.parametrize("method", sorted(CASES))
def test_snakemake_builds_a_new_method(tmp_path, method):
    ws = make_workspace(tmp_path / "ws")
    params = ws / "params.yaml"
    text = re.sub(r"^method: .*$", f"method: {method}", params.read_text(), flags=re.M)
    text = re.sub(r"^parameters: .*$", f"parameters: {CASES[method]}", text, flags=re.M)
    params.write_text(text)
    smk(ws, MODEL)
    man = verify_outputs(ws / "merged")
    assert man["plan"]["method"] == method
    assert man["bytes"]["expert_bytes_read"] <= man["budget"]["bytes"]
    if method == "model_stock":  # a joint method: every block read for all experts or none
        assert man["plan"]["joint"]["reads"] == "all-or-none"
    assert job_counts(smk(ws, MODEL)) == {}  # and nothing to do the second time
