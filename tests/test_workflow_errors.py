"""Mistakes in params.yaml through Snakemake: a few lines naming the key or path, the CLI's
own line on the console, and the demo rule making only the family it owns."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.workflow import MODEL, copy_workspace, output_bytes, pending_jobs, smk

EXPERT_2 = "  - {name: expert_2, path: models/demo/expert_2, weight: 0.7}\n"


@pytest.fixture(scope="module")
def built(built_demo, tmp_path_factory) -> Path:
    """A copy of the session's workspace after `snakemake merged/model.safetensors` (the tiny demo family)."""
    return copy_workspace(built_demo.ws, tmp_path_factory.mktemp("smk-errors") / "ws")


@pytest.fixture
def params(built):
    """params.yaml of `built`, put back after the test."""
    path = built / "params.yaml"
    text = path.read_text()
    assert EXPERT_2 in text
    yield path
    path.write_text(text)


def _error_lines(proc) -> list[str]:
    out = proc.stdout + proc.stderr
    return [line for line in out.splitlines()
            if line.strip() and not line.startswith("Using workflow specific profile")]


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace("seed: 0\n", "seed: 0\nbogus_key: 1\n"), "bogus_key"),
    (lambda t: t.replace("dtype: null", "dtyp: null"), "output.dtyp"),
])
def test_a_schema_error_is_a_few_lines_naming_the_key(built, params, edit, key):
    params.write_text(edit(params.read_text()))
    proc = smk(built, "-n", MODEL, check=False)
    lines = _error_lines(proc)
    assert proc.returncode != 0
    assert len(lines) <= 5 and key in "\n".join(lines), lines  # not the whole schema (2,613 lines)


def test_a_cli_error_in_a_rule_is_shown_on_the_console(built, params):
    """A mistyped expert path: Snakemake took the existing merge for a source file ("Nothing
    to be done", exit 0); with the index job run, its one line is on the console under any
    profile, not only in the log (`show-failed-logs` is the default profile's setting)."""
    before = output_bytes(built / "merged")
    added_expert = "experts:\n  - {name: extra, path: models/nothere, weight: 0.3}\n"
    params.write_text(params.read_text().replace("experts:\n", added_expert))
    line = "mergepipe: error: models/nothere: no such model folder or file"
    for profile in ([], ["--workflow-profile", "none", "-c", "1"]):
        proc = smk(built, *profile, MODEL, check=False)
        assert proc.returncode != 0 and line in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert output_bytes(built / "merged") == before


def test_a_path_in_the_demo_folder_that_the_demo_does_not_make_is_refused(built, params):
    """`expert_3` for `expert_2` made the demo rule generate a fourth expert and merge it."""
    params.write_text(params.read_text().replace(EXPERT_2, EXPERT_2.replace("expert_2, weight", "expert_3, weight")))
    proc = smk(built, MODEL, check=False)
    lines = _error_lines(proc)
    assert proc.returncode != 0
    assert any("experts[2].path 'models/demo/expert_3'" in line for line in lines) and len(lines) <= 5, lines
    assert not (built / "models" / "demo" / "expert_3").exists()


def test_the_demo_rule_makes_exactly_the_demo_family(built, params):
    """Pointing expert_2 elsewhere regenerated the family without it; now the family is
    demo_experts (default 3) experts whatever params.yaml names."""
    shutil.copytree(built / "models" / "demo" / "expert_2", built / "models" / "mine", dirs_exist_ok=True)
    params.write_text(params.read_text().replace(EXPERT_2, EXPERT_2.replace("models/demo/expert_2", "models/mine")))
    jobs = pending_jobs(built, MODEL)
    assert "demo" not in jobs and jobs["index_expert"] == 1, jobs
    forced = smk(built, "-n", "-f", "demo")
    outputs = re.search(r"^\s+output: (.*)$", forced.stdout + forced.stderr, re.M).group(1)
    assert sorted(outputs.split(", ")) == ["models/demo/base", *(f"models/demo/expert_{k}" for k in range(3))]
