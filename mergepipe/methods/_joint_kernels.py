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
from mergepipe.util.lazy import njit  # numba on first call: importing the registry stays cheap

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


# --- exact top-k over a whole tensor of non-negative fp32 values (sce's variance) ---------
# Non-negative fp32 values order like their int32 bit patterns, so the k-th largest is found
# exactly by a histogram of the upper 16 bits, then of the lower 16 bits inside the one bin
# that holds it (as the delta index finds rank cuts, index/scan.py). Counts are exact.

@njit(nogil=True, cache=True)
def expert_variance(deltas: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the population variance over experts of deltas[:, i], in fp64, rounded to fp32."""
    k, n = deltas.shape
    for i in range(n):
        s = 0.0
        for e in range(k):
            s += np.float64(deltas[e, i])
        mean = s / k
        q = 0.0
        for e in range(k):
            d = np.float64(deltas[e, i]) - mean
            q += d * d
        out[i] = np.float32(q / k)


@njit(nogil=True, cache=True)
def hist_high(bits: np.ndarray, hist: np.ndarray) -> None:
    """hist[bits >> 16] += 1; hist[65536] counts the zeros."""
    for i in range(bits.size):
        b = bits[i]
        hist[b >> 16] += 1.0
        if b == 0:
            hist[65536] += 1.0


@njit(nogil=True, cache=True)
def hist_low(bits: np.ndarray, high: int, hist: np.ndarray) -> None:
    """hist[bits & 0xFFFF] += 1 for the elements whose upper 16 bits are `high`."""
    for i in range(bits.size):
        b = bits[i]
        if (b >> 16) == high:
            hist[b & 0xFFFF] += 1.0


@njit(nogil=True, cache=True)
def count_bits(bits: np.ndarray, value: int) -> int:
    c = 0
    for i in range(bits.size):
        c += bits[i] == value
    return c


@njit(nogil=True, cache=True)
def top_mask(bits: np.ndarray, value: int, eq_keep: int, out: np.ndarray) -> None:
    """out[i] = 1 where bits[i] > value, and for the first `eq_keep` elements equal to it
    (flat order); else 0."""
    left = eq_keep
    for i in range(bits.size):
        b = bits[i]
        if b > value:
            out[i] = 1.0
        elif b == value and left > 0:
            out[i] = 1.0
            left -= 1
        else:
            out[i] = 0.0


@njit(nogil=True, cache=True)
def masked_square_sums(deltas: np.ndarray, mask: np.ndarray, out: np.ndarray) -> None:
    """out[e] = sum_i (deltas[e, i] * mask[i])^2 in fp64, fixed order (8 lanes, pairwise);
    the product is taken in fp32 first, as the masked delta is."""
    k, n = deltas.shape
    acc = np.zeros(LANES, dtype=np.float64)
    for e in range(k):
        acc[:] = 0.0
        for i in range(n):
            x = np.float64(np.float32(deltas[e, i] * mask[i]))
            acc[i % LANES] += x * x
        out[e] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@njit(nogil=True, cache=True)
def fusion_importance(base: np.ndarray, delta: np.ndarray, out: np.ndarray) -> None:
    """arcee_fusion's importance per element of (vectors, n) fp32 blocks: |d| times the KL
    divergence, per vector, of softmax(W0 + d) + 1e-8 from softmax(W0) + 1e-8. The KL is
    computed in fp64 in a fixed order (scalar libm exp/log, no vectorized math library)
    and rounded to fp32; the product is fp32, as mergekit's."""
    m, n = base.shape
    for r in range(m):
        hi1 = -np.inf
        hi0 = -np.inf
        for i in range(n):
            w1 = np.float64(np.float32(base[r, i] + delta[r, i]))
            w0 = np.float64(base[r, i])
            hi1 = max(hi1, w1)
            hi0 = max(hi0, w0)
        s1 = 0.0
        s0 = 0.0
        for i in range(n):
            s1 += np.exp(np.float64(np.float32(base[r, i] + delta[r, i])) - hi1)
            s0 += np.exp(np.float64(base[r, i]) - hi0)
        kl = 0.0
        for i in range(n):
            p = np.exp(np.float64(np.float32(base[r, i] + delta[r, i])) - hi1) / s1 + 1e-8
            q = np.exp(np.float64(base[r, i]) - hi0) / s0 + 1e-8
            kl += p * np.log(p / q)
        k32 = np.float32(kl)
        for i in range(n):
            out[r, i] = np.float32(abs(delta[r, i])) * k32


@njit(nogil=True, cache=True)
def hist_low_multi(bits: np.ndarray, highs: np.ndarray, hist: np.ndarray) -> None:
    """hist[j, bits & 0xFFFF] += 1 for the elements whose upper 16 bits are highs[j]."""
    for i in range(bits.size):
        b = bits[i]
        h = b >> 16
        for j in range(highs.size):
            if h == highs[j]:
                hist[j, b & 0xFFFF] += 1.0
