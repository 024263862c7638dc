"""Pieces shared by methods: weighted sums, sign election, magnitude masks."""
from __future__ import annotations

import torch

from mergepipe.methods.base import BlockInputs


def weighted_sum(block: BlockInputs) -> tuple[torch.Tensor, float]:
    """(sum_k w_k delta_k, sum_k w_k) over all experts; unread deltas count as 0."""
    mixed = torch.zeros_like(block.base)
    for e in block.experts:
        if e.delta is not None:
            mixed += e.weight * e.delta
    divisor = sum(e.weight for e in block.experts)
    return mixed, (divisor if divisor != 0 else 1.0)
