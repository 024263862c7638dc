"""Plan strategy registry: one decorator per strategy file; a duplicate name is an error.

A strategy decides which candidate (expert, block) pairs a budgeted merge reads, and
optionally by how much each read (expert, tensor) delta is rescaled. `plan/planner.py`
builds the candidate list (every non-identical block of a float tensor, sorted by the
energy order) and the bookkeeping (bytes, bound, plan JSON); the strategy only selects.

Contract of `select` (checked by tests/test_strategies.py for every strategy):
- budget-sound: the chosen candidates' bytes never exceed `budget_bytes`;
- deterministic: a function of the candidates (whose order does not depend on the order
  experts are listed in), the budget and the parameters only;
- at a budget of at least the full read, every candidate is chosen and every scale is
  exactly 1, so the merge is the plain full-read merge byte for byte.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from mergepipe.errors import ConfigError

if TYPE_CHECKING:
    from mergepipe.plan.planner import PlanRequest

DEFAULT_STRATEGY = "energy"

# every strategy's params model: unknown keys rejected, immutable, no NaN/inf
STRATEGY_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


class Candidate(NamedTuple):
    """One (expert, block) the merge could read. The first four fields are the energy
    order's sort key: score per byte descending, then (tensor, row_start, expert hash)."""

    neg_ratio: float  # -score / cost
    tensor: str
    row_start: int
    expert_hash: str
    expert: str
    block: int
    cost: int  # bytes
    score: float  # e_k * ||delta_kb||_2, e_k = |effective weight|
    l2: float  # ||delta_kb||_2 from the delta index


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What a strategy may know besides the candidates."""

    experts: tuple[tuple[str, str], ...]  # (name, content hash), canonical order (content hash)
    effective: dict[str, float]  # expert -> |scale of its delta| in the output (Method.effective_weights)
    # (expert, tensor, block) -> importance-weighted delta energy (index/weighted.py); only
    # for strategies that declare `calibrated` (None otherwise)
    block_scores: dict[tuple[str, str, int], float] | None = None
    # vocabulary tensor -> (its rows per plain block) / (its rows per vocabulary block), only
    # with `embedding_block_bytes`: per_byte() ranks such a block as the plain block with the
    # same energy density would rank, since score / cost grows as 1/sqrt(block size)
    # (a block 16x smaller with the same delta per element would rank 4x higher)
    block_scale: dict[str, float] = field(default_factory=dict)
    # the base's vocabulary tensors (checkpoint/blocks.py::is_vocabulary_tensor), any layout
    vocabulary: frozenset[str] = frozenset()
    # (expert, tensor, block) -> (residual energy of its sketch, the sketch's bytes), only for
    # strategies that declare `sketched` (index/sketch.py; None otherwise)
    sketch: dict[tuple[str, str, int], tuple[float, int]] | None = None


def per_byte(score: float, cost: int, scale: float = 1.0) -> float:
    """score / cost, for a vocabulary block score / (cost * sqrt(scale)) (PlanContext.block_scale):
    sqrt(density / plain block bytes), the ratio its plain-size block would have."""
    if not cost:
        return math.inf
    return score / cost if scale == 1.0 else score / (cost * math.sqrt(scale))


@dataclass(frozen=True, slots=True)
class Selection:
    chosen: list[bool]  # parallel to the candidates
    # expert -> tensor -> factor applied to the delta of that expert's read blocks of that
    # tensor; only factors != 1 are listed. Empty for strategies that do not rescale.
    scales: dict[str, dict[str, float]] = field(default_factory=dict)
    # parallel to the candidates: read as a sketch instead (never also chosen); None: no sketches
    sketched: list[bool] | None = None


class StrategyInputs(NamedTuple):
    """What a strategy's `inputs` hook adds to the plan: PlanContext's block_scores or sketch,
    and `recorded`, the keys the plan's `strategy` entry gets to name those inputs (so the
    plan hash covers them): calibration {artifact, text}; sketch {artifacts}."""

    block_scores: dict[tuple[str, str, int], float] | None = None
    sketch: dict[tuple[str, str, int], tuple[float, int]] | None = None
    recorded: dict[str, dict] = {}


SelectFn = Callable[[list[Candidate], int, PlanContext, BaseModel], Selection]
# (the plan request, its candidates in the energy order) -> the strategy's extra inputs; raises
# ConfigError when the request lacks what the strategy needs
InputsFn = Callable[["PlanRequest", list[Candidate]], StrategyInputs]


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    params: type[BaseModel]  # its params model; field `strategy: Literal[name]` included
    select: SelectFn
    rescales: bool  # may return scales != 1 (the plan records them; the engine applies them)
    doc: str
    calibrated: bool = False  # needs PlanContext.block_scores (a calibration artifact)
    sketched: bool = False  # needs PlanContext.sketch (the experts' sketches) and may sketch blocks
    inputs: InputsFn | None = None  # the hook that makes block_scores / sketch (None: needs neither)


STRATEGIES: dict[str, Strategy] = {}


def register(name: str, *, params: type[BaseModel], rescales: bool = False,
             calibrated: bool = False, sketched: bool = False,
             inputs: InputsFn | None = None) -> Callable[[SelectFn], SelectFn]:
    if (calibrated or sketched) and inputs is None:  # the planner has no other way to make them
        raise ValueError(f"plan strategy {name!r} is calibrated or sketched but registers no `inputs` hook")

    def wrap(fn: SelectFn) -> SelectFn:
        if name in STRATEGIES:
            raise ValueError(f"plan strategy {name!r} registered twice")
        STRATEGIES[name] = Strategy(name, params, fn, rescales, (fn.__doc__ or "").strip().splitlines()[0],
                                    calibrated, sketched, inputs)
        return fn
    return wrap


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        known = ", ".join(sorted(STRATEGIES))
        raise ConfigError(f"unknown plan strategy {name!r}; known: {known}") from None


def strategy_options(plan: dict[str, Any] | None) -> tuple[Strategy, BaseModel]:
    """The strategy and its typed options of a normalized `plan:` mapping (None: the default).
    Raises ValueError (pydantic's) on bad options; the config layer renders it."""
    plan = dict(plan or {})
    name = plan.get("strategy", DEFAULT_STRATEGY)
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy: unknown plan strategy {name!r}; known: {', '.join(sorted(STRATEGIES))}")
    s = STRATEGIES[name]
    plan["strategy"] = name
    try:
        return s, s.params.model_validate(plan)
    except ValidationError as e:  # one line: the first error, with its key
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "plan"
        raise ValueError(f"{key}: {err['msg']} (strategy {name})") from None


def normalized_options(plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """The canonical JSON form of a `plan:` mapping (defaults filled), or None when it is the
    default strategy with default options: then neither the config's normalized form nor
    the plan JSON gets a new key, so plans made before strategies existed keep their hash."""
    s, opts = strategy_options(plan)
    # options a params model lists in `omit_if_none` are left out while unset, so adding one
    # keeps older plans' hashes
    omit = {k for k in getattr(type(opts), "omit_if_none", ()) if getattr(opts, k) is None}
    norm = opts.model_dump(mode="json", exclude=omit)
    if s.name == DEFAULT_STRATEGY and norm == s.params().model_dump(mode="json"):
        return None
    return norm


def greedy(cands: list[Candidate], order: list[int], chosen: list[bool], room: int) -> int:
    """Take the candidates at `order` (not yet chosen) that fit in `room` bytes, in that
    order; an item that does not fit is skipped and smaller ones still go in. Returns the
    bytes taken."""
    used = 0
    for i in order:
        if chosen[i]:
            continue
        cost = cands[i].cost
        if used + cost <= room:
            used += cost
            chosen[i] = True
    return used
