"""Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089).

theta = W0 + lambda * sum_k w_k * delta_k. Same as mergekit's `task_arithmetic`
(normalize off by default).
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergepipe.methods._common import weighted_sum
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import register


class TaskArithmeticParams(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)
    lambda_: float = Field(1.0, alias="lambda")
    normalize: bool = False


@register("task_arithmetic", params=TaskArithmeticParams, additive=True,
          paper="Ilharco et al. 2023, Editing Models with Task Arithmetic, arXiv:2212.04089")
def merge(block: BlockInputs, p: TaskArithmeticParams) -> torch.Tensor:
    mixed, divisor = weighted_sum(block)
    if p.normalize:
        mixed = mixed / divisor
    return block.base + p.lambda_ * mixed
