"""SCE: select, calculate, erase (Wan et al., 2024, arXiv:2408.07990), as mergekit 0.1.5 `sce`.

With deltas d_k (k experts):
1. select (only when 0 < select_topk < 1): the population variance over experts of each
   element, var_i; keep the k = int(fp32(nonzero) * fp32(select_topk)) elements of the
   whole tensor with the largest variance (nonzero = elements with var != 0), ties at the
   threshold in flat-index order (mergekit's topk keeps an arbitrary subset of them, chosen
   by a selection over the whole tensor in memory, which blocks cannot reproduce);
   d_k <- d_k * mask. select_topk <= 0 keeps nothing (theta = W0).
   The selection enters every w_k below, so where a tie at the threshold is split otherwise
   than mergekit splits it, every element of the tensor moves a little (several bf16 ulps
   where the result cancels); with mergekit's selection the formula gives mergekit's output.
2. calculate: w_k = mean(d_k^2) over the whole tensor / sum_j mean(d_j^2) (1/k each when
   that sum is below 1e-6);
3. erase: the TIES sign election s = sign(sum_k d_k) (+ where >= 0), m_k = [sign d_k = s];
   theta = W0 + sum_k w_k m_k d_k / max(sum_k w_k m_k, 1e-6).

Whole-tensor statistics (methods/joint.py), in up to four passes over the family:
(1) a histogram of the upper 16 bits of var's fp32 pattern (and the zero count) gives k and
the bin of the k-th largest; (2) the lower 16 bits in that bin give its exact value v and
how many are above; (3) per row, how many equal v (so a block knows how many equal
elements precede it, whatever the block layout); (4) each expert's sum of squared masked deltas (fixed-order fp64).
Passes 1-3 only run when 0 < select_topk < 1. var is computed the same way in the scan and
in the merge (methods/_joint_kernels.expert_variance: fp64, rounded to fp32), so the mask is
exactly the one the statistics counted. The statistics' result, for r rows and k experts:
[k kept, v's fp32 bits, count above v, equal ones to keep, w_1..w_k, equal elements
before each row].
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from mergepipe.util.lazy import torch

from mergepipe.checkpoint.blocks import num_rows
from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG
from mergepipe.methods._joint_kernels import (count_bits, expert_variance, hist_high, hist_low, masked_square_sums,
                                             top_mask)
from mergepipe.methods._gram import block_rows, canonical_block
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.joint import JointBlock, JointPass, JointSpec, TensorContext
from mergepipe.methods.registry import Mergekit, register

HEAD = 4  # k, v bits, count above v, equal ones to keep
BINS = 1 << 16
WEIGHT_FLOOR = 1e-6  # mergekit: uniform weights below this sum; denominators clamped to it


class SceParams(BaseModel):
    model_config = PARAMS_CONFIG
    select_topk: float = Field(1.0, ge=0.0, le=1.0)
    int8_mask: bool = False  # accepted for mergekit configs; a memory option there, no effect on values


def _selects(p: SceParams) -> bool:
    return 0.0 < p.select_topk < 1.0


def _var_bits(deltas: np.ndarray) -> np.ndarray:
    """int32 patterns of the per-element variance over experts (deltas: (k, n) fp32)."""
    var = np.empty(deltas.shape[1], dtype=np.float32)
    expert_variance(np.ascontiguousarray(deltas, dtype=np.float32), var)
    return var.view(np.int32)


def _flat(block: JointBlock) -> np.ndarray:
    return block.deltas.reshape(block.deltas.shape[0], -1)


def _high(block: JointBlock, prev) -> np.ndarray:
    hist = np.zeros(BINS + 1, dtype=np.float64)
    hist_high(_var_bits(_flat(block)), hist)
    return hist


def _high_final(acc: np.ndarray, prev, ctx: TensorContext) -> np.ndarray:
    zeros = int(acc[BINS])
    nonzero = int(acc[:BINS].sum()) - zeros
    k = int(np.float32(nonzero) * np.float32(ctx.params.select_topk))  # mergekit's fp32 product
    above, high = 0, -1
    if k > 0:
        for h in range(BINS - 1, -1, -1):
            if above + int(acc[h]) >= k:
                high = h
                break
            above += int(acc[h])
    return np.array([k, high, above], dtype=np.float64)


def _low(block: JointBlock, prev: np.ndarray) -> np.ndarray:
    hist = np.zeros(BINS, dtype=np.float64)
    if prev[1] >= 0:
        hist_low(_var_bits(_flat(block)), int(prev[1]), hist)
    return hist


def _low_final(acc: np.ndarray, prev: np.ndarray, ctx: TensorContext) -> np.ndarray:
    k, high, above = int(prev[0]), int(prev[1]), int(prev[2])
    if k == 0:
        return np.array([0, -1, 0, 0], dtype=np.float64)
    for low in range(BINS - 1, -1, -1):
        c = int(acc[low])
        if above + c >= k:
            return np.array([k, (high << 16) | low, above, k - above], dtype=np.float64)
        above += c
    raise ValueError(f"tensor {ctx.tensor!r}: variance histogram does not hold rank {k}")


def _equal(block: JointBlock, prev: np.ndarray) -> np.ndarray:
    """Per row, how many elements have var == v: per row (not per block), so the prefix
    before any row is right whatever the block layout of the merge."""
    out = np.zeros(num_rows(block.ctx.shape), dtype=np.float64)
    if prev[0] > 0:
        bits = _var_bits(_flat(block))
        rows = block.row_end - block.row_start if len(block.ctx.shape) >= 2 else 1
        for r, row in enumerate(bits.reshape(rows, -1)):
            out[block.row_start + r] = count_bits(row, int(prev[1]))
    return out


def _equal_final(acc: np.ndarray, prev: np.ndarray, ctx: TensorContext) -> np.ndarray:
    before = np.concatenate([[0.0], np.cumsum(acc)[:-1]])  # exact: integer counts < 2^53
    return np.concatenate([prev, before])


def _mask(flat: np.ndarray, head: np.ndarray, before: float | None) -> np.ndarray | None:
    """The selection mask of one block (None: everything kept)."""
    if head[0] < 0:
        return None
    mask = np.zeros(flat.shape[1], dtype=np.float32)
    if head[0] > 0:
        keep = max(0, int(head[3]) - int(before))
        top_mask(_var_bits(flat), int(head[1]), keep, mask)
    return mask


def _squares(block: JointBlock, prev: np.ndarray | None) -> np.ndarray:
    flat = _flat(block)
    mask = None if prev is None else _mask(flat, prev[:HEAD], prev[HEAD + block.row_start])
    out = np.zeros(flat.shape[0], dtype=np.float64)
    masked_square_sums(flat, np.ones(flat.shape[1], np.float32) if mask is None else mask, out)
    return out


def _weights_final(acc: np.ndarray, prev: np.ndarray | None, ctx: TensorContext) -> np.ndarray:
    n = 1
    for d in ctx.shape:
        n *= d
    means = acc / n if n else acc * 0.0
    total = 0.0
    for m in means:  # left to right: a fixed order
        total += float(m)
    weights = np.full(ctx.k, 1.0 / ctx.k) if abs(total) < WEIGHT_FLOOR else means / total
    if prev is None:  # no selection: head says "keep all", no per-row counts needed
        head, before = np.array([-1.0, 0.0, 0.0, 0.0]), np.zeros(num_rows(ctx.shape))
    else:
        head, before = prev[:HEAD], prev[HEAD:]
    return np.concatenate([head, weights, before])


_SELECT = (JointPass(lambda ctx: BINS + 1, _high, _high_final), JointPass(lambda ctx: BINS, _low, _low_final),
           JointPass(lambda ctx: num_rows(ctx.shape), _equal, _equal_final))
_WEIGHTS = JointPass(lambda ctx: ctx.k, _squares, _weights_final)
SPEC = JointSpec(passes=lambda p: (*_SELECT, _WEIGHTS) if _selects(p) else (_WEIGHTS,),
                 result_size=lambda ctx: HEAD + ctx.k + num_rows(ctx.shape), params=("select_topk",),
                 active=lambda p: p.select_topk > 0.0)


def block_mask(deltas: np.ndarray, stats: np.ndarray, row_start: int) -> np.ndarray | None:
    """The selection mask (fp32 0/1, flat) of the block starting at `row_start` whose deltas
    are `deltas` ((k, n) fp32), from the tensor's statistics; None when nothing is selected
    away (select_topk >= 1)."""
    k = deltas.shape[0]
    return _mask(deltas, stats[:HEAD], stats[HEAD + k + row_start] if stats[0] >= 0 else None)


@register("sce", mergekit=Mergekit(unweighted=True, shared=("int8_mask", "select_topk")),
          params=SceParams, additive=False, joint=SPEC,
          paper="Wan et al. 2024, FuseChat: Knowledge Fusion of Chat Models, arXiv:2408.07990")
def merge(block: BlockInputs, p: SceParams) -> torch.Tensor:
    block = canonical_block(block)
    base = block.base
    k = len(block.experts)
    if k == 0 or p.select_topk <= 0.0 or all(e.delta is None for e in block.experts):
        return base.clone()
    stats = block.joint
    if stats is None:
        raise MethodError(f"tensor {block.tensor!r}: sce needs the whole tensor's joint statistics "
                          "(BlockInputs.joint); the engine's joint scan provides them")
    stats = np.asarray(stats, dtype=np.float64)
    _, deltas = block_rows(block)
    flat = deltas.reshape(k, -1)
    mask_np = block_mask(flat, stats, block.row_start)
    weights = torch.from_numpy(stats[HEAD:HEAD + k].astype(np.float32))
    mask = None if mask_np is None else torch.from_numpy(mask_np).reshape(base.shape)
    trimmed = [torch.zeros_like(base) if e.delta is None else (e.delta if mask is None else e.delta * mask)
               for e in block.experts]
    total = trimmed[0]
    for d in trimmed[1:]:
        total = total + d
    sign = torch.where(total >= 0, 1.0, -1.0)
    numerator = torch.zeros_like(base)
    denominator = torch.zeros_like(base)
    for d, w in zip(trimmed, weights.unbind(0)):
        erased = torch.where(torch.sign(d) == sign, w, torch.zeros((), dtype=torch.float32))
        numerator = numerator + d * erased
        denominator = denominator + erased
    return base + numerator / denominator.clamp(min=WEIGHT_FLOOR)
