"""RAM+ tensor-local (arXiv:2601.13572; mergekit's `ramplus_tl`).

RAM (methods/ram.py: c = #{k : |delta_k| > epsilon} per element, deltas at or below epsilon
dropped, overlapping ones averaged) with each expert's unique contributions amplified:
  shared_k = #{elements : |delta_k| > eps and c > 1},  unique_k = #{elements : |delta_k| > eps and c == 1}
over the WHOLE tensor, rho_k = shared_k / max(unique_k, eps), lambda_k = 1 + r * clamp(rho_k, 0, alpha),
  theta = W0 + sum_k (delta_k [c == 1] lambda_k + delta_k [c > 1] / max(c, 1))   (masked deltas).

The counts are the tensor's joint statistics (methods/joint.py): exact integer counts per
expert, accumulated over every block of every expert in the engine's joint scan, so a block is
read for all experts or none. Same fp32 operations as mergekit 0.1.5 with `dtype: float32`
(rho and lambda from the counts as torch computes them there); expert weights are not used.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from mergepipe.util.lazy import torch

from mergepipe.checkpoint.blocks import num_rows
from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG, canonical, scaled_delta
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.joint import JointBlock, JointPass, JointSpec
from mergepipe.methods.ram import contributions
from mergepipe.methods.ram import effective_weights as ram_weights
from mergepipe.methods.registry import Mergekit, register


class RamplusTlParams(BaseModel):
    model_config = PARAMS_CONFIG
    r: float = 0.1  # how much a unique contribution is amplified per unit of rho
    alpha: float = 0.2  # cap on rho
    epsilon: float = Field(1e-5, ge=0.0)


def shared_unique_counts(deltas: np.ndarray, epsilon: float) -> np.ndarray:
    """[shared_0..shared_{k-1}, unique_0..unique_{k-1}] of fp32 deltas (k, ...), as fp64 (exact)."""
    k = deltas.shape[0]
    nonzero = np.abs(deltas.reshape(k, -1)) > np.float32(epsilon)
    count = nonzero.sum(axis=0)
    shared = (nonzero & (count > 1)).sum(axis=1)
    unique = (nonzero & (count == 1)).sum(axis=1)
    return np.concatenate([shared, unique]).astype(np.float64)


def _accumulate(block: JointBlock, prev) -> np.ndarray:
    return shared_unique_counts(block.deltas, block.ctx.params.epsilon)


COUNTS = JointSpec(passes=(JointPass(lambda ctx: 2 * ctx.k, _accumulate, lambda acc, prev, ctx: acc),),
                   result_size=lambda ctx: 2 * ctx.k, params=("epsilon",))


def amplification(counts: np.ndarray, k: int, p: RamplusTlParams) -> torch.Tensor:
    """lambda_k (fp32, k) from the counts, with mergekit's torch operations."""
    shared = torch.tensor(np.asarray(counts[:k]).round().astype(np.int64))
    unique = torch.tensor(np.asarray(counts[k:2 * k]).round().astype(np.int64))
    rho = shared / unique.clamp(min=p.epsilon)
    return 1 + p.r * rho.clamp(min=0, max=p.alpha)


def _counts(block: BlockInputs, experts, p: RamplusTlParams) -> np.ndarray:
    """The tensor's counts: the engine's joint statistics, or the block's own when it is the whole tensor."""
    if block.joint is not None:
        return np.asarray(block.joint, dtype=np.float64)
    if not (block.row_start == 0 and block.row_end == num_rows(block.tensor_shape)):
        raise MethodError(f"tensor {block.tensor!r}: ramplus_tl needs the whole tensor's shared/unique counts for "
                          f"rows {block.row_start}:{block.row_end}; the engine's joint scan provides them "
                          "(BlockInputs.joint)")
    deltas = np.stack([np.zeros(block.base.shape, np.float32) if e.delta is None else e.delta.numpy()
                       for e in experts])
    return shared_unique_counts(deltas, p.epsilon)


@register("ramplus_tl", mergekit=Mergekit(unweighted=True, shared=("r", "alpha", "epsilon")),
          params=RamplusTlParams, additive=False, effective_weights=ram_weights, joint=COUNTS,
          paper="Reinforced Agent Merging 2026 (RAM+), arXiv:2601.13572")
def merge(block: BlockInputs, p: RamplusTlParams) -> torch.Tensor:
    base = block.base
    experts = canonical(block.experts)
    if all(e.delta is None for e in experts):
        return base.clone()
    lambdas = amplification(_counts(block, experts, p), len(experts), p)
    kept, count = contributions([scaled_delta(e) for e in experts], p.epsilon, base)
    unique, overlap = count == 1, count > 1
    divisor = count.clamp(min=1)
    merged = None
    for d, lam in zip(kept, lambdas.unbind(0)):
        if d is None:
            continue
        term = (d * unique * lam) + (d * overlap / divisor)
        merged = term if merged is None else merged + term
    return base + merged
