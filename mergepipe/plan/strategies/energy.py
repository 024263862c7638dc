"""`energy` (the default): greedy by update energy per byte over all experts at once.

Score s_kb = |e_k| * ||delta_kb||_2 (e_k the expert's effective weight), cost = the
block's bytes; candidates are taken by s/c descending, ties broken by (tensor, row_start,
expert content hash); one that does not fit is skipped and smaller ones still go in.
This is the planner's original rule: a config without `plan:` gets it, and its plans
carry no `strategy` key (their plan hash must not depend on the strategy machinery).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from mergepipe.plan.strategies.registry import (STRATEGY_CONFIG, Candidate, PlanContext, Selection, greedy,
                                                register)


class EnergyParams(BaseModel):
    model_config = STRATEGY_CONFIG
    strategy: Literal["energy"] = "energy"


@register("energy", params=EnergyParams)
def select(cands: list[Candidate], budget_bytes: int, ctx: PlanContext, p: EnergyParams) -> Selection:
    """Greedy by |lambda w_k| * ||delta_kb|| per byte over all experts (the default)."""
    chosen = [False] * len(cands)
    greedy(cands, list(range(len(cands))), chosen, budget_bytes)
    return Selection(chosen)
