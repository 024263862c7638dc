"""`sketch`: each (expert, block) is left out, read as its ternary sketch (2 bits per element
and a scale, index/sketch.py), or read in full, whichever buys the most update energy per
byte of the budget.

For candidate (k, b) with e = |effective weight|, l2 = ||delta_kb||, r^2 its sketch's residual
energy and c, c_s the bytes of the block and of its sketch, the options are

    sketch   gain e^2 (l2^2 - r^2)   cost c_s
    exact    gain e^2 l2^2           cost c
    upgrade  gain e^2 r^2            cost c - c_s   (a sketched block read in full instead)

taken greedily by gain per byte (ties: the energy order, then sketch < exact < upgrade); an
option is skipped when it does not fit or its block is already past it. A last pass in the
energy order upgrades what still fits, so at a budget of the full read every block is read
in full and nothing is sketched: the plain merge, byte for byte. The gains are squared
norms (not the `energy` strategy's norms) because a sketch and a block of different sizes
must compete on the same scale; with equal costs both orders agree.

The plan records the sketched blocks and each expert's sketch artifact; the engine feeds a
sketched block to the method as delta = alpha * code. Sketch bytes count against the budget
like expert bytes. Only for methods that merge per-element deltas (registered `sketchable`:
linear, task arithmetic, TIES, DARE, Breadcrumbs); a magnitude trim leaves a
sketch as it is, since its elements share one magnitude (its zeros are its trim).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from mergepipe.errors import ConfigError
from mergepipe.plan.strategies.registry import (STRATEGY_CONFIG, Candidate, PlanContext, Selection, StrategyInputs,
                                                register)

NONE, SKETCH, EXACT = 0, 1, 2


class SketchParams(BaseModel):
    model_config = STRATEGY_CONFIG
    strategy: Literal["sketch"] = "sketch"


def sketchable(c: Candidate, sketch: tuple[float, int] | None) -> bool:
    """Whether candidate c can be read as its sketch (residual energy, bytes): it has one, the
    sketch keeps some of the update, and it costs less than the block."""
    return sketch is not None and c.l2 * c.l2 - sketch[0] > 0 and sketch[1] < c.cost


def sketch_inputs(request, cands: list[Candidate]) -> StrategyInputs:
    """Each candidate's sketch (residual energy, bytes) from the request's opened sketches
    (index/sketch.py), for a method a sketch can stand in for; the plan records each
    expert's sketch header blake3."""
    from mergepipe.plan import sketch_reads  # it imports this package's registry
    sketch_reads.check_method(request.method, "sketch")
    if request.sketches is None:
        raise ConfigError("plan: strategy 'sketch' needs the experts' sketches (mergepipe run makes them)")
    dtypes = {n: e.dtype for n, e in request.base_index.tensors.items()}
    artifacts = {e.name: request.sketches[e.name].digest for e in sorted(request.experts, key=lambda e: e.name)}
    return StrategyInputs(sketch=sketch_reads.sketch_context(cands, request.sketches, dtypes),
                          recorded={"sketch": {"artifacts": artifacts}})


@register("sketch", params=SketchParams, sketched=True, inputs=sketch_inputs)
def select(cands: list[Candidate], budget_bytes: int, ctx: PlanContext, p: SketchParams) -> Selection:
    """Greedy by update energy per byte over three levels: skip, ternary sketch, full read."""
    if ctx.sketch is None:
        raise ValueError("strategy sketch needs the experts' sketches (mergepipe run makes them)")
    options = []  # (-gain/cost, candidate, kind, cost)
    for i, c in enumerate(cands):
        e2 = ctx.effective.get(c.expert, 0.0) ** 2
        l2sq = c.l2 * c.l2
        options.append((-(e2 * l2sq) / c.cost, i, 1, c.cost))  # exact
        sk = ctx.sketch.get((c.expert, c.tensor, c.block))
        if sketchable(c, sk):
            r2, cs = sk
            options.append((-(e2 * (l2sq - r2)) / cs, i, 0, cs))  # sketch
            options.append((-(e2 * r2) / (c.cost - cs), i, 2, c.cost - cs))  # upgrade
    options.sort()
    state = [NONE] * len(cands)
    used = 0
    for _, i, kind, cost in options:
        if used + cost > budget_bytes:
            continue
        if kind == 0 and state[i] == NONE:
            state[i], used = SKETCH, used + cost
        elif kind == 1 and state[i] == NONE:
            state[i], used = EXACT, used + cost
        elif kind == 2 and state[i] == SKETCH:
            state[i], used = EXACT, used + cost
    for i, c in enumerate(cands):  # what still fits, in the energy order: full reads first
        if state[i] == EXACT:
            continue
        extra = c.cost - (ctx.sketch[(c.expert, c.tensor, c.block)][1] if state[i] == SKETCH else 0)
        if used + extra <= budget_bytes:
            state[i], used = EXACT, used + extra
    return Selection([s == EXACT for s in state], sketched=[s == SKETCH for s in state])
