"""`balanced`: every expert gets its own share of the budget.

Under `energy` the budget follows delta size, so an expert with a small update (a
small-data task) is dropped first. Here expert k (canonical order: content hash) gets
share_k = floor(B * |e_k| / sum_j |e_j|) (`shares: weight`, the default) or floor(B / K)
(`shares: equal`) bytes, plus whatever the experts before it left unused; inside its
share it is greedy by energy per byte (the energy order restricted to its blocks).
What is still unused after the last expert goes to one global energy-greedy pass over
the remaining candidates, so at full budget every candidate is read.

Budget-sound: every take also checks the global total. Independent of the order experts
are listed in (shares and carry follow content-hash order).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Literal

from pydantic import BaseModel

from mergepipe.plan.strategies.registry import (STRATEGY_CONFIG, Candidate, PlanContext, Selection, greedy,
                                                register)


class BalancedParams(BaseModel):
    model_config = STRATEGY_CONFIG
    strategy: Literal["balanced"] = "balanced"
    shares: Literal["weight", "equal"] = "weight"


def expert_shares(budget_bytes: int, ctx: PlanContext, shares: str) -> dict[str, int]:
    """Bytes of the budget each expert starts with (exact rational arithmetic, floors)."""
    names = [name for name, _ in ctx.experts]
    weights = {n: Fraction(abs(ctx.effective.get(n, 0.0))) for n in names}
    total = sum(weights.values(), Fraction(0))
    if shares == "equal" or total == 0:
        weights, total = {n: Fraction(1) for n in names}, Fraction(len(names))
    return {n: int(budget_bytes * weights[n] / total) for n in names}


def select_balanced(cands: list[Candidate], budget_bytes: int, ctx: PlanContext, shares: str) -> list[bool]:
    chosen = [False] * len(cands)
    by_expert: dict[str, list[int]] = {name: [] for name, _ in ctx.experts}
    for i, c in enumerate(cands):  # cands are in the energy order, so each list is too
        by_expert.setdefault(c.expert, []).append(i)
    share = expert_shares(budget_bytes, ctx, shares)
    used = carry = 0
    for name, _ in ctx.experts:
        room = min(share[name] + carry, budget_bytes - used)
        took = greedy(cands, by_expert[name], chosen, room)
        used += took
        carry = room - took
    used += greedy(cands, list(range(len(cands))), chosen, budget_bytes - used)
    assert used <= budget_bytes
    return chosen


@register("balanced", params=BalancedParams)
def select(cands: list[Candidate], budget_bytes: int, ctx: PlanContext, p: BalancedParams) -> Selection:
    """A budget share per expert (by |weight| or equal), energy-greedy inside it, leftovers passed on."""
    return Selection(select_balanced(cands, budget_bytes, ctx, p.shares))
