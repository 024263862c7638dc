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
an arbitrary subset and we keep the first in flat order (DESIGN.md "Ties at a
magnitude threshold"); the band holds exactly int(density*n) either way.
mergekit's `rescale: true` (L1 rescaling) is not supported.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, Field, field_validator

from mergepipe.methods._common import DENSITY_DOC, PARAMS_CONFIG, canonical, combine, sparsify_breadcrumbs
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import register


class BreadcrumbsTiesParams(BaseModel):
    model_config = PARAMS_CONFIG
    lambda_: float = Field(1.0, alias="lambda")
    normalize: bool = False
    density: float = Field(1.0, ge=0.0, le=1.0, description=DENSITY_DOC)
    gamma: float = Field(0.01, ge=0.0, le=1.0,
                         description="default outlier fraction, resolved onto ExpertBlock.gamma like density")
    rescale: bool = False
    int8_mask: bool = False  # accepted for mergekit configs; a memory option there, no effect on values

    @field_validator("rescale")
    @classmethod
    def _no_l1_rescale(cls, rescale: bool) -> bool:
        if rescale:
            raise ValueError("rescale: true (mergekit's L1 rescaling of the pruned delta) is not "
                             "supported by breadcrumbs_ties; remove it or set it to false")
        return rescale


@register("breadcrumbs_ties", params=BreadcrumbsTiesParams, additive=False, magnitude=True,
          paper="Davari & Belilovsky 2023, Model Breadcrumbs: Scaling Multi-Task Model Merging "
                "with Sparse Masks, arXiv:2312.06795")
def merge(block: BlockInputs, p: BreadcrumbsTiesParams) -> torch.Tensor:
    experts = canonical(block.experts)
    kept = [None if e.delta is None else sparsify_breadcrumbs(e.delta, e, block) for e in experts]
    return combine(block, experts, kept, consensus=True, normalize=p.normalize, lambda_=p.lambda_)
