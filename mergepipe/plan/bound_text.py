"""What the plan's `bound` means, in words: the one place its wording lives (the CLI's run,
plan and merge lines, `explain` and the model card use it; docs/design.md "What the bound
means" says the same).

The plan records omitted = sqrt(sum_b (sum_{k omitted at b} |lambda w_k| ||delta_kb||)^2) and
relative = omitted / (an estimate of ||M - W0||_F, the full merge's whole update). For an
additive method (the output is linear in the deltas: linear, task arithmetic, passthrough)
this is a certified bound: ||M_S - M||_F <= omitted, M_S this merge and M the full read's.
For every other method it is the same sum of what was left out, but the output is not
linear in it, so it bounds nothing; it is named as the update left out. A plan that left
nothing out (the full budget, or only blocks equal to the base) is the full merge: no line.
"""
from __future__ import annotations


def bound_line(bound: dict) -> str | None:
    """One line for the plan's `bound` {kind, omitted_mass, relative}, or None for an exact merge."""
    omitted, relative = float(bound["omitted_mass"]), float(bound["relative"])
    if omitted == 0.0:
        return None
    if bound["kind"] == "certified":
        return (f"certified bound: the weights differ from the full merge's by at most {omitted:.4g} "
                f"(Frobenius norm), {relative:.2%} of the full merge's update")
    return (f"left out {relative:.2%} of the update's estimated norm ({omitted:.4g}); this method is not "
            "linear in the deltas, so this is no bound on the output")
