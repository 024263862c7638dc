"""Arcee Fusion, as mergekit 0.1.5 `arcee_fusion` (base and one expert).

importance_i = |d_i| * KL(softmax(W1) + 1e-8 || softmax(W0) + 1e-8), the KL per vector
along the last axis (a matrix's rows; a 1-d tensor is one vector); threshold = median +
1.5 (Q3 - Q1) of the importance over the whole tensor, the quartiles being the sorted
values at index int(fp32(q) * fp32(n - 1)); theta = W0 + d * [importance >= threshold].

The quartiles are whole-tensor statistics (methods/joint.py): pass 1 histograms the upper
16 bits of the importance's order key (its fp32 pattern mapped to a uint32 that sorts as
torch.sort sorts the values: -0.0 as 0.0, every NaN last), pass 2 the lower 16 bits inside
the three bins holding the quartile ranks: exact order statistics. With `nonfinite: allow`
a NaN or Inf in the expert sorts where mergekit's sort puts it; a NaN quartile makes the
threshold NaN (no element selected), and an element whose delta is NaN or Inf stays NaN
(base + delta * 0), as in mergekit.
Difference from mergekit: above 1M elements mergekit takes its quartiles from 1M elements
sampled with replacement by an unseeded RNG (a different threshold every run); ours are
always the exact order statistics of every element (deterministic, no seed needed: the
value mergekit's sample estimates). The importance is computed the same way in the scan and
the merge (methods/_joint_kernels.fusion_importance: fp64 KL, rounded to fp32), so the
mask is exactly the one the statistics describe; mergekit's fp32 softmax can move an
element's importance by an ulp, which matters only for elements at the threshold.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from mergepipe.util.lazy import torch

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG
from mergepipe.methods._gram import block_rows
from mergepipe.methods._joint_kernels import fusion_importance, hist_high, hist_low_multi
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.joint import JointBlock, JointPass, JointSpec, TensorContext
from mergepipe.methods.registry import Mergekit, register

BINS = 1 << 16
QUANTILES = (0.25, 0.5, 0.75)


class ArceeFusionParams(BaseModel):
    model_config = PARAMS_CONFIG


def importance_bits(base_rows: np.ndarray, delta_rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """int32 patterns of the importance of a block (base, delta: (rows, n) fp32), flat."""
    last = shape[-1] if len(shape) >= 2 else base_rows.size
    base = np.ascontiguousarray(base_rows, dtype=np.float32).reshape(-1, max(1, last))
    delta = np.ascontiguousarray(delta_rows, dtype=np.float32).reshape(-1, max(1, last))
    out = np.empty(base.shape, dtype=np.float32)
    fusion_importance(base, delta, out)
    return out.reshape(-1).view(np.int32)


_SIGN = np.uint32(0x80000000)


def order_keys(bits: np.ndarray) -> np.ndarray:
    """uint32 keys of fp32 patterns, in the order torch.sort puts the values: -0.0 as 0.0, and
    every NaN (either sign, any payload: an Inf delta gives inf - inf) after +Inf."""
    values = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        # + 0 turns -0.0 into 0.0; NaN -> the one positive quiet NaN, whose key is above +Inf's
        canonical = np.where(np.isnan(values), np.float32(np.nan), values + np.float32(0)).view(np.uint32)
    return np.where(canonical >= _SIGN, ~canonical, canonical | _SIGN)


def key_value(key: int) -> np.float32:
    """The fp32 value whose order key is `key` (order_keys' inverse)."""
    bits = key & 0x7FFFFFFF if key & 0x80000000 else ~key & 0xFFFFFFFF
    return np.uint32(bits).view(np.float32)


def _keys(block: JointBlock) -> np.ndarray:
    return order_keys(importance_bits(block.base, block.deltas[0], block.ctx.shape))


def _high(block: JointBlock, prev) -> np.ndarray:
    hist = np.zeros(BINS + 1, dtype=np.float64)  # (the last slot counts zero keys; unused here)
    hist_high(_keys(block), hist)
    return hist


def _ranks(n: int) -> list[int]:
    """mergekit's quantile indices: (q as fp32 * (n - 1)) as fp32, truncated."""
    return [int(np.float32(q) * np.float32(n - 1)) for q in QUANTILES]


def _high_final(acc: np.ndarray, prev, ctx: TensorContext) -> np.ndarray:
    counts = acc[:BINS]
    n = int(counts.sum())
    out = [float(n)]
    cumulative = np.cumsum(counts)  # exact: integer counts < 2^53
    for rank in _ranks(n) if n else [0, 0, 0]:
        high = int(np.searchsorted(cumulative, rank + 1)) if n else 0  # first bin holding index `rank`
        below = int(cumulative[high - 1]) if high > 0 else 0
        out += [float(rank), float(high), float(below)]
    return np.array(out, dtype=np.float64)


def _low(block: JointBlock, prev: np.ndarray) -> np.ndarray:
    hist = np.zeros((len(QUANTILES), BINS), dtype=np.float64)
    highs = np.array([int(prev[2 + 3 * j]) for j in range(len(QUANTILES))], dtype=np.int64)
    hist_low_multi(_keys(block), highs, hist)
    return hist.reshape(-1)


def _low_final(acc: np.ndarray, prev: np.ndarray, ctx: TensorContext) -> np.ndarray:
    if prev[0] == 0:
        return np.zeros(1 + len(QUANTILES))
    values = []
    for j in range(len(QUANTILES)):
        rank, high, below = (int(x) for x in prev[1 + 3 * j:4 + 3 * j])
        cumulative = below + np.cumsum(acc[j * BINS:(j + 1) * BINS])
        low = int(np.searchsorted(cumulative, rank + 1))
        values.append(key_value((high << 16) | low))
    q1, median, q3 = values
    with np.errstate(all="ignore"):  # NaN/Inf quartiles (nonfinite: allow) give what fp32 gives
        threshold = median + np.float32(1.5) * (q3 - q1)  # fp32, mergekit's operations
    return np.array([threshold, q1, median, q3], dtype=np.float64)


SPEC = JointSpec(passes=(JointPass(lambda ctx: BINS + 1, _high, _high_final),
                         JointPass(lambda ctx: len(QUANTILES) * BINS, _low, _low_final)),
                 result_size=lambda ctx: 1 + len(QUANTILES))


@register("arcee_fusion", mergekit=Mergekit(unweighted=True),
          params=ArceeFusionParams, additive=False, max_experts=1, joint=SPEC,
          paper="Arcee AI 2025, Arcee Fusion: dynamic-threshold selective fusion "
                "(mergekit 0.1.5 `arcee_fusion`, arcee.ai)")
def merge(block: BlockInputs, p: ArceeFusionParams) -> torch.Tensor:
    if len(block.experts) != 1:
        raise MethodError(f"tensor {block.tensor!r}: arcee_fusion merges the base and exactly one expert, "
                          f"got {len(block.experts)}")
    expert = block.experts[0]
    if expert.delta is None:
        return block.base.clone()
    if block.joint is None:
        raise MethodError(f"tensor {block.tensor!r}: arcee_fusion needs the whole tensor's joint statistics "
                          "(BlockInputs.joint); the engine's joint scan provides them")
    threshold = np.float32(np.asarray(block.joint, dtype=np.float64)[0])
    base_rows, deltas = block_rows(block)
    importance = importance_bits(base_rows, deltas[0], tuple(block.tensor_shape)).view(np.float32)
    with np.errstate(invalid="ignore"):  # a NaN importance or threshold selects nothing
        selected = importance >= threshold
    mask = torch.from_numpy(selected.astype(np.float32)).reshape(block.base.shape)
    return block.base + expert.delta * mask
