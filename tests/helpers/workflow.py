"""Helpers of the workflow tests (Snakemake, DVC, SLURM): a workspace holding a copy of the
repo's workflow files, the tools run in it, and what their job tables say."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest


REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WORKFLOW_FILES = ["Snakefile", "rules", "profiles", "schemas", "params.yaml", "dvc.yaml", ".dvcignore", ".dvc/config",
                  ".dvc/.gitignore", ".gitignore"]
MODEL = "merged/model.safetensors"


def make_workspace(dest: Path, *, with_source: bool = False) -> Path:
    """Copy the workflow files (and, for DVC's deps, mergepipe's source) to dest."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src, dst = REPO / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    if with_source:
        shutil.copytree(REPO / "mergepipe", dest / "mergepipe", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


class Built(NamedTuple):
    """A workspace after `snakemake merged/model.safetensors`, and what that build printed."""
    ws: Path
    output: str


def build_demo(dest: Path) -> Built:
    ws = make_workspace(dest)
    proc = smk(ws, MODEL)
    return Built(ws, proc.stdout + proc.stderr)


def copy_workspace(src: Path, dest: Path) -> Path:
    """dest as up to date as src for Snakemake: copy2 keeps the mtimes it compares, links stay links."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


def tool_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAKEMAKE_", "DVC_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", MERGEPIPE_DEMO_PRESET="tiny", DVC_NO_ANALYTICS="1")
    return env


def run(ws: Path, *cmd: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    exe = str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0]
    proc = subprocess.run([exe, *cmd[1:]], cwd=ws, env=tool_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def smk(ws: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return run(ws, "snakemake", *args, **kw)


def job_counts(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """rule -> number of jobs, from the job table a (dry) run prints; {} when nothing to do."""
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)
            if m.group(1) != "total"}


def pending_jobs(ws: Path, *args: str) -> dict[str, int]:
    """rule -> count of the jobs `snakemake -n` would run ({} when nothing)."""
    return job_counts(smk(ws, "-n", *args))


def set_budget(ws: Path, budget: str) -> None:
    params = ws / "params.yaml"
    text, n = re.subn(r"^budget: .*$", f"budget: {budget}", params.read_text(), flags=re.M)
    assert n == 1
    params.write_text(text)


def manifest(ws: Path) -> dict:
    return json.loads((ws / "merged" / "manifest.json").read_text())


def output_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
