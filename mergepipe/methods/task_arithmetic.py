"""Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089).

theta = W0 + lambda * sum_k w_k * delta_k (divided by sum_k w_k if normalize).
Same as mergekit 0.1.5 `task_arithmetic` (normalize off by default), in its fp32
operation order.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import BaseModel, Field

from mergepipe.methods._common import PARAMS_CONFIG, canonical, combine
from mergepipe.methods.base import BlockInputs
from mergepipe.methods._compiled import task_arithmetic_kernel
from mergepipe.methods.registry import GTA_SHARED, Mergekit, register


class TaskArithmeticParams(BaseModel):
    model_config = PARAMS_CONFIG
    lambda_: float = Field(1.0, alias="lambda")
    normalize: bool = False
    # accepted for mergekit configs; no effect here, as in mergekit (nothing is pruned)
    rescale: bool = False
    int8_mask: bool = False


def delta_coefficients(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """c_k = lambda * w_k, divided by sum_k w_k if normalize (unless it is below 1e-8: `combine`)."""
    total = sum(weights.values())
    divisor = total if params.get("normalize", False) and abs(total) >= 1e-8 else 1.0
    lam = float(params.get("lambda", 1.0))
    return {name: lam * w / divisor for name, w in weights.items()}


@register("task_arithmetic",
          mergekit=Mergekit(shared=GTA_SHARED,
                            per_input=("weight", "density")), sketchable=True, sketch_by_default=True,
          params=TaskArithmeticParams, additive=True, delta_coefficients=delta_coefficients,
          compiled=task_arithmetic_kernel,
          paper="Ilharco et al. 2023, Editing Models with Task Arithmetic, arXiv:2212.04089")
def merge(block: BlockInputs, p: TaskArithmeticParams) -> torch.Tensor:
    experts = canonical(block.experts)
    return combine(block, experts, [e.delta for e in experts], consensus=False,
                   normalize=p.normalize, lambda_=p.lambda_)
