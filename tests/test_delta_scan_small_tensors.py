"""The small-tensor delta scan (index/scan.py `_run_small`, a sort) gives the same DeltaIndex as
the histogram passes, for every dtype, ties at the cuts, identical blocks, NaN/Inf, 0-d, empty
and multi-block tensors (issue 15: per-tensor overhead)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.index import scan
from mergepipe.index.build import build_expert_index, build_model_index


def _family(tmp_path, seed: int):
    g = torch.Generator().manual_seed(seed)
    base, expert = {}, {}
    shapes = [(), (1,), (3,), (7, 5), (64, 32), (2, 0), (0,), (300, 13), (1, 4096), (40, 100)]
    for k, shape in enumerate(shapes):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            name = f"t{k}.{str(dtype)[6:]}"
            b = torch.randn(shape, generator=g).to(dtype)
            d = torch.randn(shape, generator=g)
            kind = (k + seed) % 5
            if kind == 1:  # few distinct |delta| values: ties at every cut
                d = torch.sign(d) * (torch.randint(0, 3, shape, generator=g).float() / 4)
            elif kind == 2 and b.numel():  # identical to the base
                d = torch.zeros(shape)
            elif kind == 3 and b.numel() > 2:  # NaN and Inf
                d = d.clone()
                d.view(-1)[0], d.view(-1)[1] = float("nan"), float("inf")
            elif kind == 4 and len(shape) == 2 and shape[0] > 4:  # half the rows identical (some blocks)
                d[: shape[0] // 2] = 0
            base[name] = b
            expert[name] = (b.float() + d).to(dtype)
    (tmp_path / "base").mkdir()
    (tmp_path / "exp").mkdir()
    save_file(base, tmp_path / "base" / "model.safetensors")
    save_file(expert, tmp_path / "exp" / "model.safetensors")
    return open_checkpoint(tmp_path / "base"), open_checkpoint(tmp_path / "exp")


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("block_bytes", [4096, 1 << 20])
def test_small_scan_equals_histogram_scan(seed, block_bytes, tmp_path, monkeypatch):
    base, exp = _family(tmp_path, seed)
    base_index = build_model_index(base, block_bytes=block_bytes, threads=1)
    got = {}
    for small in (0, 1 << 30):
        monkeypatch.setattr(scan, "SMALL_NUMEL", small)
        index, delta = build_expert_index(base, exp, base_index, block_bytes=block_bytes, threads=1)
        got[small] = json.dumps([index.to_json(), delta.to_json()], sort_keys=True)
    assert got[0] == got[1 << 30]
    tensors = json.loads(got[0])[1]["tensors"]
    assert any(t["block_eq"] for t in tensors)  # ties split by a cut: per-block equal counts compared too
    if block_bytes == 4096:
        assert any(len(t["identical"]) > 1 for t in tensors)  # multi-block small tensors
