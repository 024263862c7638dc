"""DELLA's MagPrune (Deep et al. 2024, arXiv:2406.11617), shared by `della` and `della_linear`.

Within each row (mergekit 0.1.5 `della_magprune` ranks along dim 1; a 0-d or 1-d tensor is one
row), rank |delta| ascending from 1 to n and keep element i with probability
  p_i = (density - epsilon) + (rank_i - 1) / (n - 1) * 2 * epsilon,
so the largest magnitudes are kept most often and the row keeps `density` on average. Ranks
are row-local, so a block of whole rows needs nothing from the rest of the tensor.

Kept elements are rescaled (`rescale: true`, the default in both methods) by 1/p_i, each
element's own keep probability, as the DELLA paper does: E[kept] = delta exactly. mergekit
instead multiplies by the whole tensor's L1 ratio sum|delta| / sum|kept| (an approximation
of the same thing that needs the whole tensor's mask); that is not offered here yet.

Differences from mergekit, by design: its mask comes from torch's global RNG (so it depends
on tensor and thread order); here each (expert, block) draws one fp32 uniform per element
from its own generator (methods.base.block_rng, as DARE) and keeps u < p_i, so the mask does
not depend on expert order, threads or budget. Equal magnitudes are ranked in flat-index
order (stable sort); mergekit's unstable argsort ranks them in an order of its own. A row of
one element has no rank (mergekit fails: 0/0): it is kept with probability `density`. The
probabilities follow mergekit's fp32 operations exactly.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import Field, model_validator

from mergepipe.errors import MethodError
from mergepipe.methods._common import DensityParams
from mergepipe.methods.base import BlockInputs, ExpertBlock, block_rng

EPSILON_DOC = "half the spread of keep probabilities in a row: from density - epsilon to density + epsilon"


class MagPruneParams(DensityParams):
    """Parameters shared by della and della_linear (mergekit's names and defaults)."""

    epsilon: float = Field(0.15, ge=0.0, description=EPSILON_DOC)
    # true: divide kept elements by their keep probability; false: keep them unscaled
    rescale: bool = True

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


def sparsify_della(delta: torch.Tensor, expert: ExpertBlock, block: BlockInputs, *, epsilon: float,
                   rescale: bool) -> torch.Tensor:
    """MagPrune with this (expert, block)'s own generator; density >= 1 leaves delta untouched."""
    density = expert.density
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    try:
        check_window(density, epsilon, f"expert {expert.name!r}")
    except ValueError as err:
        raise MethodError(f"tensor {block.tensor!r}: {err}") from None
    probs = keep_probabilities(delta, density, epsilon)
    generator = block_rng(block.seed, expert.content_hash, block.tensor, block.row_start)
    keep = torch.rand(delta.shape, generator=generator, dtype=torch.float32) < probs
    masked = delta * keep
    return masked / probs if rescale else masked
