"""The delta index's kernels, compiled: the C build (index/_indexc.c, the extension module
`_indexc`, the build for this CPU's x86-64 level: util/cpu.py) loaded with ctypes, or, where it
was not built, the numba kernels of index/kernels.py behind the same calls. Both give the
same results (tests/test_index_kernels.py); ctypes releases the GIL during each call, as
numba's nogil, so index threads run them in parallel.

    delta_bf16(base_u16, expert_u16, d, hist) / delta_f32(base, expert, d, hist)
        -> (nnz, nonfinite, sum b^2, sum e^2, sum b*e, finite sum d^2, finite sum d)
        d = |expert - base| (fp32) is written; hist (int64, 2^15) counts its upper 16 bits,
        or is None (not counted)
    slerp_sums(b, e) -> (sum b^2, sum e^2, sum b*e)      fp32 arrays
    count_low(bits, slot_of_bin, table, occupied, n_occupied) -> new n_occupied
    count_equal(bits, index_of_bin, wanted, counts)
"""
from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import numpy as np

from mergepipe.util import cpu

MODULE = "mergepipe.index._indexc"  # one build per x86-64 level (setup.py)
HI_BINS = 1 << 15
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_loaded: SimpleNamespace | None = None


def kernels() -> SimpleNamespace:
    """The C kernels, or the numba ones where the library was not built (loaded once)."""
    global _loaded
    if _loaded is None:
        _loaded = _open_c() or _numba()
    return _loaded


def _open_c() -> SimpleNamespace | None:
    """The highest build of the library this CPU may run (util/cpu.py), or None if none was built."""
    build = cpu.best_build(MODULE)
    return None if build is None else _bind(ctypes.CDLL(str(build[0])), build[1])


def _bind(lib: ctypes.CDLL, level: str) -> SimpleNamespace:
    for name in ("mp_delta_stats_bf16", "mp_delta_stats_f32"):
        getattr(lib, name).argtypes = [_P, _P, _I64, _P, _P, _P, _P]
        getattr(lib, name).restype = None
    lib.mp_slerp_sums_f32.argtypes = [_P, _P, _I64, _P]
    lib.mp_slerp_sums_f32.restype = None
    for name in ("mp_count_low_i32", "mp_count_low_i64"):
        getattr(lib, name).argtypes = [_P, _I64, _P, _I64, _P, _P, _I64]
        getattr(lib, name).restype = _I64
    lib.mp_count_equal.argtypes = [_P, _I64, _P, _P, _P, _I64]
    lib.mp_count_equal.restype = ctypes.c_int

    def _stats(fn, base, expert, d, hist, dtype):
        n = _check(dtype, base, expert)
        _check(np.float32, d, n=n)
        if hist is not None:
            _check(np.int64, hist, n=HI_BINS)
        out, counts = np.empty(5, np.float64), np.empty(2, np.int64)
        fn(base.ctypes.data, expert.ctypes.data, n, d.ctypes.data, None if hist is None else hist.ctypes.data,
           out.ctypes.data, counts.ctypes.data)
        return (int(counts[0]), int(counts[1]), *_canonical(out.tolist()))

    def delta_bf16(base, expert, d, hist):
        return _stats(lib.mp_delta_stats_bf16, base, expert, d, hist, np.uint16)

    def delta_f32(base, expert, d, hist):
        return _stats(lib.mp_delta_stats_f32, base, expert, d, hist, np.float32)

    def slerp_sums(b, e):
        n = _check(np.float32, b, e)
        out = np.empty(3, np.float64)
        lib.mp_slerp_sums_f32(b.ctypes.data, e.ctypes.data, n, out.ctypes.data)
        return _canonical(out.tolist())

    def count_low(bits, slot_of_bin, table, occupied, n_occupied):
        n = _check(np.int32, bits)
        _check(np.int64, slot_of_bin, n=HI_BINS)
        m = int(slot_of_bin.max())  # the ignored slot; stride m + 1, as index/kernels.py
        fn = {np.dtype(np.int32): lib.mp_count_low_i32, np.dtype(np.int64): lib.mp_count_low_i64}[table.dtype]
        if table.size < (m + 1) << 16 or occupied.size < min(n, (m + 1) << 16) + n_occupied or not (
                table.flags.c_contiguous and occupied.flags.c_contiguous and occupied.dtype == np.int64):
            raise ValueError("count_low: table or occupied list too small or not contiguous")
        return int(fn(bits.ctypes.data, n, slot_of_bin.ctypes.data, m, table.ctypes.data, occupied.ctypes.data,
                      int(n_occupied)))

    def count_equal(bits, index_of_bin, wanted, counts):
        n = _check(np.int32, bits)
        _check(np.int64, index_of_bin, n=HI_BINS)
        _check(np.int32, wanted)
        _check(np.int64, counts, n=wanted.size)
        if int(index_of_bin.max()) >= counts.size or int(index_of_bin.min()) < 0:
            raise ValueError("count_equal: a bin points past the counters")
        if lib.mp_count_equal(bits.ctypes.data, n, index_of_bin.ctypes.data, wanted.ctypes.data,
                              counts.ctypes.data, counts.size) != 0:
            raise MemoryError("count_equal: no memory for its lanes")

    return SimpleNamespace(delta_bf16=delta_bf16, delta_f32=delta_f32, slerp_sums=slerp_sums,
                           count_low=count_low, count_equal=count_equal, backend="c", level=level)


def _canonical(sums) -> tuple[float, ...]:
    """Sums with NaN inputs are NaN, but which NaN (its sign) depends on the order in which
    the compiler put the operands of an add: one NaN for every backend and CPU, so the index
    stays the same bytes."""
    return tuple(math.nan if x != x else x for x in sums)


def _check(dtype, *arrays: np.ndarray, n: int | None = None) -> int:
    # the C loops trust their lengths: every array contiguous, of the dtype and the same size
    n = arrays[0].size if n is None else n
    for a in arrays:
        if a.dtype != dtype or a.ndim != 1 or a.size != n or not a.flags.c_contiguous:
            raise ValueError(f"index kernel: need contiguous 1-d {np.dtype(dtype)} arrays of {n} elements, "
                             f"got {a.dtype} {a.shape}")
    return n


def _numba() -> SimpleNamespace:
    """The same calls over the numba kernels (imports numba: ~0.7 s per process)."""
    from mergepipe.index import kernels as nk

    def _rest(b, e, d, hist):
        bits = d.view(np.int32)
        nonfinite = int(np.count_nonzero(bits >= 0x7F800000))
        nnz = nk.hist_high(bits, hist) if hist is not None else int(np.count_nonzero(bits))
        return (nnz, nonfinite, *_canonical((*nk.slerp_sums(b, e), *nk.finite_norms(d))))

    def delta_bf16(base, expert, d, hist):
        b, e = np.empty(d.size, np.float32), np.empty(d.size, np.float32)
        nk.bf16_abs_delta(base, expert, b, e, d)
        return _rest(b, e, d, hist)

    def delta_f32(base, expert, d, hist):
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(expert, base, out=d)
        np.abs(d, out=d)
        return _rest(base, expert, d, hist)

    def slerp_sums(b, e):
        return _canonical(nk.slerp_sums(b, e))

    return SimpleNamespace(delta_bf16=delta_bf16, delta_f32=delta_f32, slerp_sums=slerp_sums,
                           count_low=nk.count_low, count_equal=nk.count_equal, backend="numba", level=None)
