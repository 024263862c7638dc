"""`compensated`: select like `energy` (or `balanced`), then rescale what is read so each
(expert, tensor) delta keeps its size.

For expert k and tensor t with some but not all of its non-identical blocks read,
c_kt = min(max_scale, sqrt(sum_{b in t} ||delta_kb||^2) / sqrt(sum_{b in t read} ||delta_kb||^2)),
from the delta index's per-block l2 alone (fp64 sums in block order), rounded to the
nearest fp32 so the engine's fp32 product is exact to reproduce. c_kt = 1 when every
non-identical block of t is read (exactly: never computed as a ratio), when none is,
or when the read blocks' l2 is 0. The plan records every c_kt != 1 under
`strategy.scales`; the engine multiplies the read blocks' (sparsified) delta by it
before weighting (methods/_common.combine, methods/linear.py), so a budgeted merge keeps
||c * delta_read|| = ||delta|| per tensor instead of shrinking. At full budget every
block is read, no scale is recorded and the merge is the plain one byte for byte.

The certified bound (additive methods) then also counts the rescale's own error:
sqrt(sum_b (sum_{k omitted at b} s_kb + sum_{k read at b} (c_kt - 1) s_kb)^2).
Methods whose output is not a weighted sum of deltas (slerp, `cosine`) are refused.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field

from mergepipe.plan.strategies.balanced import select_balanced
from mergepipe.plan.strategies.registry import (STRATEGY_CONFIG, Candidate, PlanContext, Selection, greedy,
                                                register)

MAX_SCALE_LIMIT = 16.0


class CompensatedParams(BaseModel):
    model_config = STRATEGY_CONFIG
    strategy: Literal["compensated"] = "compensated"
    select: Literal["energy", "balanced"] = "energy"
    shares: Literal["weight", "equal"] = "weight"  # for select: balanced
    max_scale: Annotated[float, Field(ge=1.0, le=MAX_SCALE_LIMIT)] = 4.0


def fp32(x: float) -> float:
    """x rounded to the nearest fp32 (as a Python float, exactly representable)."""
    return float(np.float32(x))


def tensor_scales(cands: list[Candidate], chosen: list[bool], max_scale: float) -> dict[str, dict[str, float]]:
    """expert -> tensor -> c_kt for every partly read (expert, tensor) whose c != 1."""
    total: dict[tuple[str, str], float] = {}
    read: dict[tuple[str, str], float] = {}
    count: dict[tuple[str, str], list[int]] = {}
    # fixed summation order: by (expert, tensor, block), whatever the candidates' order
    for i in sorted(range(len(cands)), key=lambda i: (cands[i].expert, cands[i].tensor, cands[i].block)):
        c = cands[i]
        key = (c.expert, c.tensor)
        sq = c.l2 * c.l2
        total[key] = total.get(key, 0.0) + sq
        n = count.setdefault(key, [0, 0])
        n[0] += 1
        if chosen[i]:
            read[key] = read.get(key, 0.0) + sq
            n[1] += 1
    scales: dict[str, dict[str, float]] = {}
    cap = fp32(max_scale)
    for key in sorted(total):
        n_all, n_read = count[key]
        r = read.get(key, 0.0)
        if n_read == 0 or n_read == n_all or r <= 0.0:
            continue
        c = min(cap, fp32(math.sqrt(total[key]) / math.sqrt(r)))
        if c > 1.0:
            scales.setdefault(key[0], {})[key[1]] = c
    return scales


@register("compensated", params=CompensatedParams, rescales=True)
def select(cands: list[Candidate], budget_bytes: int, ctx: PlanContext, p: CompensatedParams) -> Selection:
    """Energy (or balanced) selection, read deltas rescaled per (expert, tensor) to the tensor's update norm."""
    if p.select == "balanced":
        chosen = select_balanced(cands, budget_bytes, ctx, p.shares)
    else:
        chosen = [False] * len(cands)
        greedy(cands, list(range(len(cands))), chosen, budget_bytes)
    return Selection(chosen, tensor_scales(cands, chosen, p.max_scale))
