"""Linear merge / model soup (Wortsman et al., 2022, arXiv:2203.05482).

theta = (b*W0 + sum_k w_k W_k) / (b + sum_k w_k), with W_k = W0 + delta_k and b
the base's own weight (`base_weight`, default 0: mergekit includes the base only
when it is listed among the models); without normalize, the division is skipped.

Computed as mergekit 0.1.5 `linear`: fp32 weights, one `addcmul_` per input
(base first here, config order there), then one division by the fp32 weight sum.
Differences: the weights summing to zero with normalize on is an error here
(mergekit divides by zero); with normalize on, an element that no expert changes
(every delta 0, or the block unread) is the base element bit for bit, where
mergekit's sum of w_k*W0 / sum w_k can be off by an ulp.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import BaseModel

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG, canonical, changed_mask
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register


class LinearParams(BaseModel):
    model_config = PARAMS_CONFIG
    normalize: bool = True
    base_weight: float = 0.0


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """|w_k / (b + sum_j w_j)| when normalized, else |w_k|."""
    lam = float(params.get("lambda", 1.0))
    if params.get("normalize", True):
        total = sum(weights.values()) + float(params.get("base_weight", 0.0))
        lam = 1.0 / total if total else 0.0
    return {name: abs(lam * w) for name, w in weights.items()}


def delta_coefficients(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """c_k = w_k / (b + sum_j w_j) when normalized; without normalize the base is scaled by
    b + sum_j w_j, so only a sum of exactly 1 gives W0 + sum_k w_k delta_k."""
    total = sum(weights.values()) + float(params.get("base_weight", 0.0))
    if params.get("normalize", True):
        if total == 0:
            raise ValueError("the weights (and base_weight) sum to 0, so they cannot be normalized")
        return {name: w / total for name, w in weights.items()}
    if total != 1:
        raise ValueError(f"without normalize the base is scaled by base_weight + the weights' sum ({total}), "
                         "not 1")
    return dict(weights)


@register("linear", sketchable=True, sketch_by_default=True,
          mergekit=Mergekit(no_base="first", shared=("normalize",), per_input=("weight",)),
          params=LinearParams, additive=True, effective_weights=effective_weights,
          delta_coefficients=delta_coefficients,
          paper="Wortsman et al. 2022, Model soups: averaging weights of multiple fine-tuned "
                "models improves accuracy without increasing inference time, arXiv:2203.05482")
def merge(block: BlockInputs, p: LinearParams) -> torch.Tensor:
    base = block.base
    experts = canonical(block.experts)
    changed = changed_mask(block)
    if p.normalize and changed is None:
        return base.clone()
    inputs = [base] if p.base_weight != 0 else []
    coefficients = [p.base_weight] if p.base_weight != 0 else []
    for e in experts:
        if e.delta is None:
            inputs.append(base)
        else:  # a rescaling plan strategy's factor; 1.0 leaves the arithmetic untouched
            inputs.append(base + (e.delta if e.scale == 1.0 else e.delta * torch.tensor(e.scale, dtype=torch.float32)))
        coefficients.append(e.weight)
    weights = torch.tensor(coefficients, dtype=torch.float32)
    coefficient_shape = (1,) * base.dim()
    result = torch.zeros_like(base)
    for tensor, weight in zip(inputs, weights.unbind(0)):
        result.addcmul_(tensor, weight.reshape(coefficient_shape))
    if not p.normalize:
        return result
    denominator = weights.reshape(1, -1).sum(dim=1)
    if denominator.item() == 0:
        raise MethodError(f"tensor {block.tensor!r}: linear weights (base_weight {p.base_weight} and "
                          f"experts {[e.weight for e in experts]}) sum to 0, so they cannot be "
                          "normalized; change a weight or set normalize: false")
    result.div_(denominator.reshape(coefficient_shape))
    return torch.where(changed, result, base)
