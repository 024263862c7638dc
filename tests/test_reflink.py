"""Copied base runs share extents on a reflink-capable file system.

The output header is padded so each weight file's data starts at the base's offset modulo
4 KiB (checkpoint/safetensors.py `align_like`), and util/fs.copy_range gives the aligned
middle of each copied run its own copy_file_range, which btrfs turns into a reflink. Checked
on a loop-mounted btrfs image; skipped where the machine cannot make one (not root, no
btrfs-progs, no loop device), which the skip reason says.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def btrfs(tmp_path):
    if os.geteuid() != 0 or not shutil.which("mkfs.btrfs") or not shutil.which("btrfs"):
        pytest.skip("needs root and btrfs-progs (apt-get install btrfs-progs) for a loop-mounted btrfs")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(256 << 20)
    made = _sh("mkfs.btrfs", "-q", str(img))
    if made.returncode != 0 or _sh("mount", "-o", "loop", str(img), str(mnt)).returncode != 0:
        pytest.skip(f"cannot mount a loop btrfs here: {made.stderr.strip() or 'mount failed'}")
    try:
        yield mnt
    finally:
        _sh("umount", str(mnt))


def _shared_bytes(path: Path) -> tuple[int, int]:
    """(total, set-shared) bytes of a file, from `btrfs filesystem du --raw`."""
    out = _sh("btrfs", "filesystem", "du", "--raw", "-s", str(path)).stdout.splitlines()[-1].split()
    return int(out[0]), int(out[2])


def test_copied_runs_are_reflinked_on_btrfs(btrfs):
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(2048, 1024, generator=g).bfloat16(), "b": torch.randn(1024, generator=g).bfloat16()}
    expert = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).bfloat16() for k, v in base.items()}
    for name, sd in (("base", base), ("expert", expert)):
        (btrfs / name).mkdir()
        save_file(sd, str(btrfs / name / "model.safetensors"))
    sync = _sh("sync")
    assert sync.returncode == 0
    cfg = {"base": "base", "experts": [{"name": "e", "path": "expert", "weight": 1.0}],
           "method": "task_arithmetic", "parameters": {"lambda": 1.0}, "budget": "10%",
           # energy: blocks left out stay base bytes (sketch, the default, computes every block it sketches)
           "plan": {"strategy": "energy"}, "block_bytes": "64KiB", "output": {"dir": "out"}, "cache_dir": "cache"}
    (btrfs / "params.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "mergepipe", "run", str(btrfs / "params.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = btrfs / "out" / "model.safetensors"
    _sh("sync")
    total, shared = _shared_bytes(out)
    # ~90% of the 4 MiB tensor is copied base bytes: nearly all of it must be shared extents
    assert shared >= 0.8 * 0.9 * base["w"].numel() * 2, (total, shared)
    v = subprocess.run([sys.executable, "-m", "mergepipe", "verify", "--deep", str(btrfs / "out")],
                       capture_output=True, text=True)
    assert v.returncode == 0, v.stderr
