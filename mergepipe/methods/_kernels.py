"""Compiled per-block merge loops for bf16 task arithmetic and TIES (numba, nogil);
methods/_compiled.py wraps them as those methods' `compiled` kernels.

The torch path (the methods' `fn`) makes a dozen full passes over each block: bf16 ->
fp32, the delta, the weighting, the sums, the sign election, the cast back, each
into a fresh temporary. These kernels do the same fp32 arithmetic, in the same
order, per element and chunk by chunk in L1, straight from the bf16 bytes to the
output bf16 bytes:

    delta_k = f32(E_k) - f32(B)            (per present expert, canonical order)
    term_k  = trim_k(delta_k) * w_k        (w_k rounded to fp32, as torch.tensor(w, float32))
    TA:   mixed = term_0 + term_1 + ...    (left to right, as methods._common.sequential_sum)
    TIES: s = [sum_k term_k >= 0] * 2 - 1; a_k = [sign(term_k) == s];
          mixed = sum_k term_k * a_k;  divisor = sum_k a_k * w_k (1 where 0)
    mixed = mixed / divisor (if normalize);  mixed = mixed * lambda (if lambda != 1)
    out   = bf16_round_nearest_even(f32(B) + mixed)   (NaN -> 0x7FC0, as torch)

Every operation is a single IEEE fp32 operation with no fusion (no fastmath, so
LLVM may not contract a*b+c into an FMA), so the bytes equal the torch path's
bit for bit (tests/test_merge_kernels.py compares them on random and edge-case
blocks). Pure functions of their arrays; no I/O. Compiled code is cached in
__pycache__ (the first use in a fresh checkout compiles for a few seconds).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

CHUNK = 1024  # elements per chunk: the chunk's fp32 terms of up to 16 experts stay in L1/L2

# trim modes per expert (TIES): keep the delta as is, multiply it by 0, or by its rank-cut mask
KEEP_ALL, DROP_ALL, CUT = 0, 1, 2


@intrinsic
def _f32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_f32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(inline="always")
def _bf16(u16):
    return _f32_from_bits(np.uint32(u16) << np.uint32(16))


@njit(inline="always")
def _to_bf16(x):
    # c10::BFloat16's round_to_nearest_even: torch's float -> bfloat16 cast
    if x != x:
        return np.uint16(0x7FC0)
    bits = _bits_from_f32(x)
    bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(bits >> np.uint32(16))


# Loops index slice views (bs, ek, tk, o) from 0: with `array[k, s + j]` LLVM could
# not vectorize them (negative-index wraparound checks), which made them 16x slower.
# Experts come as a tuple of arrays (one specialization per expert count, cached),
# not stacked: copying them into one array cost more than the whole TA kernel.

@njit(nogil=True, cache=True)
def task_arithmetic_bf16(base, experts, weights, divisor, normalize, lambda_, apply_lambda, out):
    """out = bf16(B + lambda * (sum_k (E_k - B) * w_k) [/ divisor]) for uint16 (bf16) rows.

    Args: base (n,) uint16; experts: a tuple of P >= 1 (n,) uint16 arrays, the
    present experts in canonical order; weights (P,) float32; divisor float32 (sum of all weights, or
    1); out (n,) uint16.
    """
    n = base.shape[0]
    p = len(experts)
    b = np.empty(CHUNK, np.float32)
    acc = np.empty(CHUNK, np.float32)
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        bs = base[s:s + m]
        for j in range(m):
            b[j] = _bf16(bs[j])
        ek = experts[0][s:s + m]
        w = weights[0]
        for j in range(m):
            acc[j] = (_bf16(ek[j]) - b[j]) * w
        for k in range(1, p):
            ek = experts[k][s:s + m]
            w = weights[k]
            for j in range(m):
                acc[j] = acc[j] + (_bf16(ek[j]) - b[j]) * w
        if normalize:
            for j in range(m):
                acc[j] = acc[j] / divisor
        if apply_lambda:
            for j in range(m):
                acc[j] = acc[j] * lambda_
        o = out[s:s + m]
        for j in range(m):
            o[j] = _to_bf16(b[j] + acc[j])


@njit(nogil=True, cache=True)
def eq_limit(base, expert, value, eq_keep):
    """Flat position after which elements with |E - B| == value are no longer kept:
    just past the eq_keep-th such element, or n when there are no more than eq_keep."""
    if eq_keep <= 0:
        return 0
    count = 0
    for i in range(base.shape[0]):
        if abs(_bf16(expert[i]) - _bf16(base[i])) == value:
            count += 1
            if count == eq_keep:
                return i + 1
    return base.shape[0]


# Branchy: a numba kernel loop, C-like (one pass over rows and experts); a helper per case would cost a call each.
@njit(nogil=True, cache=True)
def ties_bf16(base, experts, weights, modes, values, limits, normalize, lambda_, apply_lambda, out):  # noqa: C901
    """TIES (sign election "sum", disjoint merge) for uint16 (bf16) rows; see the module doc.

    Args: base (n,) uint16; experts: a tuple of P (n,) uint16 arrays (present
    experts, canonical order); weights (P,) float32; modes (P,) int64 (KEEP_ALL, DROP_ALL, CUT);
    values (P,) float32 (|delta| thresholds); limits (P,) int64 (elements with
    |delta| == threshold are kept before this flat position only: `eq_limit`);
    out (n,) uint16.
    """
    n = base.shape[0]
    p = len(experts)
    b = np.empty(CHUNK, np.float32)
    terms = np.empty((p, CHUNK), np.float32)
    total = np.empty(CHUNK, np.float32)
    mixed = np.empty(CHUNK, np.float32)
    div = np.empty(CHUNK, np.float32)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        bs = base[s:s + m]
        for j in range(m):
            b[j] = _bf16(bs[j])
        for k in range(p):
            ek = experts[k][s:s + m]
            tk = terms[k]
            w = weights[k]
            mode = modes[k]
            v = values[k]
            lim = limits[k] - s  # elements j < lim of this chunk may keep a threshold-equal |delta|
            if mode == KEEP_ALL:
                for j in range(m):
                    tk[j] = (_bf16(ek[j]) - b[j]) * w
            elif mode == DROP_ALL:
                for j in range(m):
                    tk[j] = ((_bf16(ek[j]) - b[j]) * zero) * w
            else:
                for j in range(m):
                    d = _bf16(ek[j]) - b[j]
                    a = abs(d)
                    keep = (a > v) | ((a == v) & (j < lim))
                    tk[j] = (d * (one if keep else zero)) * w
        t0 = terms[0]
        for j in range(m):
            total[j] = t0[j]
        for k in range(1, p):
            tk = terms[k]
            for j in range(m):
                total[j] = total[j] + tk[j]
        for k in range(p):
            tk = terms[k]
            w = weights[k]
            if k == 0:
                for j in range(m):
                    t = tk[j]
                    a = one if (t > zero and total[j] >= zero) or (t < zero and not total[j] >= zero) else zero
                    mixed[j] = t * a
                    div[j] = a * w
            else:
                for j in range(m):
                    t = tk[j]
                    a = one if (t > zero and total[j] >= zero) or (t < zero and not total[j] >= zero) else zero
                    mixed[j] = mixed[j] + t * a
                    div[j] = div[j] + a * w
        o = out[s:s + m]
        for j in range(m):
            x = mixed[j]
            if normalize:
                dv = div[j]
                x = x / (one if dv == zero else dv)
            if apply_lambda:
                x = x * lambda_
            o[j] = _to_bf16(b[j] + x)
