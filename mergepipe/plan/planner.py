"""Budgeted access plan: which (expert, block) pairs a merge reads.

A pure function of the inputs' indexes, the method and the budget; it fails on
shape and budget problems before any weight is read. Greedy by score per byte,
score = |lambda * w_k| * ||delta_kb||_2, ties broken by (tensor, row_start,
expert content hash) so the plan depends neither on the order experts are listed
in nor on thread count. Blocks identical to the base cost nothing and are never
read. A relative budget ("10%") is a share of the full-read bytes (every block
that differs from the base), so 100% is the full merge. For additive methods the
omitted mass, sqrt(sum_b (sum_{k omitted at b} |lambda w_k| ||delta_kb||)^2), is
a certified bound on ||M_S - M||_F (blocks are disjoint, so they add in
squares); for the others it is reported as a heuristic.

make_plan(PlanRequest) reads top to bottom: the strategy's checks against the method, the
candidates (`candidates`: every (expert, block) that could be read, with its cost and
score), the strategy's selection (`select`; a strategy needing more than the candidates,
calibration scores or sketches, gets them from the `inputs` hook on its registration,
plan/strategies/), the accounting (`account`: reads, bytes, bound) and the typed record
(`record`: plan/record.py's PlanRecord, dumped by `plan_json` to the plan's JSON). Which
candidates are read (and any rescale factors) is the strategy's choice (`plan: {strategy:
NAME, ...}` in params.yaml). The default strategy (`energy`, the rule above) adds no key to
the plan; any other adds `strategy` {name, parameters, scales}, covered by the plan hash.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter

from pydantic import ValidationError

from mergepipe import __version__
from mergepipe.errors import BudgetError, CheckpointError, ConfigError
from mergepipe.index.columns import delta_rows, model_rows
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.methods import get_method
from mergepipe.methods.joint import statistics_key
from mergepipe.plan import joint_reads, sketch_reads
from mergepipe.plan.budget_floor import check_budget_floor, smallest_read
from mergepipe.checkpoint.blocks import BlockLayout, is_vocabulary_tensor, row_bytes
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE
from mergepipe.plan.record import (BaseInputRecord, BoundRecord, BytesRecord, CalibrationRecord, JointRecord,
                                   OutputRecord, PlanInputRecord, PlanRecord, SketchRecord, StrategyRecord,
                                   plan_hash, plan_json)
from mergepipe.plan.strategies import (Candidate, PlanContext, Selection, Strategy, StrategyInputs, normalized_options,
                                       strategy_options)
from mergepipe.plan.strategies.registry import per_byte
from mergepipe.units import Budget, parse_budget

PLAN_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class PlanInput:
    name: str
    path: str
    content_hash: str
    weight: float
    density: float | None = None
    gamma: float | None = None
    # the base only: the non-weight files the output copies, {name: blake3} (commands/base_files.py)
    files: dict[str, str] | None = None


def effective_weights(method: str, params: dict, experts: list[PlanInput]) -> dict[str, float]:
    """|scale of delta_k| in the output, as the method defines it (Method.effective_weights)."""
    return get_method(method).effective_weights(params, {e.name: e.weight for e in experts})


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What a plan is made from (make_plan's one argument).

    `budget` is resolved against the plan's own full-read bytes (every expert block that
    differs from the base: what a full-budget merge reads), so "10%" reads a tenth of a full
    merge; `budget_bytes`, if given, overrides that (and skips the budget floor). `strategy` is
    the `plan:` mapping of params.yaml ({strategy: NAME, ...options}; None or the default:
    `energy`); `calibration` and `sketches` are what a calibrated or sketching strategy's
    `inputs` hook reads (commands/calibration.py; expert name -> its opened sketch,
    index/sketch.py). `tensor_parameters` (config/tensor_params.py) gives per-tensor
    parameters and expert weights: recorded in the plan, and each tensor's scores use its
    own effective weights."""

    base: PlanInput
    base_index: ModelIndex
    experts: list[PlanInput]
    expert_indexes: dict[str, ModelIndex]
    deltas: dict[str, DeltaIndex]
    method: str
    params: dict
    seed: int
    budget: Budget | str
    block_bytes: int | BlockLayout
    output: dict
    budget_bytes: int | None = None
    nonfinite: str = "error"
    strategy: dict | None = None
    tensor_parameters: dict | None = None
    calibration: dict | None = None
    sketches: dict | None = None
    cuts: dict[str, str] | None = None  # expert -> blake3 of its exact cuts off the grid (commands/cuts.py)


