"""`quant`'s allocation: per (expert, block), one of nothing, a cheaper representation (a k-bit
group-quantized delta gq<k>g<g>, index/groupquant.py, or the ternary sketch, index/sketch.py)
or the full read, chosen by rate-distortion under the expert-I/O budget.

For candidate (k, b) with e = |effective weight|, w = the block's calibrated importance per
unit of delta energy (1 without a calibration), l2 = ||delta_kb|| and c its bytes, each option
o has a cost c_o and a residual energy r_o = ||delta_kb - decoded_o||^2 (what the groupquant
scan records per block; the sketch's residual), and the predicted error it leaves in the
merged block is

    D_o = w e^2 r_o        (nothing: r = l2^2, cost 0; the full read: r = 0, cost c)

(quantization errors of different experts taken as uncorrelated, so squared errors add over
experts; blocks are disjoint, so they add over blocks). An option is dropped when it costs at
least the full read or keeps nothing (r_o >= l2^2). Each candidate's remaining options are cut
to their lower convex hull in (cost, D) from nothing to the lowest-distortion point, and the
hull's steps (an upgrade from one hull point to the next, slope dD / dcost) are taken
greedily by slope over all candidates (the Lagrangian relaxation's solution path: every
budget on it is optimal for its own bytes): ties by the energy order of the candidates, then
the step's index. A step that does not fit ends its candidate's walk. A last pass in the
energy order upgrades to the full read whatever still fits, so at a budget of the full read
every block is read in full: the plain merge, byte for byte.

Deterministic: a function of the candidates (whose order does not depend on the experts'
order), their options, the budget and the weights; budget-sound: the chosen options' costs,
the bytes the engine reads, never sum past the budget.

The plan's compact record of the quantized blocks is `strategy.quant.blocks`: expert -> tensor
-> [[block, kind], ...] (record_blocks; read back, as untrusted input, by parse_blocks). Not yet
registered: the planner's and plan/record.py's use of that field and the engine's call of the
decode (engine/quantized.py) are still to be wired.
"""
from __future__ import annotations

from typing import NamedTuple

from mergepipe.errors import ConfigError
from mergepipe.index.groupquant import BITS, GROUPS, Spec
from mergepipe.plan.strategies.registry import Candidate, PlanContext

KINDS = frozenset(Spec(b, g).name for b in BITS for g in GROUPS)  # what a plan may record

EXACT = "exact"
NOTHING = ""


class Option(NamedTuple):
    """One way to read a candidate: its kind (a representation's name, e.g. gq4g64 or sketch),
    the bytes it costs and the residual energy ||delta - decoded||^2 it leaves."""

    kind: str
    cost: int
    r2: float


class Choice(NamedTuple):
    """What the allocation reads of one candidate: NOTHING, EXACT or a representation's kind."""

    kind: str
    cost: int
    r2: float  # the residual energy left (l2^2 for nothing, 0 for the full read)


def hull(c: Candidate, options: list[Option]) -> list[Choice]:
    """The candidate's lower convex hull in (cost, residual), from nothing to its best point:
    nothing, the useful representations, the full read. Ties in cost keep the lower residual,
    then the kind's name."""
    pts = [Choice(NOTHING, 0, c.l2 * c.l2), Choice(EXACT, c.cost, 0.0)]
    pts += [Choice(o.kind, o.cost, o.r2) for o in options if 0 < o.cost < c.cost and o.r2 < c.l2 * c.l2]
    pts.sort(key=lambda p: (p.cost, p.r2, p.kind))
    out: list[Choice] = []
    for p in pts:
        if out and p.r2 >= out[-1].r2:  # no cheaper error than a point that costs no more
            continue
        while len(out) >= 2 and _not_below(out[-2], out[-1], p):
            out.pop()
        out.append(p)
    return out


def _not_below(a: Choice, b: Choice, p: Choice) -> bool:
    """Whether b lies on or above the segment a-p (so b is not on the lower hull)."""
    return (b.r2 - a.r2) * (p.cost - a.cost) >= (p.r2 - a.r2) * (b.cost - a.cost)


def allocate(cands: list[Candidate], options: dict[tuple[str, str, int], list[Option]], budget_bytes: int,
             weight: dict[tuple[str, str, int], float]) -> list[Choice]:
    """Per candidate (in their energy order), what to read: the module docstring's greedy over
    the hulls' steps, then the full-read fill. `weight`: (expert, tensor, block) -> w e^2."""
    hulls = [hull(c, options.get(_key(c), [])) for c in cands]
    steps = []  # (-slope, candidate, step index)
    for i, (c, h) in enumerate(zip(cands, hulls)):
        w = weight.get(_key(c), 0.0)
        for j in range(1, len(h)):
            steps.append((-(w * (h[j - 1].r2 - h[j].r2)) / (h[j].cost - h[j - 1].cost), i, j))
    steps.sort()
    at = [0] * len(cands)  # each candidate's hull point
    stopped = [False] * len(cands)
    used = 0
    for _, i, j in steps:
        if stopped[i] or at[i] != j - 1:
            continue
        extra = hulls[i][j].cost - hulls[i][j - 1].cost
        if used + extra > budget_bytes:
            stopped[i] = True
            continue
        used, at[i] = used + extra, j
    chosen = [h[a] for h, a in zip(hulls, at)]
    for i, c in enumerate(cands):  # what still fits, in the energy order: full reads
        if chosen[i].kind != EXACT and used + c.cost - chosen[i].cost <= budget_bytes:
            used += c.cost - chosen[i].cost
            chosen[i] = Choice(EXACT, c.cost, 0.0)
    return chosen


