"""Compiled counting loops of the delta index (numba, nogil: index threads run them in parallel).

bf16_abs_delta makes `bits`, the int32 patterns of |delta| in fp32 (non-negative, so
integer order is float order, NaN above +inf); the counting kernels read them and
scatter counts into a table.
numpy would gather, compress and bincount into fresh arrays for the same result;
one compiled pass with no temporaries is ~10x faster. Results are exact integer
counts, so they do not depend on how or where the loop runs. Compiled code is
cached in __pycache__ (first use in a fresh checkout compiles for ~2 s).
"""
from __future__ import annotations

import numpy as np
from numba import njit

LOW_BITS = 16
LOW_MASK = (1 << LOW_BITS) - 1
HIGH_MASK = 0x7FFF  # a NaN that kept its sign bit still lands in the NaN bins


@njit(nogil=True, cache=True)
def hist_high(bits: np.ndarray, hist: np.ndarray) -> int:
    """hist[upper 16 bits] += 1 for every element; returns the nonzero count."""
    nnz = 0
    for i in range(bits.size):
        b = bits[i]
        hist[(b >> LOW_BITS) & HIGH_MASK] += 1
        nnz += b != 0
    return nnz


@njit(nogil=True, cache=True)
def count_low(bits: np.ndarray, slot_of_bin: np.ndarray, table: np.ndarray,
              occupied: np.ndarray, n_occupied: int) -> int:
    """table[(lower 16 bits) * stride + slot] += 1 for every element, by the slot of its upper 16 bits.

    Bins that matter have slots 0..m-1 and all others share slot m, so the loop has no
    data-dependent branch (a mispredicted one per element cost more than the count).
    Slot-minor layout: most bf16 deltas have low bits 0, and slot-major rows 256 KiB
    apart made those counters alias in cache (4x slower). The table is mostly empty,
    so each entry's first use is appended to `occupied`; the caller reads and clears
    just those instead of scanning every counter. Returns the new occupied count.
    """
    n = n_occupied
    stride = slot_of_bin.max() + 1
    for i in range(bits.size):
        b = bits[i]
        j = (b & LOW_MASK) * stride + slot_of_bin[(b >> LOW_BITS) & HIGH_MASK]
        if table[j] == 0:
            occupied[n] = j
            n += 1
        table[j] += 1
    return n


@njit(nogil=True, cache=True)
def count_equal(bits: np.ndarray, index_of_bin: np.ndarray, wanted: np.ndarray, counts: np.ndarray) -> None:
    """counts[k] += 1 for each element equal to wanted[k], k = index_of_bin[upper 16 bits].

    One wanted value per bin (the caller makes one call per value of a shared bin);
    the other bins point at a last, ignored counter, so again there is no branch.
    Eight lanes of counters, so that runs of elements hitting the same counter do
    not wait on each other's stores.
    """
    lanes = np.zeros((counts.size, 8), dtype=np.int64)
    for i in range(bits.size):
        b = bits[i]
        k = index_of_bin[(b >> LOW_BITS) & HIGH_MASK]
        lanes[k, i & 7] += wanted[k] == b
    for k in range(counts.size):
        counts[k] += lanes[k].sum()


@njit(nogil=True, cache=True)
def bf16_abs_delta(base: np.ndarray, expert: np.ndarray, base_f32: np.ndarray, expert_f32: np.ndarray,
                   out: np.ndarray) -> None:
    """Decode two bf16 blocks (raw uint16) to fp32 and write |expert - base| (fp32) to `out`:
    one pass, no temporaries (numpy needed five, and page faults for each)."""
    for i in range(base.size):
        b = np.uint32(np.uint32(base[i]) << np.uint32(16)).view(np.float32)
        e = np.uint32(np.uint32(expert[i]) << np.uint32(16)).view(np.float32)
        base_f32[i] = b
        expert_f32[i] = e
        out[i] = abs(e - b)


# Sums of the delta index. BLAS (np.dot) picks its kernel, and so its summation order, by
# CPU (OpenBLAS Haswell, SkylakeX and Prescott kernels give different last bits), which
# made block norms, plan bounds and slerp angles machine-dependent. These loops fix the
# order: 8 fp64 lanes (fp32 products are exact in fp64), element i in lane i % 8, lanes
# combined pairwise. LLVM may vectorize the lanes but cannot reorder them (no fastmath).
LANES = 8


@njit(inline="always")
def _combine(acc: np.ndarray) -> float:
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@njit(nogil=True, cache=True)
def finite_norms(values: np.ndarray) -> tuple[float, float]:
    """(sum x^2, sum |x|) over the finite elements of an fp32 array, in fp64."""
    sq = np.zeros(LANES, dtype=np.float64)
    l1 = np.zeros(LANES, dtype=np.float64)
    for i in range(values.size):
        x = np.float64(values[i])
        if np.isfinite(x):
            sq[i % LANES] += x * x
            l1[i % LANES] += abs(x)
    return _combine(sq), _combine(l1)


@njit(nogil=True, cache=True)
def slerp_sums(b: np.ndarray, e: np.ndarray) -> tuple[float, float, float]:
    """(sum b^2, sum e^2, sum b*e) of two fp32 arrays, in fp64."""
    bb = np.zeros(LANES, dtype=np.float64)
    ee = np.zeros(LANES, dtype=np.float64)
    be = np.zeros(LANES, dtype=np.float64)
    for i in range(b.size):
        x, y = np.float64(b[i]), np.float64(e[i])
        bb[i % LANES] += x * x
        ee[i % LANES] += y * y
        be[i % LANES] += x * y
    return _combine(bb), _combine(ee), _combine(be)


@njit(nogil=True, cache=True)
def weighted_energy(b: np.ndarray, e: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    """sum_i rows[i] * sum_j cols[j] * (e_ij - b_ij)^2 over a (len(rows), len(cols)) block of
    fp32 (flattened), in fp64: per row 8 fixed lanes, rows added in order. A calibrated
    plan's block score (index/weighted.py)."""
    n_cols = cols.size
    total = 0.0
    acc = np.zeros(LANES, dtype=np.float64)
    for i in range(rows.size):
        acc[:] = 0.0
        off = i * n_cols
        for j in range(n_cols):
            d = np.float64(e[off + j]) - np.float64(b[off + j])
            acc[j % LANES] += np.float64(cols[j]) * (d * d)
        total += np.float64(rows[i]) * _combine(acc)
    return total