@dataclass(frozen=True, slots=True)
class Candidates:
    """Every (expert, block) a merge could read, in the energy order, and what the walk counted."""

    items: list[Candidate]
    total_expert_bytes: int  # every block of every expert tensor, identical ones included
    skipped_identical: dict[str, int]  # expert -> bytes of its blocks identical to the base
    mass_sq: float  # sum of the candidates' squared scores

    @property
    def full_read_bytes(self) -> int:
        return sum(it.cost for it in self.items)


@dataclass(frozen=True, slots=True)
class Accounting:
    """What a selection reads: blocks and bytes per expert (full and sketched), and the bound."""

    reads: dict[str, dict[str, list[int]]]  # expert -> tensor -> sorted blocks read in full
    planned: dict[str, int]  # expert -> bytes read in full
    sketch_blocks: dict[str, dict[str, list[int]]]  # expert -> tensor -> blocks read as sketches
    sketch_planned: dict[str, int]  # expert -> sketch bytes
    omitted: float  # the omitted mass (module docstring)


def make_plan(req: PlanRequest) -> PlanRecord:
    """The plan of `req`: its typed record, its hash set (`plan_json` gives the plan's JSON,
    what `mergepipe plan` writes and the hash covers). Steps: the strategy and budget checks,
    the candidates, the strategy's selection, the accounting (reads, bytes, bound), the record.

    Raises:
        BudgetError: budget_bytes < 0, or a budget too small for any read (plan/budget_floor.py).
        CheckpointError: an expert delta has NaN/Inf and nonfinite == "error".
        ConfigError: unknown strategy, bad options, a strategy without the inputs it needs, or a
            rescaling strategy with a method that does not merge weighted deltas (slerp).
    """
    m = get_method(req.method)
    layout = BlockLayout.of(req.block_bytes)
    strat, strat_params, strategy_json = _strategy(req, m)
    budget = _budget(req)
    experts = sorted(req.experts, key=lambda e: (e.content_hash, e.name))
    check_float32_range(req.method, req.params, experts, req.tensor_parameters, "plan")
    eff_of = _tensor_effective_weights(req.method, req.params, experts, req.tensor_parameters)
    eff = effective_weights(req.method, req.params, experts)
    scale = vocabulary_scales(req.base_index, layout)  # empty for plain layouts
    cands = candidates(req, experts, lambda tensor: eff_of(tensor, eff), scale)
    budget_bytes = req.budget_bytes if req.budget_bytes is not None else budget.resolve(cands.full_read_bytes)
    inputs = strat.inputs(req, cands.items) if strat.inputs is not None else StrategyInputs()
    if req.budget_bytes is None:  # a budget_bytes given by the caller is taken as it is
        check_budget_floor(budget, budget_bytes, cands.full_read_bytes,
                           smallest_read(cands.items, grouped=m.joint is not None, sketch=inputs.sketch))
    ctx = PlanContext(tuple((e.name, e.content_hash) for e in experts), _strategy_weights(req, eff, eff_of),
                      inputs.block_scores, scale, _vocabulary(req.base_index), sketch=inputs.sketch)
    selection = select(req, m, strat, strat_params, cands.items, budget_bytes, ctx)
    acct = account(cands.items, selection, [e.name for e in experts], inputs.sketch)
    used = sum(acct.planned.values()) + sum(acct.sketch_planned.values())
    if used > budget_bytes:  # a strategy bug, never the user's
        raise BudgetError(f"plan strategy {strat.name!r} chose {used} bytes over the budget of {budget_bytes}")
    return record(req, m, layout, experts, cands, acct, budget, budget_bytes,
                  _strategy_record(strat, strategy_json, selection, inputs, acct))


