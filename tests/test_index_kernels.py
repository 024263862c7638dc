"""The delta index's C kernels (index/_indexc.c via index/ckernels.py) against the numba ones
(index/kernels.py): the same statistics, counts and rank cuts, bit for bit, on blocks with
edge values (±0, subnormals, Inf, NaN with payloads), ties and lengths around the lanes and
chunks; every installed vector width this CPU runs; an index built with each backend is the same; and
indexing an expert imports no numba."""
from __future__ import annotations

import ctypes
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mergepipe.index import ckernels
from mergepipe.index import kernels as numba_kernels
from mergepipe.index.binfmt import encode_delta
from mergepipe.index.build import build_expert_index, build_model_index
from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.util import cpu
from tests.helpers import kernel_build

C = ckernels._open_c()
NUMBA = ckernels._numba()
SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x3F80, 0xBF80,
                    0x0080, 0x7F7F, 0xFF7F], np.uint16)


def _bf16_pair(seed: int, n: int, special: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
    base = base.astype(np.uint16)
    expert = base + rng.integers(-3, 4, n).astype(np.uint16)  # small deltas: many ties
    k = min(n, 64) if special else 0  # without: finite sums, so the lane order is compared too
    expert[rng.integers(0, n, k)] = rng.choice(SPECIAL, k)
    base[rng.integers(0, n, k // 2)] = rng.choice(SPECIAL, k // 2)
    same = rng.random(n) < 0.2
    expert[same] = base[same]
    return base, expert


def _stats(kern, fn: str, base, expert):
    d = np.empty(base.size, np.float32)
    hist = np.zeros(1 << 15, np.int64)
    out = getattr(kern, fn)(base, expert, d, hist)
    return out, d.view(np.int32).copy(), hist


def _same(a, b) -> None:
    # fp64 sums compared by their bits (NaN sums included), counts as integers
    for x, y in zip(a, b):
        assert np.float64(x).tobytes() == np.float64(y).tobytes(), (a, b)


def _kernels_agree(c) -> None:
    cases = [(0, 1), (1, 7), (2, 8), (3, 2047), (4, 2048), (5, 2049), (6, 20_003), (7, 1 << 16)]
    for (seed, n), special in [(c, s) for c in cases for s in (True, False)]:
        base, expert = _bf16_pair(seed, n, special)
        (c_out, c_bits, c_hist), (n_out, n_bits, n_hist) = (_stats(k, "delta_bf16", base, expert) for k in (c, NUMBA))
        _same(c_out, n_out)
        assert c_bits.tobytes() == n_bits.tobytes() and (c_hist == n_hist).all()
        _same(c.delta_bf16(base, expert, np.empty(n, np.float32), None), c_out)  # no histogram: the same stats
        b32, e32 = (np.left_shift(x.astype(np.uint32), 16).view(np.float32) for x in (base, expert))
        (c_out, c_bits, c_hist), (n_out, n_bits, n_hist) = (_stats(k, "delta_f32", b32, e32) for k in (c, NUMBA))
        _same(c_out, n_out)
        assert c_bits.tobytes() == n_bits.tobytes() and (c_hist == n_hist).all()
        _same(c.slerp_sums(b32, e32), NUMBA.slerp_sums(b32, e32))
        if not special:
            assert all(math.isfinite(x) for x in c_out[2:])


@pytest.mark.skipif(C is None, reason="the C index kernels were not built")
def test_the_c_index_kernels_are_built_and_used():
    assert ckernels.kernels().backend == "c"


@pytest.mark.skipif(C is None, reason="the C index kernels were not built")
def test_delta_statistics_equal_numba():
    _kernels_agree(C)


@pytest.mark.skipif(C is None, reason="the C index kernels were not built")
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_count_low_and_count_equal_equal_numba(table_dtype):
    """The same table and the same occupied list, in the same order."""
    for seed, n in [(1, 9), (2, 5000), (3, 1 << 17)]:
        base, expert = _bf16_pair(seed, n)
        _, bits, hist = _stats(C, "delta_bf16", base, expert)
        bins = np.unique(np.flatnonzero(hist)[:: max(1, len(np.flatnonzero(hist)) // 5)])
        m = len(bins)
        slot_of_bin = np.full(1 << 15, m, np.int64)
        slot_of_bin[bins] = np.arange(m)
        got = {}
        for name, kern in (("c", C), ("numba", NUMBA)):
            table = np.zeros((m + 1) << 16, table_dtype)
            occupied = np.empty(min(n, (m + 1) << 16) + 1, np.int64)
            k = kern.count_low(bits, slot_of_bin, table, occupied, 0)
            got[name] = (occupied[:k].tolist(), table[occupied[:k]].tolist())
        assert got["c"] == got["numba"]
        assert sum(got["c"][1]) == n  # every element counted once
        wanted = np.append(bits[:: max(1, n // 3)][:3], np.int32(-1)).astype(np.int32)
        index_of_bin = np.full(1 << 15, len(wanted) - 1, np.int64)
        index_of_bin[(wanted[:-1] >> 16) & 0x7FFF] = np.arange(len(wanted) - 1)
        counts = {name: np.zeros(len(wanted), np.int64) for name in ("c", "numba")}
        C.count_equal(bits, index_of_bin, wanted, counts["c"])
        numba_kernels.count_equal(bits, index_of_bin, wanted, counts["numba"])
        assert counts["c"].tolist() == counts["numba"].tolist()


@pytest.mark.skipif(C is None, reason="the C index kernels were not built")
def test_the_kernels_check_their_arrays():
    base, expert = _bf16_pair(0, 100)
    with pytest.raises(ValueError, match="contiguous 1-d float32 arrays of 100"):
        C.delta_bf16(base, expert, np.empty(99, np.float32), None)
    with pytest.raises(ValueError, match="uint16"):
        C.delta_bf16(base.astype(np.int32), expert, np.empty(100, np.float32), None)
    with pytest.raises(ValueError, match="too small"):
        C.count_low(np.zeros(10, np.int32), np.zeros(1 << 15, np.int64), np.zeros(10, np.int32),
                    np.zeros(11, np.int64), 0)


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_every_vector_width_gives_the_same_results(level):
    """Each installed build (SSE2, AVX2, AVX-512), where this CPU runs it, against numba."""
    lib = ctypes.CDLL(str(kernel_build(ckernels.MODULE, level)))
    _kernels_agree(ckernels._bind(lib, cpu.NAMES[level]))


def _pair(tmp_path: Path, dtype) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(300, 64, generator=g), "v": torch.randn(5000, generator=g),
            "s": torch.randn(7, generator=g)}
    exp = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    exp["w"][:50] = base["w"][:50]
    exp["w"][60, 3] = float("nan")
    exp["v"][10] = float("inf")
    for name, tensors in (("base", base), ("exp", exp)):
        (tmp_path / name).mkdir()
        save_file({k: v.to(dtype) for k, v in tensors.items()}, tmp_path / name / "model.safetensors")
    return tmp_path / "base", tmp_path / "exp"


@pytest.mark.skipif(C is None, reason="the C index kernels were not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_an_index_built_with_either_backend_is_the_same(tmp_path, monkeypatch, dtype):
    base, exp = _pair(tmp_path, dtype)
    built = {}
    for name, kern in (("c", C), ("numba", NUMBA)):
        monkeypatch.setattr(ckernels, "_loaded", kern)
        b = open_checkpoint(base)
        bi = build_model_index(b, block_bytes=4096)
        _, delta = build_expert_index(b, open_checkpoint(exp), bi, block_bytes=4096)
        built[name] = encode_delta(delta)  # bytes: NaN sums compare too
    assert built["c"] == built["numba"]


def test_indexing_an_expert_imports_no_numba(tmp_path):
    base, exp = _pair(tmp_path, torch.bfloat16)
    code = ("import sys; from mergepipe.cli import main; rc = main(sys.argv[1:]); "
            "print('numba' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "index", str(exp), "--base", str(base), "--cache-dir",
                           str(tmp_path / "cache"), "-q"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == ("True" if C is None else "False")
