"""The plan strategy of a params.yaml that names none (no `plan:` key).

Below the full budget, a method registered `sketch_by_default` (task arithmetic, linear and
TIES) gets `sketch`: read each block's
ternary sketch (2 bits per element) where the budget cannot afford the block. EVAL.md
"Delta sketches" measured it against `energy`, the greedy that reads whole blocks only
(SmolLM2-135M, 4 tasks, 2 fine-tuning seeds, 1,200 paired test examples): at 25% it kept
task arithmetic +2.6 and TIES -0.5 points from their full reads where `energy` was -0.6
and -6.8, with a held-out KL to the full merge 2.8-10.5x lower; on MiniLM it lost 0.2
(task arithmetic) and 0.6 (TIES) points at 25% against `energy`'s 1.0. Every other case gets `energy`
(which adds no key to the plan, so those plans keep the hashes they had):
- the full budget, where both read every block (a sketch plan would still record which
  sketches it was made with, and making them costs a scan);
- methods the measurement did not cover (DARE, Breadcrumbs) and methods a sketch cannot
  stand in for (slerp and the other non-additive ones: not `sketchable`).
A config that names a strategy, `energy` included, gets that strategy.
"""
from __future__ import annotations

from mergepipe.methods import get_method
from mergepipe.units import Budget, parse_budget


def default_options(method: str, budget: Budget | str | int | float) -> dict | None:
    """The `plan:` options for this method and budget when the config has none (None: `energy`)."""
    if get_method(method).sketch_by_default and parse_budget(budget).kind != "full":
        return {"strategy": "sketch"}
    return None