def _strategy(req: PlanRequest, m) -> tuple[Strategy, object, dict | None]:
    """The strategy, its typed options and their normalized JSON (None: the default), checked
    against the method."""
    try:
        strategy_json = normalized_options(req.strategy)
        strat, strat_params = strategy_options(req.strategy)
    except ValueError as e:
        raise ConfigError(f"plan: {e}") from None
    if m.joint is not None:
        joint_reads.check_strategy(req.method, strat.name)
    if strat.rescales and m.cosine:
        raise ConfigError(f"plan: strategy {strat.name!r} rescales deltas; method {req.method!r} does not merge "
                          "weighted deltas, use strategy energy or balanced")
    return strat, strat_params, strategy_json


def _budget(req: PlanRequest) -> Budget | str:
    """The parsed budget; as written where the caller gives budget_bytes (then never resolved)."""
    if req.budget_bytes is None:
        return parse_budget(req.budget)
    if req.budget_bytes < 0:
        raise BudgetError(f"budget {req.budget} resolves to {req.budget_bytes} bytes; it must be >= 0")
    return req.budget


def candidates(req: PlanRequest, experts: list[PlanInput], weights_of, scale: dict[str, float]) -> Candidates:
    """Every block of a float tensor that differs from the base, for each expert, sorted by the
    energy order (score per byte descending, then tensor, row, expert content hash). `weights_of`:
    tensor -> the effective weights its scores use."""
    items: list[Candidate] = []
    skipped: dict[str, int] = {}
    total = 0
    mass_sq = 0.0
    row_bytes_of: dict[tuple, int] = {}
    for e in experts:
        idx, delta = req.expert_indexes[e.name], req.deltas[e.name]
        skipped[e.name] = 0
        # the indexes' columns walked once, no entry made per tensor (index/columns.py)
        rows = zip(model_rows(idx.tensors), delta_rows(delta.tensors, list(idx.tensors)))
        for (name, dtype, shape, flat), (bad, identical, block_l2) in rows:
            if bad and req.nonfinite == "error":
                raise CheckpointError(f"{e.path}: tensor {name!r} has {bad} NaN/Inf values "
                                      "(set nonfinite: allow to merge anyway)")
            entry_row_bytes = row_bytes_of.get((shape, dtype))
            if entry_row_bytes is None:  # once per shape and dtype, not per tensor
                entry_row_bytes = row_bytes_of[shape, dtype] = row_bytes(shape, ITEMSIZE[dtype])
            weight = None
            for b in range(len(flat) // 2):
                r0, r1 = flat[2 * b], flat[2 * b + 1]
                cost = (r1 - r0) * entry_row_bytes
                total += cost
                if identical[b]:
                    skipped[e.name] += cost
                    continue
                if dtype not in FLOAT_DTYPES:
                    continue  # integer buffers are copied from the base, never merged
                if weight is None:
                    weight = weights_of(name)[e.name]
                score = weight * block_l2[b]
                mass_sq += score * score
                ratio = per_byte(score, cost, scale.get(name, 1.0))
                items.append(Candidate(-ratio, name, r0, e.content_hash, e.name, b, cost, score, block_l2[b]))
    items.sort(key=itemgetter(0, 1, 2, 3))  # it[:4], compared in C
    return Candidates(items, total, skipped, mass_sq)


def _strategy_weights(req: PlanRequest, eff: dict[str, float], eff_of) -> dict[str, float]:
    """The effective weights a strategy sees: with per-tensor parameters, each expert's
    largest over the top level and every group (its budget share)."""
    out = dict(eff)
    for g in range(len((req.tensor_parameters or {}).get("groups", []))):
        for k, v in eff_of(None, eff, g).items():
            out[k] = max(out[k], v)
    return out


def _vocabulary(base_index: ModelIndex) -> frozenset[str]:
    return frozenset(n for n, _, shape, _ in model_rows(base_index.tensors) if is_vocabulary_tensor(n, shape))


def select(req: PlanRequest, m, strat: Strategy, strat_params, items: list[Candidate], budget_bytes: int,
           ctx: PlanContext) -> Selection:
    """The strategy's choice; for a method with joint statistics a block is read for all
    experts or none (plan/joint_reads.py)."""
    if m.joint is None:
        return strat.select(items, budget_bytes, ctx, strat_params)
    joint_reads.check_tensor_parameters(req.method, m, req.params, req.tensor_parameters)  # statistics unchanged
    return joint_reads.select_groups(strat, items, budget_bytes, ctx, strat_params)


def account(items: list[Candidate], selection: Selection, names: list[str],
            sketch: dict[tuple[str, str, int], tuple[float, int]] | None) -> Accounting:
    """Reads and bytes per expert, and the omitted mass: per block, the sum over omitted
    experts of s_kb (a sketched block: its residual's), plus (c_kt - 1) s_kb over read ones a
    strategy rescaled (the rescale's own error, zero when nothing is rescaled)."""
    reads: dict[str, dict[str, list[int]]] = {n: {} for n in names}
    planned = dict.fromkeys(names, 0)
    sketch_blocks: dict[str, dict[str, list[int]]] = {n: {} for n in names}
    sketch_planned = dict.fromkeys(names, 0)
    omitted_by_block: dict[tuple[str, int], float] = {}
    scales = selection.scales
    for it, take, sk in zip(items, selection.chosen, selection.sketched or [False] * len(items)):
        key = (it.tensor, it.block)
        if sk and not take:  # read as its sketch: its cost, and only its residual is left out
            r2, cs = sketch[(it.expert, it.tensor, it.block)]
            sketch_planned[it.expert] += cs
            sketch_blocks[it.expert].setdefault(it.tensor, []).append(it.block)
            omitted_by_block[key] = omitted_by_block.get(key, 0.0) + sketch_reads.residual_score(it, r2)
        elif take:
            planned[it.expert] += it.cost
            reads[it.expert].setdefault(it.tensor, []).append(it.block)
            c = scales.get(it.expert, {}).get(it.tensor, 1.0)
            if c != 1.0:
                omitted_by_block[key] = omitted_by_block.get(key, 0.0) + (c - 1.0) * it.score
        else:
            omitted_by_block[key] = omitted_by_block.get(key, 0.0) + it.score
    for per_tensor in reads.values():
        for blocks in per_tensor.values():
            blocks.sort()
    # Blocks are disjoint, hence orthogonal in Frobenius norm: the triangle inequality
    # is only needed across experts within a block, which is much tighter than a plain sum.
    omitted = math.sqrt(sum(v * v for _, v in sorted(omitted_by_block.items())))
    return Accounting(reads, planned, sketch_blocks, sketch_planned, omitted)


def _strategy_record(strat: Strategy, strategy_json: dict | None, selection: Selection, inputs: StrategyInputs,
                     acct: Accounting) -> StrategyRecord | None:
    """The plan's `strategy` entry; None for the default strategy, whose plans have no such key."""
    if strategy_json is None:
        return None
    fields: dict = {"name": strat.name, "parameters": strategy_json,
                    "scales": {k: dict(sorted(v.items())) for k, v in sorted(selection.scales.items())}}
    if "calibration" in inputs.recorded:
        fields["calibration"] = CalibrationRecord.model_construct(**inputs.recorded["calibration"])
    if strat.sketched:
        blocks = {n: {t: sorted(bs) for t, bs in sorted(per.items())} for n, per in sorted(acct.sketch_blocks.items())}
        fields["sketch"] = SketchRecord.model_construct(**inputs.recorded["sketch"], blocks=blocks)
    return StrategyRecord.model_construct(**fields)


def record(req: PlanRequest, m, layout: BlockLayout, experts: list[PlanInput], cands: Candidates, acct: Accounting,
           budget: Budget | str, budget_bytes: int, strategy: StrategyRecord | None) -> PlanRecord:
    """The typed plan, its hash included. Built without validation (model_construct): the request
    comes from checked config, and a plan file is validated when read (plan/record.py); fields
    left unset are absent from the plan JSON, so plans without them keep their hash."""
    fields: dict = {
        "schema": PLAN_SCHEMA, "mergepipe_version": __version__, "method": req.method, "parameters": req.params,
        "seed": req.seed, "budget": str(budget), "budget_bytes": budget_bytes, "block_bytes": layout.block_bytes,
        "output": _output_record(req.output), "nonfinite": req.nonfinite,
        "base": BaseInputRecord.model_construct(**_input_json(req.base),
                                                files=dict(sorted((req.base.files or {}).items()))),
        "experts": [PlanInputRecord.model_construct(**_input_json(e)) for e in experts],
        "reads": {name: dict(sorted(r.items())) for name, r in sorted(acct.reads.items())},
        "bytes": _bytes_record(cands, acct, strategy is not None and strategy.sketch is not None),
        "bound": _bound_record(m, acct.omitted, math.sqrt(cands.mass_sq)),
    }
    if layout.embedding_block_bytes is not None:  # only when set: plain-layout plans keep their hash
        fields["embedding_block_bytes"] = layout.embedding_block_bytes
    if req.tensor_parameters is not None:
        fields["tensor_parameters"] = req.tensor_parameters
    if req.cuts:  # only when a density or gamma off the grid needs them: other plans keep their hash
        fields["cuts"] = dict(sorted(req.cuts.items()))
    if m.joint is not None:
        fields["joint"] = _joint_record(req, m, layout, experts)
    if strategy is not None:
        fields["strategy"] = strategy
    fields["schema_"] = fields.pop("schema")
    rec = PlanRecord.model_construct(**fields, plan_hash=_UNHASHED)
    return rec.model_copy(update={"plan_hash": plan_hash(plan_json(rec))})


_UNHASHED = "0" * 64  # the record's hash while its JSON, which the hash covers, is made


def _output_record(output: dict) -> OutputRecord:
    """The plan's `output`, validated: its nested records (layout, vocabulary) are built by
    commands/, and the record is the form validate_plan accepts."""
    try:
        return OutputRecord.model_validate(output)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in ("output", *err["loc"]))
        raise ConfigError(f"plan: key {key}: {err['msg']}") from None


