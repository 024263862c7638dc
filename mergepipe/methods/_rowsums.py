"""Per-row fp64 sums of two fp32 arrays in a fixed order (numba, nogil): sum a^2, sum b^2, sum a*b.

The methods that normalize vectors inside a block (nuslerp's row mode) need each row's norms
and dot product. torch's reductions choose their order by CPU (vector width, vendor), so
their last bits would differ between machines; this loop uses the index's order
(index/kernels.py): 8 fp64 lanes, element j of a row in lane j % 8, lanes combined pairwise,
no fastmath. fp32 products are exact in fp64, so the sums are exact up to fp64 rounding.
Imported on first use (numba costs an import); compiled code is cached in __pycache__.
"""
from __future__ import annotations

import numpy as np
from numba import njit

LANES = 8


@njit(inline="always")
def _combine(acc: np.ndarray) -> float:
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@njit(nogil=True, cache=True)
def _row_sums(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    aa = np.zeros(LANES, dtype=np.float64)
    bb = np.zeros(LANES, dtype=np.float64)
    ab = np.zeros(LANES, dtype=np.float64)
    for r in range(a.shape[0]):
        aa[:] = 0.0
        bb[:] = 0.0
        ab[:] = 0.0
        for j in range(a.shape[1]):
            x, y = np.float64(a[r, j]), np.float64(b[r, j])
            aa[j % LANES] += x * x
            bb[j % LANES] += y * y
            ab[j % LANES] += x * y
        out[r, 0] = _combine(aa)
        out[r, 1] = _combine(bb)
        out[r, 2] = _combine(ab)


def row_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(rows, 3) fp64: sum a^2, sum b^2, sum a*b of each row of two 2-d fp32 arrays."""
    out = np.empty((a.shape[0], 3), dtype=np.float64)
    _row_sums(np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32), out)
    return out
