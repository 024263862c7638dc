"""The budget floor: the one rule for a budget too small to read anything.

A budget, in bytes or as a share of the full read, is refused when it resolves to fewer bytes
than the smallest read the plan's strategy can make: one expert's block; for a joint method
(all-or-none reads, plan/joint_reads.py) one block of every expert that differs there; for a
sketching strategy also one block's sketch. A plan under that floor reads nothing and would
publish the base as the merge. With nothing to read (every expert equals the base) there is
no floor. Pure: a function of the candidates and the resolved budget.
"""
from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

from mergepipe.errors import BudgetError
from mergepipe.plan.strategies.registry import Candidate
from mergepipe.plan.strategies.sketch import sketchable
from mergepipe.units import Budget


def smallest_read(items: list[Candidate], *, grouped: bool = False,
                  sketch: dict[tuple[str, str, int], tuple[float, int]] | None = None) -> tuple[int, str]:
    """(bytes, what it is) of the cheapest read the plan can make; (0, "") with no candidates.
    `grouped`: blocks are read for all experts or none; `sketch`: PlanContext.sketch of a
    sketching strategy."""
    if not items:
        return 0, ""
    if grouped:
        groups: dict[tuple[str, int], int] = {}
        for it in items:
            groups[(it.tensor, it.block)] = groups.get((it.tensor, it.block), 0) + it.cost
        return min(groups.values()), "block read for all experts at once"
    block = min(it.cost for it in items)
    if sketch is not None:
        costs = [sk[1] for it in items if sketchable(it, sk := sketch.get((it.expert, it.tensor, it.block)))]
        if costs and min(costs) < block:
            return min(costs), "expert sketch"
    return block, "expert block"


def _at_least(smallest: int, full_read_bytes: int) -> str:
    """The smallest percentage with two significant digits that resolves to >= `smallest` bytes."""
    share = Fraction(100 * smallest, full_read_bytes)
    digits = max(0, 1 - math.floor(math.log10(share)))
    text = format(Decimal(math.ceil(share * 10 ** digits)).scaleb(-digits), "f")
    return (text.rstrip("0").rstrip(".") if "." in text else text) + "%"


def check_budget_floor(budget: Budget, budget_bytes: int, full_read_bytes: int, smallest: tuple[int, str]) -> None:
    """Raise BudgetError when `budget` (resolved: `budget_bytes`) is below `smallest` (smallest_read)."""
    nbytes, what = smallest
    if budget_bytes >= nbytes:
        return
    if budget.kind == "bytes":  # "budget: 10" is 10 bytes; 10% was probably meant
        fix = f"for a share write a percentage (e.g. '{budget_bytes}%') or a size like '2GiB'"
    else:
        fix = f"raise it to at least {_at_least(nbytes, full_read_bytes)} ({nbytes} bytes)"
    raise BudgetError(f"budget {budget} ({budget_bytes} bytes) is smaller than any {what} ({nbytes} bytes), so the "
                      f"merge would read nothing and publish the base; {fix}")
