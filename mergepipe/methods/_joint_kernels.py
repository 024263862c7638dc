"""Compiled fixed-order sums for joint statistics (numba, nogil, no fastmath).

`gram_rows` gives, for every row of a block, the inner products of the base and every
expert's delta with each other: a method that needs norms, cosines or a Gram matrix of
the inputs (model_stock, karcher, multislerp) reads them from here. Same summation
order as index/kernels.py: fp64 (fp32 products are exact in fp64), element i of a row
in lane i % 8, the lanes combined pairwise; so the sums depend neither on the CPU nor
on the thread count. (Methods may not import index/, hence this small twin.)
"""
from __future__ import annotations

import numpy as np
from numba import njit

LANES = 8


def gram_size(k: int) -> int:
    """Entries per row: <b,b>, <b,d_i> (k of them), <d_i,d_j> for i <= j (k(k+1)/2)."""
    return 1 + k + k * (k + 1) // 2


def pair_index(k: int, i: int, j: int) -> int:
    """Position of <d_i, d_j> (any order of i, j) in a `gram_rows` row."""
    if i > j:
        i, j = j, i
    # rows i' < i hold k - i' pairs each
    return 1 + k + i * k - i * (i - 1) // 2 + (j - i)


@njit(nogil=True, cache=True)
def _gram_rows(base: np.ndarray, deltas: np.ndarray, out: np.ndarray) -> None:
    m, n = base.shape
    k = deltas.shape[0]
    p = out.shape[1]
    acc = np.zeros((p, LANES), dtype=np.float64)
    for r in range(m):
        acc[:, :] = 0.0
        for e in range(n):
            lane = e % LANES
            b = np.float64(base[r, e])
            acc[0, lane] += b * b
            q = 1 + k
            for i in range(k):
                di = np.float64(deltas[i, r, e])
                acc[1 + i, lane] += b * di
                for j in range(i, k):
                    acc[q, lane] += di * np.float64(deltas[j, r, e])
                    q += 1
        for q in range(p):
            a = acc[q]
            out[r, q] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def gram_rows(base: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """(rows, gram_size(k)) fp64 inner products per row of `base` (rows, n) fp32 and
    `deltas` (k, rows, n) fp32, in the fixed order above."""
    base = np.ascontiguousarray(base, dtype=np.float32)
    deltas = np.ascontiguousarray(deltas, dtype=np.float32)
    out = np.empty((base.shape[0], gram_size(deltas.shape[0])), dtype=np.float64)
    _gram_rows(base, deltas, out)
    return out


def unpack_gram(row: np.ndarray, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(<b,b>, <b,d_i> vector, symmetric <d_i,d_j> matrix) of one `gram_rows` row."""
    bd = np.array(row[1:1 + k], dtype=np.float64)
    dd = np.empty((k, k), dtype=np.float64)
    for i in range(k):
        for j in range(i, k):
            dd[i, j] = dd[j, i] = row[pair_index(k, i, j)]
    return float(row[0]), bd, dd
