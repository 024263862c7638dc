"""Model Breadcrumbs with TIES sign consensus (Davari & Belilovsky, 2023, arXiv:2312.06795).

Per (expert, tensor), drop the int(gamma*n) largest |delta| as outliers and keep
the next int(density*n): b_k = delta_k * [rank in [int(gamma*n), int(gamma*n) +
int(density*n))], ranks counted from the largest |delta| of the whole tensor;
then theta = W0 + lambda * sum_k m_k w_k b_k (/ sum_k m_k w_k if normalize), m_k the TIES sign agreement.

Same as mergekit 0.1.5 `breadcrumbs_ties` (sparsify.magnitude_outliers; normalize
default false, gamma default 0.01), including its edges: density >= 1 returns the
delta untouched (gamma is ignored then); when int(gamma*n) + int(density*n) > n
fewer outliers are dropped so that int(density*n) remain; int(gamma*n) == 0
drops nothing (0.1.5 keeps the band correctly there; older mergekit's
`indices[n_bot:-n_top]` kept nothing). At a tie with a band edge, mergekit keeps
an arbitrary subset and we keep the first in flat order (docs/design.md "Ties at a
magnitude threshold"); the band holds exactly int(density*n) either way.
mergekit's `rescale: true` (L1 rescaling) is not supported.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch

from mergepipe.index.ranks import band_ranks
from mergepipe.methods._common import canonical, combine, sparsify_breadcrumbs
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.breadcrumbs import BreadcrumbsParams
from mergepipe.methods.registry import GTA_SHARED, Mergekit, register


class BreadcrumbsTiesParams(BreadcrumbsParams):
    pass


@register("breadcrumbs_ties", sketchable=True,
          mergekit=Mergekit(aliases=("model_breadcrumbs_ties",),
                            shared=GTA_SHARED,
                            per_input=("weight", "density", "gamma")),
          params=BreadcrumbsTiesParams, additive=False, magnitude=True, cut_ranks=band_ranks,
          paper="Davari & Belilovsky 2023, Model Breadcrumbs: Scaling Multi-Task Model Merging "
                "with Sparse Masks, arXiv:2312.06795")
def merge(block: BlockInputs, p: BreadcrumbsTiesParams) -> torch.Tensor:
    experts = canonical(block.experts)
    kept = [None if e.delta is None else sparsify_breadcrumbs(e.delta, e, block) for e in experts]
    return combine(block, experts, kept, consensus=True, normalize=p.normalize, lambda_=p.lambda_)
