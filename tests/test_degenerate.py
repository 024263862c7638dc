"""Degenerate shapes (issue 15): 0-d tensors that differ from the base and zero-size tensors of
any shape ([2**50, 0], [0], [3, 0, 5]) merge with every method, and nothing is allocated by
shape (a [2**50, 0] tensor once became 2**38 block ranges: 24 GB, then killed)."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergepipe.cli import main

REPO = Path(__file__).resolve().parent.parent
METHODS = {"task_arithmetic": {"lambda": 1.0}, "ties": {"density": 0.5}, "dare_ties": {"density": 0.5},
           "breadcrumbs_ties": {"density": 0.5, "gamma": 0.1}, "linear": {}, "slerp": {"t": 0.3},
           "dare_linear": {"density": 0.9}, "breadcrumbs": {"density": 0.5, "gamma": 0.1}}


def _write(folder: Path, tensors: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("degenerate")
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(8, 8, generator=g).bfloat16(), "s": torch.tensor(1.5).bfloat16(),
            "f": torch.tensor(0.25), "i": torch.tensor(3, dtype=torch.int64),
            "huge_empty": torch.zeros(2**50, 0, dtype=torch.bfloat16), "z": torch.zeros(0, dtype=torch.bfloat16),
            "m": torch.zeros(3, 0, 5), "e3": torch.zeros(0, 2**40, 4, dtype=torch.float16)}
    e1 = dict(base, w=(base["w"].float() + 0.125).bfloat16(), s=torch.tensor(2.5).bfloat16(), f=torch.tensor(-0.5))
    e2 = dict(base, s=torch.tensor(-1.0).bfloat16(), f=torch.tensor(0.75))
    for name, t in (("base", base), ("e1", e1), ("e2", e2)):
        _write(root / name, t)
    return root


def _params(family: Path, tmp: Path, method: str) -> Path:
    experts = [{"name": "e1", "path": str(family / "e1"), "weight": 1.0}]
    if method != "slerp":
        experts.append({"name": "e2", "path": str(family / "e2"), "weight": 0.5})
    cfg = {"base": str(family / "base"), "experts": experts, "method": method, "parameters": METHODS[method],
           "seed": 0, "budget": "full", "block_bytes": "4KiB", "output": {"dir": str(tmp / "out")},
           "cache_dir": str(tmp / "cache")}
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("method", sorted(METHODS))
def test_degenerate_shapes_merge_with_every_method(method, family, tmp_path):
    assert main(["run", str(_params(family, tmp_path, method)), "-q"]) == 0
    assert main(["verify", str(tmp_path / "out")]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    base = load_file(family / "base" / "model.safetensors")
    for name in ("huge_empty", "z", "m", "e3", "i"):
        assert got[name].shape == base[name].shape and got[name].dtype == base[name].dtype
    assert got["s"].shape == () and got["f"].shape == ()
    if method == "task_arithmetic":  # base + 1.0 * (e1 - base) + 0.5 * (e2 - base)
        assert got["s"].item() == 1.5 + 1.0 * 1.0 + 0.5 * -2.5
        assert got["f"].item() == 0.25 + 1.0 * -0.75 + 0.5 * 0.5


def test_degenerate_shapes_allocate_nothing_by_shape(family, tmp_path):
    """The whole run under a 6 GB address-space limit (torch and numba need a few GB of it)."""
    cfg = _params(family, tmp_path, "ties")
    limit = 6 << 30

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "mergepipe", "run", str(cfg), "-q"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, preexec_fn=cap)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["outputs"]["tensors"]["huge_empty"]
