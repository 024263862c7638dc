"""DELLA's MagPrune (Deep et al. 2024, arXiv:2406.11617), shared by `della` and `della_linear`.

Within each row (mergekit 0.1.5 `della_magprune` ranks along dim 1; a 0-d or 1-d tensor is one
row), rank |delta| ascending from 1 to n and keep element i with probability
  p_i = (density - epsilon) + (rank_i - 1) / (n - 1) * 2 * epsilon,
so the largest magnitudes are kept most often and the row keeps `density` on average. Ranks
are row-local, so a block of whole rows needs nothing from the rest of the tensor.

Kept elements are rescaled (`rescale: true`, the default in both methods). By default
(`rescale_mode: l1`) as mergekit 0.1.5 does: times the whole tensor's L1 ratio
sum|delta| / sum|kept| (unscaled where either is below 1e-7). Both sums, per expert, come
from the engine's joint scan (L1_SUMS: the scan regenerates each block's seeded mask;
fixed-order fp64 sums rounded to fp32, then mergekit's fp32 ratio), so with the same mask
the result is mergekit's by the equivalence rule. `rescale_mode: keep_probability` divides
each kept element by its own p_i instead, as the DELLA paper does (E[kept] = delta exactly;
no scan). Declaring the scan makes a budgeted della read each block for all experts or
none, in both modes.

Differences from mergekit, by design: its mask comes from torch.bernoulli on the global RNG
(so it depends on tensor and thread order, and cannot be reproduced); here each (expert,
block) draws one fp32 uniform per element from its own generator (methods.base.block_rng, as
DARE) and keeps u < p_i, so the mask does not depend on expert order, threads or budget.
Equal magnitudes are ranked in flat-index order (stable sort): a row's probabilities are
mergekit's as a set, and element by element wherever |delta| is unique in its row
(mergekit's unstable argsort ranks ties in an order of its own, which depends on torch's CPU
sort kernel). A row of one element has no rank (mergekit fails: 0/0): it is kept with
probability `density`. The probabilities follow mergekit's fp32 operations exactly (mergekit
computes in fp32 only with `dtype: float32`; with bf16 inputs and no dtype its ranks are
rounded to bf16).
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from mergepipe.util.lazy import torch
from pydantic import Field, model_validator

from mergepipe.checkpoint.blocks import num_rows
from mergepipe.errors import MethodError
from mergepipe.methods._common import DensityParams, canonical
from mergepipe.methods.base import BlockInputs, ExpertBlock, block_rng
from mergepipe.methods.joint import JointBlock, JointPass, JointSpec

EPSILON_DOC = "half the spread of keep probabilities in a row: from density - epsilon to density + epsilon"


class MagPruneParams(DensityParams):
    """Parameters shared by della and della_linear (mergekit's names and defaults)."""

    epsilon: float = Field(0.15, ge=0.0, description=EPSILON_DOC)
    # true: rescale kept elements (how: rescale_mode); false: keep them unscaled
    rescale: bool = True
    # l1: times the whole tensor's sum|delta| / sum|kept| (mergekit 0.1.5's rescale, from the
    # joint scan; default); keep_probability: each kept element / its p_i (the paper's)
    rescale_mode: Literal["keep_probability", "l1"] = "l1"

    @model_validator(mode="after")
    def _probabilities_in_range(self) -> MagPruneParams:
        check_window(self.density, self.epsilon, "parameters")
        return self


def check_window(density: float, epsilon: float, where: str) -> None:
    """mergekit's rule: for 0 < density < 1, density - epsilon and density + epsilon lie in (0, 1)."""
    if 0 < density < 1 and (density + epsilon >= 1 or density - epsilon <= 0):
        raise ValueError(f"{where}: density {density!r} with epsilon {epsilon!r}: density +/- epsilon "
                         "must lie strictly between 0 and 1; lower epsilon")


def keep_probabilities(delta: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """p_i for every element of a block of whole rows (fp32, the block's shape)."""
    rows = delta.reshape(1, -1) if delta.dim() < 2 else delta
    magnitudes = rows.abs()
    n = rows.shape[1]
    if n < 2:
        return torch.full_like(delta, density)
    order = torch.argsort(magnitudes, dim=1, stable=True)
    ranks = torch.empty_like(magnitudes)
    steps = torch.arange(1, n + 1, dtype=torch.float32).reshape((1, n) + (1,) * (rows.dim() - 2))
    ranks.scatter_(1, order, steps.expand_as(magnitudes).contiguous())
    rank_norm = ((ranks - 1) / (n - 1)).clamp(0, 1)  # min rank 1, max rank n in every row
    probs = (density - epsilon) + rank_norm * 2 * epsilon
    return probs.reshape(delta.shape)


def della_mask(delta: torch.Tensor, density: float, epsilon: float, seed: int, expert_hash: str, tensor: str,
               row_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep mask, p_i) of one (expert, block): one fp32 uniform per element from the block's own
    generator, kept where u < p_i. 0 < density < 1."""
    probs = keep_probabilities(delta, density, epsilon)
    generator = block_rng(seed, expert_hash, tensor, row_start)
    return torch.rand(delta.shape, generator=generator, dtype=torch.float32) < probs, probs


def sparsify_della(delta: torch.Tensor, expert: ExpertBlock, block: BlockInputs, *, epsilon: float,
                   rescale: bool, l1: tuple[float, float] | None = None) -> torch.Tensor:
    """MagPrune with this (expert, block)'s own generator; density >= 1 leaves delta untouched.
    `l1` = (sum|delta|, sum|kept|) over the whole tensor: rescale by their ratio (mergekit's way)
    instead of by 1/p_i."""
    density = expert.density
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    try:
        check_window(density, epsilon, f"expert {expert.name!r}")
    except ValueError as err:
        raise MethodError(f"tensor {block.tensor!r}: {err}") from None
    keep, probs = della_mask(delta, density, epsilon, block.seed, expert.content_hash, block.tensor, block.row_start)
    masked = delta * keep
    if not rescale:
        return masked
    if l1 is None:
        return masked / probs
    # mergekit's rescaled_masked_tensor: fp32 norms, unscaled where either is below 1e-7
    before, after = torch.tensor(l1[0], dtype=torch.float32), torch.tensor(l1[1], dtype=torch.float32)
    if before < L1_EPS or after < L1_EPS:
        return masked
    return masked * (before / after)


# --- mergekit's L1 rescale: per expert sum|delta| and sum|kept| over the whole tensor -------------

L1_EPS = 1e-7


def _block_shape(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    return (rows, *shape[1:]) if len(shape) >= 1 else ()


def l1_sums(delta: torch.Tensor, keep: torch.Tensor) -> tuple[float, float]:
    """(sum|delta|, sum|delta * keep|) in fp64, fixed order (methods/_rowsums.py)."""
    from mergepipe.methods._rowsums import row_sums

    magnitudes = delta.abs().reshape(1, -1).numpy()
    whole = row_sums(magnitudes, np.ones_like(magnitudes))[0, 2]
    kept = row_sums(magnitudes, keep.reshape(1, -1).to(torch.float32).numpy())[0, 2]
    return float(whole), float(kept)


def _l1_accumulate(block: JointBlock, prev) -> np.ndarray:
    ctx = block.ctx
    k = len(ctx.experts)
    out = np.zeros(2 * k, dtype=np.float64)
    shape = _block_shape(ctx.shape, block.row_end - block.row_start)
    for i, e in enumerate(ctx.experts):
        density = 1.0 if e.density is None else e.density
        if not 0 < density < 1:
            continue  # untouched or dropped whole: no rescale
        delta = torch.from_numpy(np.ascontiguousarray(block.deltas[i])).reshape(shape)
        keep, _ = della_mask(delta, density, ctx.params.epsilon, ctx.seed, e.content_hash, ctx.tensor,
                             block.row_start)
        out[i], out[k + i] = l1_sums(delta, keep)
    return out


L1_SUMS = JointSpec(passes=(JointPass(lambda ctx: 2 * ctx.k, _l1_accumulate, lambda acc, prev, ctx: acc),),
                    result_size=lambda ctx: 2 * ctx.k, params=("epsilon", "rescale", "rescale_mode"),
                    expert_knobs=("density",), seeded=True,
                    active=lambda p: p.rescale and p.rescale_mode == "l1")


def expert_l1(block: BlockInputs, experts: list[ExpertBlock], p: MagPruneParams) -> list[tuple[float, float] | None]:
    """Each expert's (sum|delta|, sum|kept|) for mergekit's L1 rescale, or None per expert when it
    is off: the engine's joint statistics, or the block's own when it is the whole tensor."""
    if not (p.rescale and p.rescale_mode == "l1"):
        return [None] * len(experts)
    k = len(experts)
    stats = block.joint
    if stats is None:
        if not (block.row_start == 0 and block.row_end == num_rows(block.tensor_shape)):
            raise MethodError(f"tensor {block.tensor!r}: rescale_mode l1 needs the whole tensor's L1 norms for rows "
                              f"{block.row_start}:{block.row_end}; the engine's joint scan provides them")
        stats = np.zeros(2 * k)
        for i, e in enumerate(experts):
            if e.delta is not None and 0 < e.density < 1:
                keep, _ = della_mask(e.delta, e.density, p.epsilon, block.seed, e.content_hash, block.tensor,
                                     block.row_start)
                stats[i], stats[k + i] = l1_sums(e.delta, keep)
    return [(float(stats[i]), float(stats[k + i])) for i in range(k)]


def pruned_deltas(block: BlockInputs, p: MagPruneParams) -> tuple[list[ExpertBlock], list[torch.Tensor | None]]:
    """The experts in canonical order and each one's MagPruned delta (None where not read):
    what della and della_linear combine, the one with a sign consensus, the other without."""
    experts = canonical(block.experts)
    l1 = expert_l1(block, experts, p)
    pruned = [None if e.delta is None else sparsify_della(e.delta, e, block, epsilon=p.epsilon, rescale=p.rescale,
                                                          l1=norms)
              for e, norms in zip(experts, l1)]
    return experts, pruned
