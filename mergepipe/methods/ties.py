"""TIES-Merging (Yadav et al., 2023, arXiv:2306.01708).

Trim each delta to its k = max(1, int(density*n)) largest |delta| of the whole
tensor, elect a sign per element (sign of sum_k w_k*trimmed_k), keep the entries
that agree: theta = W0 + lambda * sum_k m_k w_k trimmed_k / sum_k m_k w_k
(the division only if normalize, on by default).

Same as mergekit 0.1.5 `ties` (consensus "sum", normalize default true) except
at a tie: where several |delta| equal the k-th largest, mergekit keeps an
arbitrary subset (unstable argsort) and we keep the first in flat order, so the
count kept is exactly k either way (docs/design.md "Ties at a magnitude threshold").
A density that rounds to k == 0 keeps the single largest element, as mergekit
does; density 0 keeps nothing. mergekit's `rescale: true` (L1 rescaling of the
trimmed delta) is not supported.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch

from mergepipe.index.ranks import trim_ranks
from mergepipe.methods._common import MagnitudeParams, canonical, combine, sparsify_magnitude
from mergepipe.methods.base import BlockInputs
from mergepipe.methods._compiled import ties_kernel
from mergepipe.methods.registry import GTA_SHARED, Mergekit, register


class TiesParams(MagnitudeParams):
    normalize: bool = True


@register("ties",
          mergekit=Mergekit(shared=GTA_SHARED,
                            per_input=("weight", "density")), sketchable=True, sketch_by_default=True,
          params=TiesParams, additive=False, magnitude=True, cut_ranks=trim_ranks, compiled=ties_kernel,
          paper="Yadav et al. 2023, TIES-Merging: Resolving Interference When Merging Models, "
                "arXiv:2306.01708")
def merge(block: BlockInputs, p: TiesParams) -> torch.Tensor:
    experts = canonical(block.experts)
    trimmed = [None if e.delta is None else sparsify_magnitude(e.delta, e, block) for e in experts]
    return combine(block, experts, trimmed, consensus=True, normalize=p.normalize, lambda_=p.lambda_)