def _bytes_record(cands: Candidates, acct: Accounting, sketched: bool) -> BytesRecord:
    fields: dict = {
        "total_expert_bytes": cands.total_expert_bytes,
        "full_read_expert_bytes": cands.full_read_bytes,
        "planned_expert_bytes": sum(acct.planned.values()),  # full reads; sketches below
        "planned_by_expert": dict(sorted(acct.planned.items())),
        "skipped_identical_by_expert": dict(sorted(cands.skipped_identical.items())),
        "candidate_pairs": len(cands.items),
        "planned_pairs": sum(len(v) for r in acct.reads.values() for v in r.values()),
    }
    if sketched:
        fields["planned_sketch_bytes"] = sum(acct.sketch_planned.values())
        fields["sketch_by_expert"] = dict(sorted(acct.sketch_planned.items()))
    return BytesRecord.model_construct(**fields)


def _bound_record(m, omitted: float, full_norm: float) -> BoundRecord:
    return BoundRecord.model_construct(kind="certified" if m.additive else "heuristic", omitted_mass=omitted,
                                       full_update_norm_estimate=full_norm,
                                       relative=omitted / full_norm if full_norm else 0.0)


def _joint_record(req: PlanRequest, m, layout: BlockLayout, experts: list[PlanInput]) -> JointRecord:
    """The statistics' content address (methods/joint.py); key None: the parameters need none."""
    key = None
    if m.joint.active(m.params.model_validate(req.params)):
        key = statistics_key(m.joint, method=req.method, params=req.params, base_hash=req.base.content_hash,
                             experts=[_input_json(e) for e in experts], seed=req.seed,
                             block_bytes=layout.key)
    return JointRecord.model_construct(reads=joint_reads.READS, key=key)


