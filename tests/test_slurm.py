"""The demo through profiles/slurm on a one-node SLURM started on this machine.

scripts/slurm_localhost.sh installs Debian's slurm-wlm and munge (apt, as root) and starts
slurmctld + slurmd on localhost; the test is skipped, saying why, only where that cannot be
done (no root, apt unreachable, a SLURM of the machine's own already configured or running).
"""
from __future__ import annotations

import subprocess
import time

import pytest

from mergepipe.cli import main
from mergepipe.output.manifest import verify_outputs
from tests.helpers.workflow import MODEL, REPO, job_counts, make_workspace, output_bytes, smk

pytestmark = pytest.mark.slow
SCRIPT = REPO / "scripts" / "slurm_localhost.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    proc = subprocess.run(["bash", str(SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(f"no one-node SLURM here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield state
    subprocess.run(["bash", str(SCRIPT), "stop", str(state)], timeout=120)


def test_demo_through_the_slurm_profile(slurm, tmp_path):
    ws = make_workspace(tmp_path / "ws")
    t0 = time.monotonic()
    # The profile as committed, plus what this one-node test cluster needs: no accounts and no
    # accounting database (so squeue for job states), small jobs, and quick first status checks.
    proc = smk(ws, "--profile", "profiles/slurm", "--slurm-no-account", "--slurm-status-command", "squeue",
               "--slurm-init-seconds-before-status-checks", "2", "--default-resources", "mem_mb=500", "runtime=10",
               # small enough for a node sized from MemAvailable/2 on a busy machine
               "--set-resources", "merge_part:mem_mb=500",
               # one CPU per parallel job, so two share this node at a time: the plugin backs off 10 s
               # more on each status check that finds no job finished, so every round of jobs the
               # node runs one after another costs ~12 s (the bytes do not depend on the threads)
               "--set-threads", "index_expert=1", "merge_part=1",
               "--config", "merge_parts=3", "--", MODEL, timeout=1500)
    print(f"\nsnakemake --profile profiles/slurm on the tiny demo: {time.monotonic() - t0:.0f} s")
    counts = job_counts(proc)
    assert counts == {"demo": 1, "index_base": 1, "index_expert": 3, "plan": 1, "merge_part": 3, "gather": 1}
    out = proc.stdout + proc.stderr
    assert out.count("submitted with SLURM jobid") == 3 + 1 + 3 + 1  # every rule but demo and plan
    verify_outputs(ws / "merged")
    # the same bytes as one local job (own cache: nothing restored from the workspace's store)
    assert main(["merge", str(ws / "plans" / "plan.json"), "-o", str(tmp_path / "local"), "--root", str(ws),
                 "--cache-dir", str(tmp_path / "cache"), "--params", str(ws / "params.yaml"), "-q"]) == 0
    assert output_bytes(ws / "merged") == output_bytes(tmp_path / "local")
