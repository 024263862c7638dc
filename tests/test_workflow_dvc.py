"""`dvc repro` on the tiny demo family: no-ops, budget changes, a reverted budget from the store, alternating with
Snakemake, and a fresh clone that rebuilds to the same dvc.lock."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from mergepipe.config.params import load_config
from mergepipe.output.manifest import verify_outputs
from mergepipe.commands.pipeline import plan_config
from mergepipe.index.store import Store
from mergepipe.output.run_record import record_path
from tests.helpers.workflow import MODEL, job_counts, make_workspace, run, set_budget, smk

GIT = ["git", "-c", "user.name=mergepipe-test", "-c", "user.email=test@example.invalid",
       "-c", "init.defaultBranch=main"]


def dvc(ws: Path, *args: str) -> str:
    proc = run(ws, "dvc", *args)
    return proc.stdout + proc.stderr


def git(ws: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*GIT, *args], cwd=ws, capture_output=True, text=True, check=check)


_PLANS: dict[tuple[Path, str], str] = {}


def expected_plan_hash(ws: Path, tmp: Path) -> str:
    """The plan hash params.yaml asks for, computed apart from the workspace's caches."""
    key = (ws, (ws / "params.yaml").read_text())
    if key not in _PLANS:
        plan, _ = plan_config(load_config(ws / "params.yaml"), Store(tmp / f"cache-{time.monotonic_ns()}"))
        _PLANS[key] = plan.plan_hash
    return _PLANS[key]


def check_output_matches_params(ws: Path, tmp: Path) -> dict:
    man = verify_outputs(ws / "merged")
    assert man["plan_hash"] == expected_plan_hash(ws, tmp), "output is stale: its manifest disagrees with params.yaml"
    return man


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A git + DVC workspace (committed workflow files and mergepipe source) after `dvc repro`."""
    ws = make_workspace(tmp_path_factory.mktemp("dvc") / "ws", with_source=True)
    git(ws, "init", "-q")
    git(ws, "add", ".")
    git(ws, "commit", "-q", "-m", "workflow")
    out = dvc(ws, "repro")
    assert "Running stage 'demo'" in out and "Running stage 'build'" in out
    return ws


def test_repro_builds_then_is_a_noop(repo, tmp_path):
    man = check_output_matches_params(repo, tmp_path)
    assert man["budget"]["spec"] == "25%"
    t0 = time.monotonic()
    out = dvc(repo, "repro")
    print(f"\nno-op `dvc repro`: {time.monotonic() - t0:.2f} s")
    assert "Running stage" not in out and "didn't change" in out
    assert "up to date" in dvc(repo, "status")
    assert job_counts(smk(repo, "-n", MODEL)) == {}  # Snakemake agrees: DVC ran it


def test_budget_change_then_revert_comes_from_the_store(repo, tmp_path):
    set_budget(repo, "50%")
    out = dvc(repo, "repro")
    assert "Running stage 'build'" in out and "Stage 'demo' didn't change" in out
    assert check_output_matches_params(repo, tmp_path)["budget"]["spec"] == "50%"
    set_budget(repo, "25%")
    t0 = time.monotonic()
    out = dvc(repo, "repro")
    print(f"\nrevert to 25% via `dvc repro`: {time.monotonic() - t0:.2f} s")
    # the output is `persist` (DVC must not delete a user's folder at output.dir), which turns
    # off DVC's run-cache for it: Snakemake reruns and the merge comes from mergepipe's store
    assert "Running stage 'build'" in out and "skipping run" not in out
    assert check_output_matches_params(repo, tmp_path)["budget"]["spec"] == "25%"
    assert "restored_from" in json.loads(record_path(repo / "merged").read_text())


def test_alternating_snakemake_and_dvc_never_gives_a_stale_output(repo, tmp_path):
    # Starts where the revert test left off (once DVC's run-cache restored the 25% merge without
    # Snakemake, whose last plan was the 50% one). Going back to 50% must not find that plan "up to date".
    steps = [("50%", "snakemake"), ("25%", "dvc"), ("50%", "dvc"), ("25%", "snakemake")]
    for budget, tool in steps:
        set_budget(repo, budget)
        if tool == "dvc":
            dvc(repo, "repro")
        else:
            smk(repo, MODEL)
        man = check_output_matches_params(repo, tmp_path)
        assert man["budget"]["spec"] == budget, (budget, tool)
    assert job_counts(smk(repo, "-n", MODEL)) == {}


def test_fresh_clone_rebuilds_the_same_lock(repo, tmp_path):
    set_budget(repo, "25%")
    dvc(repo, "repro")
    assert "up to date" in dvc(repo, "status")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "dvc.lock")
    lock = json.dumps((repo / "dvc.lock").read_text())
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    assert not (clone / "models" / "demo").exists() and not (clone / "merged").exists()
    dvc(clone, "repro")  # no DVC cache, no models, no store: everything is rebuilt
    diff = git(clone, "diff", "--exit-code", "dvc.lock", check=False)
    assert diff.returncode == 0, f"dvc.lock differs after a rebuild from scratch:\n{diff.stdout}"
    assert json.dumps((clone / "dvc.lock").read_text()) == lock
    verify_outputs(clone / "merged")