_F32_MAX = 3.4028234663852886e38


def check_float32_range(method: str, params: dict, experts, tensor_parameters: dict | None, where: str) -> None:
    """The merge computes in float32: a weight, a method parameter, the weights' sum or an
    effective weight past its range would publish inf/NaN made from finite inputs (a
    ConfigError naming `where` and the value). `experts`: anything with .name and .weight."""
    groups = [({}, {})] + [(g["parameters"], g["experts"]) for g in (tensor_parameters or {}).get("groups", [])]
    for over, per_expert in groups:
        p = {**params, **over}
        weights = {e.name: float(per_expert.get(e.name, {}).get("weight", e.weight)) for e in experts}
        numbers = {k: float(v) for k, v in p.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        checks = [(f"experts.{n}.weight", w) for n, w in weights.items()]
        checks += [(f"parameters.{k}", v) for k, v in numbers.items()]
        checks.append(("the sum of the experts' |weight|", sum(map(abs, weights.values()))))  # inf, never raises
        _refuse_past_float32(checks, where)
        _refuse_past_float32([(f"the effective weight of expert {n!r} (weight x parameters)", w)
                              for n, w in get_method(method).effective_weights(p, weights).items()], where)


def _refuse_past_float32(checks: list[tuple[str, float]], where: str) -> None:
    for what, v in checks:
        if not abs(v) <= _F32_MAX:
            raise ConfigError(f"{where}: {what} is {v:g}, beyond float32's range (the merge computes in "
                              "float32, so it would publish inf/NaN); scale the weights or parameters down")


def vocabulary_scales(base_index: ModelIndex, layout: BlockLayout) -> dict[str, float]:
    """Vocabulary tensor -> rows per plain block / rows per vocabulary block (PlanContext.block_scale)."""
    if layout.embedding_block_bytes is None:
        return {}
    out = {}
    for name, e in base_index.tensors.items():
        if layout.bytes_for(name, e.shape) != layout.block_bytes and e.ranges:
            plain = BlockLayout(layout.block_bytes).ranges(name, e.shape, ITEMSIZE[e.dtype])
            out[name] = (plain[0][1] - plain[0][0]) / (e.ranges[0][1] - e.ranges[0][0])
    return out


def _tensor_effective_weights(method: str, params: dict, experts: list[PlanInput], tensor_parameters: dict | None):
    """(tensor, top-level eff[, group]) -> that tensor's effective weights, one computation per group."""
    cache: dict[int, dict[str, float]] = {}

    def eff_of(tensor: str | None, eff: dict[str, float], group: int | None = None) -> dict[str, float]:
        if tensor_parameters is None:
            return eff
        g = tensor_parameters["tensors"].get(tensor) if group is None else group
        if g is None:
            return eff
        if g not in cache:
            over = tensor_parameters["groups"][g]
            weights = {e.name: float(over["experts"].get(e.name, {}).get("weight", e.weight)) for e in experts}
            cache[g] = get_method(method).effective_weights({**params, **over["parameters"]}, weights)
        return cache[g]
    return eff_of


def _input_json(e: PlanInput) -> dict:
    d = {"name": e.name, "path": e.path, "content_hash": e.content_hash, "weight": e.weight}
    if e.density is not None:
        d["density"] = e.density
    if e.gamma is not None:
        d["gamma"] = e.gamma
    return d


def check_plan_inputs(plan: PlanRecord, base_index: ModelIndex, expert_indexes: dict[str, ModelIndex]) -> None:
    """The inputs on disk must be the ones the plan was made for."""
    for e, now in ((plan.base, base_index.content_hash),
                   *((e, expert_indexes[e.name].content_hash) for e in plan.experts)):
        if now != e.content_hash:
            raise CheckpointError(f"{e.path}: content changed since the plan was made "
                                  f"(plan {e.content_hash[:12]}, now {now[:12]}); re-plan")
