"""Exact rank cuts of the delta index on hard inputs, against a direct torch computation.

Covers what the compiled counting kernels must get right: fp32 deltas that use all 32
bits, fp16, long runs of ties (cuts inside them need per-block equal counts), blocks
identical to the base (exact zeros), Inf/NaN, all-equal tensors, tensors too big for
the in-memory cache (reread between passes), and the one-scan expert build.
"""
import pytest
import torch
from safetensors.torch import save_file

from mergepipe.index import scan as index_scan
from mergepipe.index.build import build_delta_index, build_expert_index, build_model_index
from mergepipe.methods import requested_ranks
from mergepipe.checkpoint.safetensors import open_checkpoint


def _pair(tmp_path, base: dict, exp: dict):
    for name, tensors in (("base", base), ("exp", exp)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    return open_checkpoint(tmp_path / "base"), open_checkpoint(tmp_path / "exp")


def _check(delta, base: dict, exp: dict, index) -> None:
    for name in base:
        td = delta.tensors[name]
        a = (exp[name].float() - base[name].float()).abs().reshape(-1)
        a = torch.where(torch.isnan(a), torch.full_like(a, float("nan")).abs(), a)
        n = a.numel()
        assert list(td.ranks) == [0, *requested_ranks(n)]
        srt = torch.sort(a.view(torch.int32), descending=True).values.view(torch.float32)  # NaN bits sort first
        rows = a.reshape(base[name].shape[0] if base[name].dim() else 1, -1) if n else None
        for j, r in enumerate(td.ranks):
            if r == 0:
                continue
            want = srt[r - 1]
            got = torch.tensor([td.values[j]], dtype=torch.float32)
            assert got.view(torch.int32).item() == want.view(torch.int32).item(), (name, r)
            bits = a.view(torch.int32)
            v = want.view(torch.int32)
            assert td.count_gt[j] == int((bits > v).sum()), (name, r)
            assert td.count_eq[j] == int((bits == v).sum()), (name, r)
            split = 0 < r - td.count_gt[j] < td.count_eq[j]
            assert (j in td.block_eq) == split, (name, r)
            if split:
                per_block = [int((rows[r0:r1].reshape(-1).view(torch.int32) == v).sum())
                             for r0, r1 in index.tensors[name].ranges]
                assert list(td.block_eq[j]) == per_block, (name, r)


def _family(dtype):
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(257, 96, generator=g), "v": torch.randn(1000, generator=g),
            "flat": torch.zeros(64, 40), "one": torch.tensor(2.0), "empty": torch.zeros(0, 8)}
    exp = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    exp["w"][:100] = base["w"][:100]  # identical rows: exact zeros in whole blocks
    exp["w"][200:] = base["w"][200:] + 0.25  # a long run of one tied value
    exp["flat"] = base["flat"] + 0.5  # every |delta| equal
    return {k: v.to(dtype) for k, v in base.items()}, {k: v.to(dtype) for k, v in exp.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_bytes", [0, 256 << 20])
@pytest.mark.parametrize("block_counts_cap", [0, index_scan.BLOCK_COUNTS_CAP])  # 0: split counts by a rescan
def test_cuts_exact_for_dtypes_and_rereads(tmp_path, monkeypatch, dtype, cache_bytes, block_counts_cap):
    monkeypatch.setattr(index_scan, "BLOCK_COUNTS_CAP", block_counts_cap)
    base, exp = _family(dtype)
    bc, ec = _pair(tmp_path, base, exp)
    bi, ei = build_model_index(bc, block_bytes=2048), build_model_index(ec, block_bytes=2048)
    delta = build_delta_index(bc, ec, bi, ei, cache_bytes=cache_bytes)
    _check(delta, base, exp, ei)
    assert any(delta.tensors["w"].identical) and not all(delta.tensors["w"].identical)


def test_nonfinite_deltas_are_counted_and_cut(tmp_path):
    base, exp = _family(torch.float32)
    exp["v"][3] = float("inf")
    exp["v"][7] = float("nan")
    exp["v"][9] = -float("nan")
    bc, ec = _pair(tmp_path, base, exp)
    bi, ei = build_model_index(bc, block_bytes=1024), build_model_index(ec, block_bytes=1024)
    delta = build_delta_index(bc, ec, bi, ei)
    assert delta.tensors["v"].nonfinite == 3
    # the largest cuts are NaN/Inf; the rest stay exact
    td = delta.tensors["v"]
    a = (exp["v"] - base["v"]).abs()
    finite = a[torch.isfinite(a)]
    for j, r in enumerate(td.ranks):
        if r > 3:
            assert td.values[j] == torch.sort(finite, descending=True).values[r - 4].item()


def test_one_scan_expert_build_equals_two_step(tmp_path):
    base, exp = _family(torch.bfloat16)
    bc, ec = _pair(tmp_path, base, exp)
    bi, ei = build_model_index(bc, block_bytes=2048), build_model_index(ec, block_bytes=2048)
    two_step = build_delta_index(bc, ec, bi, ei, threads=2)
    index, one_scan = build_expert_index(bc, ec, bi, block_bytes=2048, threads=1)
    assert index == ei
    assert one_scan == two_step


def test_a_file_changed_while_indexing_is_not_recorded(tmp_path, monkeypatch):
    import os

    from mergepipe.index import store as store_mod
    from mergepipe.errors import CheckpointError
    base, exp = _family(torch.bfloat16)
    _pair(tmp_path, base, exp)
    st = store_mod.Store(tmp_path / "cache")
    bc, bi = st.model_index(tmp_path / "base", block_bytes=2048)
    from mergepipe.index import build as build_mod  # the store imports it when it builds
    real = build_mod.build_expert_index

    def touching(*a, **kw):  # the expert's file is rewritten while it is scanned
        out = real(*a, **kw)
        f = tmp_path / "exp" / "model.safetensors"
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))
        return out

    monkeypatch.setattr(build_mod, "build_expert_index", touching)
    with pytest.raises(CheckpointError, match="changed while it was being indexed"):
        st.expert_index(tmp_path / "exp", bc, bi)
    monkeypatch.setattr(build_mod, "build_expert_index", real)
    assert not (tmp_path / "cache" / "deltas").exists()
    _, index, _ = st.expert_index(tmp_path / "exp", bc, bi)  # a rerun indexes it
    assert index == build_model_index(open_checkpoint(tmp_path / "exp"), block_bytes=2048)