def weights(cands: list[Candidate], ctx: PlanContext) -> dict[tuple[str, str, int], float]:
    """(expert, tensor, block) -> w e^2: e the expert's |effective weight|, w the block's
    calibrated importance per unit of delta energy (ctx.block_scores / l2^2; 1 without a
    calibration, 0 for a block without delta energy)."""
    out = {}
    for c in cands:
        e2 = ctx.effective.get(c.expert, 0.0) ** 2
        if ctx.block_scores is not None:
            l2sq = c.l2 * c.l2
            e2 *= ctx.block_scores.get(_key(c), 0.0) / l2sq if l2sq > 0 else 0.0
        out[_key(c)] = e2
    return out


def options_of(cands: list[Candidate], stores: dict[str, list], sketch: dict | None = None
               ) -> dict[tuple[str, str, int], list[Option]]:
    """Each candidate's representations: one Option per opened group-quantized file of its
    expert (`stores`: expert -> [index.groupquant.GroupQuant]) that holds its block, and its
    sketch ((residual energy, bytes), plan/sketch_reads.sketch_context) when given."""
    out: dict[tuple[str, str, int], list[Option]] = {}
    for c in cands:
        opts = [Option(q.spec.name, q.cost(c.tensor, c.block), q.residual_sq(c.tensor, c.block))
                for q in stores.get(c.expert, ()) if q.has(c.tensor, c.block)]
        if sketch is not None and (sk := sketch.get(_key(c))) is not None:
            opts.append(Option("sketch", sk[1], sk[0]))
        out[_key(c)] = opts
    return out


def _key(c: Candidate) -> tuple[str, str, int]:
    return (c.expert, c.tensor, c.block)


def predicted_error_sq(cands: list[Candidate], chosen: list[Choice],
                       weight: dict[tuple[str, str, int], float]) -> float:
    """The predicted squared error of the merged weights, sum of w e^2 r over the candidates
    (the allocation's objective), in the candidates' order."""
    return sum(weight.get(_key(c), 0.0) * ch.r2 for c, ch in zip(cands, chosen))


def predicted_relative_error(cands: list[Candidate], chosen: list[Choice],
                             weight: dict[tuple[str, str, int], float]) -> float:
    """The predicted error of the merged weights relative to the merged update, the
    uncorrelated estimate sqrt(sum w e^2 r / sum w e^2 ||delta||^2) (0 with no update)."""
    ref = sum(weight.get(_key(c), 0.0) * c.l2 * c.l2 for c in cands)
    return (predicted_error_sq(cands, chosen, weight) / ref) ** 0.5 if ref > 0 else 0.0


def record_blocks(cands: list[Candidate], chosen: list[Choice]) -> dict[str, dict[str, list[list]]]:
    """The plan's compact record of the group-quantized blocks: expert -> tensor -> [[block,
    kind], ...], sorted by expert, tensor and block (full reads go to `reads`, sketches to
    `strategy.sketch.blocks`, as for `sketch`)."""
    out: dict[str, dict[str, list[list]]] = {}
    for c, ch in zip(cands, chosen):
        if ch.kind in KINDS:
            out.setdefault(c.expert, {}).setdefault(c.tensor, []).append([c.block, ch.kind])
    return {e: {t: sorted(bs) for t, bs in sorted(per.items())} for e, per in sorted(out.items())}


def parse_blocks(raw: object, experts: list[str], blocks_of: dict[str, int], where: str
                 ) -> dict[str, dict[str, dict[int, str]]]:
    """A plan's `strategy.quant.blocks` (untrusted) as expert -> tensor -> block -> kind: a
    mapping of known experts to mappings of the base's tensors (`blocks_of`: tensor -> its
    block count) to [block, kind] pairs, blocks strictly increasing and inside the tensor,
    kinds one of KINDS. Anything else is a ConfigError naming the key."""
    key = "strategy.quant.blocks"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: plan key {key}: expected a mapping of expert names")
    out: dict[str, dict[str, dict[int, str]]] = {}
    for expert, per in raw.items():
        if expert not in experts or not isinstance(per, dict):
            raise ConfigError(f"{where}: plan key {key}.{expert}: not an expert of the plan with a mapping of tensors")
        out[expert] = {t: _pairs(pairs, blocks_of.get(t), f"{where}: plan key {key}.{expert}.{t}")
                       for t, pairs in per.items()}
    return out


def _pairs(pairs: object, n_blocks: int | None, at: str) -> dict[int, str]:
    if n_blocks is None:
        raise ConfigError(f"{at}: the base has no such tensor")
    if not isinstance(pairs, list) or not pairs:
        raise ConfigError(f"{at}: expected a non-empty list of [block, kind]")
    out: dict[int, str] = {}
    last = -1
    for p in pairs:
        ok = isinstance(p, list) and len(p) == 2 and type(p[0]) is int and isinstance(p[1], str)
        if not ok or not last < p[0] < n_blocks or p[1] not in KINDS:
            raise ConfigError(f"{at}: {p!r} is not [block, kind] with blocks increasing below {n_blocks} and "
                              f"kind one of {', '.join(sorted(KINDS))}")
        out[p[0]], last = p[1], p[0]
    return out
