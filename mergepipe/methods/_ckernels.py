"""The C build of the bf16 merge kernels (methods/_bf16c.c, built as the extension module
`_bf16c`), loaded with ctypes, with the same call signatures as the numba ones in
methods/_kernels.py.

Why both: importing numba and loading its cached kernels costs ~0.7 s per process, more than
a small budget's whole merge; the C library loads in about a millisecond. It is compiled when
the package is installed, once per x86-64 level (setup.py; util/cpu.py picks the build);
where it was not built (a checkout without a compiler), `load()` returns None and
methods/_compiled.py falls back to numba.
The two give the same bytes (tests/test_merge_kernels.py). ctypes releases the GIL during
each call, so reader and hashing threads keep running, as with numba's nogil.
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np

from mergepipe.util import cpu

MODULE = "mergepipe.methods._bf16c"  # one build per x86-64 level (setup.py)
KEEP_ALL, DROP_ALL, CUT = 0, 1, 2  # the trim modes, as in methods/_kernels.py

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_loaded: SimpleNamespace | None | bool = False


def load() -> SimpleNamespace | None:
    """The kernels as a namespace (task_arithmetic_bf16, ties_bf16, eq_limit and the modes),
    or None when the library was not built."""
    global _loaded
    if _loaded is False:
        _loaded = _open()
    return _loaded


def _open() -> SimpleNamespace | None:
    """The highest build of the library this CPU may run (util/cpu.py), or None if none was built."""
    build = cpu.best_build(MODULE)
    return None if build is None else _bind(ctypes.CDLL(str(build[0])), build[1])


def _bind(lib: ctypes.CDLL, level: str) -> SimpleNamespace:
    lib.mp_task_arithmetic_bf16.argtypes = [_P, _P, _I64, _P, _F32, _INT, _F32, _INT, _P, _I64]
    lib.mp_task_arithmetic_bf16.restype = None
    lib.mp_ties_bf16.argtypes = [_P, _P, _P, _P, _I64, _P, _P, _P, _P, _INT, _F32, _INT, _P, _I64]
    lib.mp_ties_bf16.restype = _INT
    lib.mp_task_arithmetic_sketch_bf16.argtypes = [_P, _P, _P, _P, _I64, _P, _F32, _INT, _F32, _INT, _P, _I64]
    lib.mp_task_arithmetic_sketch_bf16.restype = None
    lib.mp_eq_limit.argtypes = [_P, _P, _F32, _I64, _I64]
    lib.mp_eq_limit.restype = _I64
    lib.mp_sketch_bf16.argtypes = [_P, _P, _I64, _P, _P]
    lib.mp_sketch_bf16.restype = _I64

    def task_arithmetic_bf16(base, experts, weights, divisor, normalize, lambda_, apply_lambda, out):
        n = _length(base, out, experts)
        w = _array(weights, np.float32, len(experts))
        lib.mp_task_arithmetic_bf16(base.ctypes.data, _pointers(experts, n), len(experts), w.ctypes.data,
                                    float(divisor), int(bool(normalize)), float(lambda_),
                                    int(bool(apply_lambda)), out.ctypes.data, n)

    def ties_bf16(base, experts, weights, modes, values, limits, normalize, lambda_, apply_lambda, out):
        n = _length(base, out, experts)
        _ties(base, _pointers(experts, n), None, None, weights, modes, values, limits, normalize, lambda_,
              apply_lambda, out, n)

    def ties_sketch_bf16(base, entries, weights, modes, values, limits, normalize, lambda_, apply_lambda, out):
        """entries: per expert in canonical order, a uint16 block or (codes bytes, alpha): a
        sketch, merged untrimmed (its mode is ignored)."""
        n = _length(base, out, [e for e in entries if isinstance(e, np.ndarray)] or [base])
        ptrs, cptrs, alphas, keep = _sketch_entries(entries, n)
        _ties(base, ptrs, cptrs, alphas, weights, modes, values, limits, normalize, lambda_, apply_lambda, out, n)

    def _ties(base, ptrs, cptrs, alphas, weights, modes, values, limits, normalize, lambda_, apply_lambda, out, n):
        p = len(ptrs)
        w, md = _array(weights, np.float32, p), _array(modes, np.int64, p)
        v, lim = _array(values, np.float32, p), _array(limits, np.int64, p)
        if lib.mp_ties_bf16(base.ctypes.data, ptrs, cptrs, None if alphas is None else alphas.ctypes.data, p,
                            w.ctypes.data, md.ctypes.data, v.ctypes.data, lim.ctypes.data, int(bool(normalize)),
                            float(lambda_), int(bool(apply_lambda)), out.ctypes.data, n) != 0:
            raise MemoryError(f"ties kernel: no memory for {p} experts' chunk buffers")

    def task_arithmetic_sketch_bf16(base, entries, weights, divisor, normalize, lambda_, apply_lambda, out):
        """entries: per expert in canonical order, a uint16 block or (codes bytes, alpha)."""
        n, p = _length(base, out, [e for e in entries if isinstance(e, np.ndarray)] or [base]), len(entries)
        w = _array(weights, np.float32, p)
        ptrs, cptrs, alphas, keep = _sketch_entries(entries, n)
        lib.mp_task_arithmetic_sketch_bf16(base.ctypes.data, ptrs, cptrs, alphas.ctypes.data, p, w.ctypes.data,
                                           float(divisor), int(bool(normalize)), float(lambda_),
                                           int(bool(apply_lambda)), out.ctypes.data, n)

    def eq_limit(base, expert, value, eq_keep):
        n = _length(base, None, (expert,))
        return int(lib.mp_eq_limit(base.ctypes.data, _pointers((expert,), n)[0], float(value), int(eq_keep), n))

    def sketch_bf16(base, expert):
        """(codes, per-exponent mantissa sums, nnz) of one bf16 block's delta (index/sketch.py)."""
        n = _length(base, None, (expert,))
        codes, sums = np.empty((n + 3) // 4, np.uint8), np.empty(256, np.uint64)
        nnz = lib.mp_sketch_bf16(base.ctypes.data, expert.ctypes.data, n, codes.ctypes.data, sums.ctypes.data)
        return codes, sums, int(nnz)

    return SimpleNamespace(task_arithmetic_bf16=task_arithmetic_bf16, ties_bf16=ties_bf16, eq_limit=eq_limit,
                           task_arithmetic_sketch_bf16=task_arithmetic_sketch_bf16, sketch_bf16=sketch_bf16,
                           ties_sketch_bf16=ties_sketch_bf16,
                           KEEP_ALL=KEEP_ALL, DROP_ALL=DROP_ALL, CUT=CUT, backend="c", level=level)


def _length(base: np.ndarray, out: np.ndarray | None, experts) -> int:
    # the C loops trust their lengths: check every array is contiguous uint16 of the base's size
    n = base.shape[0]
    for a in (base, out, *experts):
        if a is not None and (a.dtype != np.uint16 or a.ndim != 1 or a.shape[0] != n
                              or not a.flags.c_contiguous):
            raise ValueError(f"bf16 kernel: need contiguous uint16 arrays of {n} elements, got {a.dtype} {a.shape}")
    if not experts:
        raise ValueError("bf16 kernel: need at least one expert block")
    return n


def _array(values, dtype, p: int) -> np.ndarray:
    a = np.ascontiguousarray(values, dtype=dtype)
    if a.shape != (p,):
        raise ValueError(f"bf16 kernel: need {p} per-expert values, got shape {a.shape}")
    return a


def _sketch_entries(entries, n: int):
    """Pointer arrays for a mix of read blocks and sketches: (block pointers, NULL for a
    sketch; code pointers; fp32 scales; the arrays to keep alive during the call)."""
    p = len(entries)
    ptrs, cptrs, alphas, keep = (ctypes.c_void_p * p)(), (ctypes.c_void_p * p)(), np.zeros(p, np.float32), []
    for i, e in enumerate(entries):
        if isinstance(e, np.ndarray):
            ptrs[i] = e.ctypes.data
        else:
            codes, alpha = e
            if len(codes) != (n + 3) // 4:
                raise ValueError(f"bf16 sketch kernel: {len(codes)} code bytes for {n} elements")
            buf = np.frombuffer(codes, np.uint8)
            keep.append(buf)
            cptrs[i], alphas[i] = buf.ctypes.data, alpha
    return ptrs, cptrs, alphas, keep


def _pointers(experts, n: int):
    return (ctypes.c_void_p * len(experts))(*(e.ctypes.data for e in experts))
