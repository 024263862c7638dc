"""DARE with a plain weighted sum (Yu et al., 2024, arXiv:2311.03099).

Drop each delta element independently with probability 1 - density and rescale
the kept ones by 1/density: d_k = delta_k * mask_k / density, then
theta = W0 + lambda * sum_k w_k d_k (/ sum_k w_k if normalize).

Differences from mergekit 0.1.5 `dare_linear` (same defaults: normalize false,
rescale true): mergekit draws the mask from torch's global RNG, so its result
depends on tensor and thread order, and rescales by L1-norm matching
(sum|delta| / sum|kept|, a whole-tensor ratio that only approximates 1/density).
Here the mask of each (expert, block) comes from a generator seeded by
(seed, expert content hash, tensor, row_start), so it does not depend on expert
order, threads or budget (it does depend on the block layout, which the plan
hash covers), and kept elements are divided by density, the paper's unbiased
rescale. With rescale false both keep delta * mask unscaled; density >= 1
leaves the delta untouched in both.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from mergepipe.methods._common import DensityParams, canonical, combine, sparsify_dare
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import GTA_SHARED, Mergekit, register


class DareLinearParams(DensityParams):
    # true: divide kept elements by density (paper); false: keep them unscaled
    rescale: bool = True


@register("dare_linear", mergekit=Mergekit(shared=GTA_SHARED, per_input=("weight", "density")), sketchable=True,
          params=DareLinearParams, additive=False,
          paper="Yu et al. 2024, Language Models are Super Mario: Absorbing Abilities from "
                "Homologous Models as a Free Lunch, arXiv:2311.03099")
def merge(block: BlockInputs, p: DareLinearParams) -> torch.Tensor:
    experts = canonical(block.experts)
    dropped = [None if e.delta is None else sparsify_dare(e.delta, e, block, rescale=p.rescale)
               for e in experts]
    return combine(block, experts, dropped, consensus=False, normalize=p.normalize, lambda_=p.lambda_)
