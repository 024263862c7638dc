"""RAM, Reinforced Agent Merging (arXiv:2601.13572; mergekit's `ram`).

Per element, with c = #{k : |delta_k| > epsilon} the experts that change it:
  theta = W0 + delta_j                              where c == 1 (j the one expert),
  theta = W0 + sum_{k : |delta_k| > eps} delta_k / c  where c > 1,
  theta = W0                                        where c == 0
(deltas at or below epsilon are dropped). Elementwise across experts, so a block merges on its
own; expert weights are not used (mergekit's `ram` has none), nor is any whole-tensor statistic.

Same fp32 operations and order as mergekit 0.1.5 with `dtype: float32`: per expert
(delta*[c==1]) + (delta*[c>1]) / max(c, 1), summed over experts left to right (canonical
order here, config order there: the same sum when the config lists experts in content-hash
order, else the same terms in another order). A block the plan leaves unread counts as a
zero delta for that expert (as in mergekit when the expert equals the base there), which
changes c for the others: a budgeted RAM merge is the merge of the experts as read.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import BaseModel, Field

from mergepipe.methods._common import PARAMS_CONFIG, canonical, scaled_delta
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register


class RamParams(BaseModel):
    model_config = PARAMS_CONFIG
    # |delta| at or below this does not count as a contribution (and is dropped)
    epsilon: float = Field(1e-5, ge=0.0)


def contributions(deltas: list[torch.Tensor | None], epsilon: float, like: torch.Tensor):
    """(delta_k zeroed at or below epsilon, or None; c as int64): RAM's masks, shared by its variants."""
    kept, count = [], torch.zeros_like(like, dtype=torch.int64)
    for d in deltas:
        if d is None:
            kept.append(None)
            continue
        nonzero = d.abs() > epsilon
        kept.append(d * nonzero)
        count += nonzero
    return kept, count


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """1: an expert's delta reaches the output whole where it alone changes an element."""
    return {name: 1.0 for name in weights}


@register("ram", mergekit=Mergekit(unweighted=True, shared=("epsilon",)),
          params=RamParams, additive=False, effective_weights=effective_weights,
          paper="Reinforced Agent Merging 2026, arXiv:2601.13572")
def merge(block: BlockInputs, p: RamParams) -> torch.Tensor:
    base = block.base
    kept, count = contributions([scaled_delta(e) for e in canonical(block.experts)], p.epsilon, base)
    unique, overlap = count == 1, count > 1
    divisor = count.clamp(min=1)
    merged = None
    for d in kept:
        if d is None:
            continue
        term = (d * unique) + (d * overlap / divisor)
        merged = term if merged is None else merged + term
    return base.clone() if merged is None else base + merged
