"""The Snakemake build on the tiny demo family, in a copy of the repo's workflow files.

Each workspace holds the committed Snakefile, rules/, profiles/, schemas/ and params.yaml;
the demo rule generates the family (MERGEPIPE_DEMO_PRESET=tiny). Which jobs a call would
run is read from `snakemake -n`'s job table.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.commands.demo import make_family
from mergepipe.output.manifest import verify_outputs
from mergepipe.output.run_record import record_path
from tests.helpers.workflow import (MODEL, copy_workspace, job_counts, manifest, output_bytes, pending_jobs, set_budget,
                                    smk)


@pytest.fixture(scope="module")
def built(built_demo, tmp_path_factory) -> Path:
    """A copy of the session's workspace after `snakemake merged/model.safetensors` (budget 25%)."""
    assert "manifest merged/manifest.json" in built_demo.output  # the merge's summary is shown
    return copy_workspace(built_demo.ws, tmp_path_factory.mktemp("smk") / "ws")


def test_build_then_nothing_to_do(built):
    man = verify_outputs(built / "merged")
    assert man["budget"]["spec"] == "25%" and man["plan"]["method"] == "ties"
    assert man["bytes"]["expert_bytes_read"] <= man["budget"]["bytes"]
    t0 = time.monotonic()
    proc = smk(built, MODEL)
    print(f"\nno-op `snakemake {MODEL}`: {time.monotonic() - t0:.2f} s")
    assert job_counts(proc) == {}
    assert job_counts(smk(built)) == {"verify": 1, "all": 1}  # `all` also verifies
    assert (built / "logs" / "verify.txt").read_text().startswith("merged: OK")


def test_budget_change_reruns_plan_and_merge_and_revert_restores(built):
    first = output_bytes(built / "merged")
    set_budget(built, "50%")
    assert job_counts(smk(built, MODEL)) == {"plan": 1, "merge": 1}
    assert manifest(built)["budget"]["spec"] == "50%"
    set_budget(built, "25%")
    assert job_counts(smk(built, MODEL)) == {"plan": 1, "merge": 1}
    assert output_bytes(built / "merged") == first
    run_info = json.loads(record_path(built / "merged").read_text())
    assert run_info["restored_from"].endswith(manifest(built)["plan_hash"])  # from the store, not recomputed


def test_touched_model_reruns_nothing_costly(built):
    first = output_bytes(built / "merged")
    record = (built / "index" / "experts" / "expert_1.json").read_bytes()
    os.utime(built / "models" / "demo" / "expert_1" / "model.safetensors")
    # its index step rehashes it (the content might have changed); the merge is restored
    assert job_counts(smk(built, MODEL)) == {"index_expert": 1, "plan": 1, "merge": 1}
    assert (built / "index" / "experts" / "expert_1.json").read_bytes() == record
    assert output_bytes(built / "merged") == first
    assert "restored_from" in json.loads(record_path(built / "merged").read_text())
    assert pending_jobs(built, MODEL) == {}  # and the next call has nothing to do


def test_config_overrides_of_merge_keys_are_refused(built):
    proc = smk(built, "-n", MODEL, "--config", "budget=10%", check=False)
    assert proc.returncode != 0
    assert "edit it instead of overriding" in proc.stdout + proc.stderr


def test_split_merge_with_two_cores_is_byte_identical(built):
    single = output_bytes(built / "merged")
    assert main(["gc", "--cache-dir", str(built / ".mergepipe"), "-q"]) == 0  # no stored merge: parts compute
    shutil.rmtree(built / "merged")
    proc = smk(built, MODEL, "-c", "2", "--config", "merge_parts=3")
    assert job_counts(proc) == {"merge_part": 3, "gather": 1}
    assert output_bytes(built / "merged") == single
    logs = "".join(p.read_text() for p in (built / "logs" / "merge").glob("part-*-of-3.log"))
    assert logs.count("tensors, expert bytes read") == 3  # merged by the parts, not restored
    assert not list((built / ".mergepipe" / "parts").glob("part-*"))  # temp: removed after the gather


def test_local_cluster_profile_builds_the_same_merge(built):
    single = output_bytes(built / "merged")
    assert main(["gc", "--cache-dir", str(built / ".mergepipe"), "-q"]) == 0
    shutil.rmtree(built / "merged")
    proc = smk(built, "--profile", "profiles/local-cluster", MODEL)
    assert job_counts(proc) == {"merge_part": 3, "gather": 1}
    jobs = built / ".snakemake" / "local-cluster"
    assert len(list(jobs.glob("snakejob.merge_part.*.log"))) == 3 and list(jobs.glob("snakejob.gather.*.log"))
    assert output_bytes(built / "merged") == single
    verify_outputs(built / "merged")


def test_new_expert_indexes_only_that_expert(built, tmp_path):
    make_family(tmp_path / "fam", preset="tiny", n_experts=4)
    shutil.copytree(tmp_path / "fam" / "expert_3", built / "models" / "extra")
    params = built / "params.yaml"
    params.write_text(params.read_text().replace(
        "experts:\n", "experts:\n  - {name: extra, path: models/extra, weight: 0.3}\n"))
    assert job_counts(smk(built, MODEL)) == {"index_expert": 1, "plan": 1, "merge": 1}
    assert [e["name"] for e in manifest(built)["plan"]["experts"]].count("extra") == 1
    verify_outputs(built / "merged")
