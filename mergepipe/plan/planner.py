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

Which candidates are read (and any rescale factors) is the plan strategy's choice
(`plan/strategies/`, `plan: {strategy: NAME, ...}` in params.yaml); this module keeps
the candidate list, the bytes, the bound and the plan file. The default strategy
(`energy`, the rule above) adds no key to the plan; any other adds `strategy`
{name, parameters, scales}, covered by the plan hash.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter

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
from mergepipe.plan.strategies import Candidate, PlanContext, normalized_options, strategy_options
from mergepipe.plan.strategies.registry import per_byte
from mergepipe.units import Budget, parse_budget
from mergepipe.util.canonical import canonical_blake3

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


def hash_json(obj: object) -> str:
    """blake3 of canonical_json(obj), hashed a piece at a time (util/canonical.py)."""
    return canonical_blake3(obj)


def effective_weights(method: str, params: dict, experts: list[PlanInput]) -> dict[str, float]:
    """|scale of delta_k| in the output, as the method defines it (Method.effective_weights)."""
    return get_method(method).effective_weights(params, {e.name: e.weight for e in experts})


# Long: to be split into candidates -> select -> account -> record: issue 23 item 1.
def make_plan(*, base: PlanInput, base_index: ModelIndex, experts: list[PlanInput],  # noqa: C901, PLR0915
              expert_indexes: dict[str, ModelIndex], deltas: dict[str, DeltaIndex],
              method: str, params: dict, seed: int, budget: Budget | str, budget_bytes: int | None = None,
              block_bytes: int | BlockLayout, output: dict, nonfinite: str = "error",
              strategy: dict | None = None, tensor_parameters: dict | None = None,
              calibration: dict | None = None, sketches: dict | None = None) -> dict:
    """Build the plan (a canonical, JSON-able dict with its own hash).

    `budget` is resolved against the plan's own full-read bytes (every expert
    block that differs from the base: what a full-budget merge reads), so "10%"
    reads a tenth of a full merge; `budget_bytes`, if given, overrides that.
    The plan records both the budget as written and the resolved bytes.
    `strategy` is the `plan:` mapping of params.yaml ({strategy: NAME, ...options};
    None or the default: `energy`); `calibration` what a calibrated strategy scores with
    (commands/calibration.py); `sketches` expert name -> its opened sketch (index/sketch.py)
    for a sketching strategy. `tensor_parameters` (config/tensor_params.py) gives
    per-tensor parameters and expert weights: recorded in the plan, and each tensor's
    scores use its own effective weights.

    Raises:
        BudgetError: budget_bytes < 0, or a budget too small for any read (plan/budget_floor.py).
        CheckpointError: an expert delta has NaN/Inf and nonfinite == "error".
        ConfigError: unknown strategy, bad options, or a rescaling strategy with a
            method that does not merge weighted deltas (slerp).
    """
    m = get_method(method)
    layout = BlockLayout.of(block_bytes)
    try:
        strategy_json = normalized_options(strategy)
        strat, strat_params = strategy_options(strategy)
    except ValueError as e:
        raise ConfigError(f"plan: {e}") from None
    if m.joint is not None:
        joint_reads.check_strategy(method, strat.name)
    if strat.rescales and m.cosine:
        raise ConfigError(f"plan: strategy {strat.name!r} rescales deltas; method {method!r} does not merge "
                          "weighted deltas, use strategy energy or balanced")
    if strat.sketched:
        sketch_reads.check_method(method, strat.name)
        if sketches is None:
            raise ConfigError(f"plan: strategy {strat.name!r} needs the experts' sketches (mergepipe run makes them)")
    if budget_bytes is None:
        budget = parse_budget(budget)
    elif budget_bytes < 0:
        raise BudgetError(f"budget {budget} resolves to {budget_bytes} bytes; it must be >= 0")
    experts = sorted(experts, key=lambda e: (e.content_hash, e.name))
    scale = vocabulary_scales(base_index, layout)  # empty for plain layouts: score / cost as before
    check_float32_range(method, params, experts, tensor_parameters, "plan")
    eff = effective_weights(method, params, experts)
    eff_of = _tensor_effective_weights(method, params, experts, tensor_parameters)
    items: list[Candidate] = []
    skipped_identical: dict[str, int] = {}
    total_expert_bytes = 0
    mass_sq = 0.0
    row_bytes_of: dict[tuple, int] = {}
    for e in experts:
        idx, delta = expert_indexes[e.name], deltas[e.name]
        skipped_identical[e.name] = 0
        # the indexes' columns walked once, no entry made per tensor (index/columns.py)
        rows = zip(model_rows(idx.tensors), delta_rows(delta.tensors, list(idx.tensors)))
        for (name, dtype, shape, flat), (bad, identical, block_l2) in rows:
            if bad and nonfinite == "error":
                raise CheckpointError(f"{e.path}: tensor {name!r} has {bad} NaN/Inf values "
                                      "(set nonfinite: allow to merge anyway)")
            entry_row_bytes = row_bytes_of.get((shape, dtype))
            if entry_row_bytes is None:  # once per shape and dtype, not per tensor
                entry_row_bytes = row_bytes_of[shape, dtype] = row_bytes(shape, ITEMSIZE[dtype])
            weight = None
            for b in range(len(flat) // 2):
                r0, r1 = flat[2 * b], flat[2 * b + 1]
                cost = (r1 - r0) * entry_row_bytes
                total_expert_bytes += cost
                if identical[b]:
                    skipped_identical[e.name] += cost
                    continue
                if dtype not in FLOAT_DTYPES:
                    continue  # integer buffers are copied from the base, never merged
                if weight is None:
                    weight = eff_of(name, eff)[e.name]
                score = weight * block_l2[b]
                mass_sq += score * score
                ratio = per_byte(score, cost, scale.get(name, 1.0))
                items.append(Candidate(-ratio, name, r0, e.content_hash, e.name, b, cost, score, block_l2[b]))
    items.sort(key=itemgetter(0, 1, 2, 3))  # it[:4], compared in C
    full_read_bytes = sum(it[6] for it in items)
    floored = budget_bytes is None  # a budget_bytes given by the caller is taken as it is
    if budget_bytes is None:
        budget_bytes = budget.resolve(full_read_bytes)
    if tensor_parameters is not None:  # strategies' shares: each expert's largest per-tensor weight
        for g in range(len(tensor_parameters["groups"])):
            for k, v in eff_of(None, eff, g).items():
                eff[k] = max(eff[k], v)
    scores = None
    if strat.calibrated:  # calibration: {artifact, text, energies: expert -> tensor -> [per block]}
        if calibration is None:
            raise ConfigError(f"plan: strategy {strat.name!r} needs a calibration artifact (mergepipe run makes it)")
        scores = {(name, t, b): v for name, per in calibration["energies"].items()
                  for t, vs in per.items() for b, v in enumerate(vs)}
    vocabulary = frozenset(n for n, _, shape, _ in model_rows(base_index.tensors) if is_vocabulary_tensor(n, shape))
    sk_ctx = None
    if strat.sketched:
        sk_ctx = sketch_reads.sketch_context(items, sketches, {n: e.dtype for n, e in base_index.tensors.items()})
    if floored:
        check_budget_floor(budget, budget_bytes, full_read_bytes,
                           smallest_read(items, grouped=m.joint is not None, sketch=sk_ctx))
    ctx = PlanContext(tuple((e.name, e.content_hash) for e in experts), dict(eff), scores, scale, vocabulary,
                      sketch=sk_ctx)
    if m.joint is not None:  # per-tensor parameters must not change the statistics
        joint_reads.check_tensor_parameters(method, m, params, tensor_parameters)
    if m.joint is not None:  # a block is read for all experts or none (plan/joint_reads.py)
        selection = joint_reads.select_groups(strat, items, budget_bytes, ctx, strat_params)
    else:
        selection = strat.select(items, budget_bytes, ctx, strat_params)
    scales = selection.scales
    reads: dict[str, dict[str, list[int]]] = {e.name: {} for e in experts}
    planned = {e.name: 0 for e in experts}
    used = 0
    # per block: sum over omitted experts of s_kb, plus (c_kt - 1) s_kb over read ones a
    # strategy rescaled (the rescale's own error, zero when nothing is rescaled)
    omitted_by_block: dict[tuple[str, int], float] = {}
    sketched = selection.sketched or [False] * len(items)
    sketch_blocks: dict[str, dict[str, list[int]]] = {e.name: {} for e in experts}
    sketch_planned = {e.name: 0 for e in experts}
    for it, take, sk in zip(items, selection.chosen, sketched):
        if sk and not take:  # read as its sketch: its cost, and only its residual is left out
            r2, cs = sk_ctx[(it.expert, it.tensor, it.block)]
            used += cs
            sketch_planned[it.expert] += cs
            sketch_blocks[it.expert].setdefault(it.tensor, []).append(it.block)
            key = (it.tensor, it.block)
            omitted_by_block[key] = omitted_by_block.get(key, 0.0) + sketch_reads.residual_score(it, r2)
        elif take:
            used += it.cost
            planned[it.expert] += it.cost
            reads[it.expert].setdefault(it.tensor, []).append(it.block)
            c = scales.get(it.expert, {}).get(it.tensor, 1.0)
            if c != 1.0:
                key = (it.tensor, it.block)
                omitted_by_block[key] = omitted_by_block.get(key, 0.0) + (c - 1.0) * it.score
        else:
            key = (it.tensor, it.block)
            omitted_by_block[key] = omitted_by_block.get(key, 0.0) + it.score
    if used > budget_bytes:  # a strategy bug, never the user's
        raise BudgetError(f"plan strategy {strat.name!r} chose {used} bytes over the budget of {budget_bytes}")
    # Blocks are disjoint, hence orthogonal in Frobenius norm: the triangle inequality
    # is only needed across experts within a block, which is much tighter than a plain sum.
    omitted = math.sqrt(sum(v * v for _, v in sorted(omitted_by_block.items())))
    for per_tensor in reads.values():
        for blocks in per_tensor.values():
            blocks.sort()
    full_norm = math.sqrt(mass_sq)
    plan = {
        "schema": PLAN_SCHEMA,
        "mergepipe_version": __version__,
        "method": method,
        "parameters": params,
        "seed": seed,
        "budget": str(budget),
        "budget_bytes": budget_bytes,
        "block_bytes": layout.block_bytes,
        "output": output,
        "nonfinite": nonfinite,
        "base": {**_input_json(base), "files": dict(sorted((base.files or {}).items()))},
        "experts": [_input_json(e) for e in experts],
        "reads": {name: dict(sorted(r.items())) for name, r in sorted(reads.items())},
        "bytes": {
            "total_expert_bytes": total_expert_bytes,
            "full_read_expert_bytes": full_read_bytes,
            "planned_expert_bytes": used - sum(sketch_planned.values()),  # full reads; sketches below
            "planned_by_expert": dict(sorted(planned.items())),
            "skipped_identical_by_expert": dict(sorted(skipped_identical.items())),
            "candidate_pairs": len(items),
            "planned_pairs": sum(len(v) for r in reads.values() for v in r.values()),
        },
        "bound": {
            "kind": "certified" if m.additive else "heuristic",
            "omitted_mass": omitted,
            "full_update_norm_estimate": full_norm,
            "relative": omitted / full_norm if full_norm else 0.0,
        },
    }
    if layout.embedding_block_bytes is not None:  # only when set: plain-layout plans keep their hash
        plan["embedding_block_bytes"] = layout.embedding_block_bytes
    if tensor_parameters is not None:
        plan["tensor_parameters"] = tensor_parameters
    if m.joint is not None:  # the statistics' content address (methods/joint.py); None: none needed
        active = m.joint.active(m.params.model_validate(params))
        plan["joint"] = {"reads": joint_reads.READS, "key": statistics_key(
            m.joint, method=method, params=params, base_hash=base.content_hash,
            experts=plan["experts"], seed=seed, block_bytes=layout.key) if active else None}
    if strategy_json is not None:
        plan["strategy"] = {"name": strat.name, "parameters": strategy_json,
                            "scales": {k: dict(sorted(v.items())) for k, v in sorted(scales.items())}}
        if scores is not None:  # what the importance came from, so the plan hash covers it
            plan["strategy"]["calibration"] = {k: calibration[k] for k in ("artifact", "text")}
        if strat.sketched:
            plan["strategy"]["sketch"] = {
                "artifacts": {e.name: sketches[e.name].digest for e in sorted(experts, key=lambda e: e.name)},
                "blocks": {n: {t: sorted(bs) for t, bs in sorted(per.items())}
                           for n, per in sorted(sketch_blocks.items())}}
            plan["bytes"]["planned_sketch_bytes"] = sum(sketch_planned.values())
            plan["bytes"]["sketch_by_expert"] = dict(sorted(sketch_planned.items()))
    plan["plan_hash"] = plan_hash(plan)
    return plan


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


def plan_hash(plan: dict) -> str:
    """Covers inputs' content hashes (and the base's copied non-weight files), method,
    parameters, budget, block size, version and the access set itself (everything but the
    hash field and a plan file's `made_from`, plan/record.py MADE_FROM: which bytes of
    params.yaml it came from)."""
    return hash_json({k: v for k, v in plan.items() if k not in ("plan_hash", "made_from")})


def _input_json(e: PlanInput) -> dict:
    d = {"name": e.name, "path": e.path, "content_hash": e.content_hash, "weight": e.weight}
    if e.density is not None:
        d["density"] = e.density
    if e.gamma is not None:
        d["gamma"] = e.gamma
    return d


def check_plan_inputs(plan: dict, base_index: ModelIndex, expert_indexes: dict[str, ModelIndex]) -> None:
    """The inputs on disk must be the ones the plan was made for."""
    if base_index.content_hash != plan["base"]["content_hash"]:
        raise CheckpointError(f"{plan['base']['path']}: content changed since the plan was made "
                              f"(plan {plan['base']['content_hash'][:12]}, "
                              f"now {base_index.content_hash[:12]}); re-plan")
    for e in plan["experts"]:
        now = expert_indexes[e["name"]].content_hash
        if now != e["content_hash"]:
            raise CheckpointError(f"{e['path']}: content changed since the plan was made "
                                  f"(plan {e['content_hash'][:12]}, now {now[:12]}); re-plan")
