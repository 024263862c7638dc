"""All-or-none reads for joint methods (methods/joint.py): a block is read for every expert
or for none, so a merged block always sees every expert's delta, as the method's
whole-tensor statistics assume.

Planning: the (expert, block) candidates of one (tensor, block) become one group whose
cost is the sum of their bytes and whose score is the sum of their scores (the mass the
plan's bound counts when the block is left out); the strategy selects groups in the
energy order (score per byte, then tensor, row_start), and every member of a chosen
group is read. Experts whose block is identical to the base are not members: their delta
is known to be zero. Only the default strategy applies: `balanced` shares bytes per
expert and `compensated` rescales one expert's delta, neither of which a group allows.
"""
from __future__ import annotations

import math

from mergepipe.errors import ConfigError
from mergepipe.plan.strategies import Candidate
from mergepipe.plan.strategies.registry import DEFAULT_STRATEGY, Selection, per_byte

READS = "all-or-none"


def check_strategy(method: str, strategy_name: str) -> None:
    if strategy_name != DEFAULT_STRATEGY:
        raise ConfigError(f"plan: strategy {strategy_name!r} chooses or rescales blocks per expert; method "
                          f"{method!r} reads each block for all experts or none, use strategy {DEFAULT_STRATEGY}")


def select_groups(strat, items: list[Candidate], budget_bytes: int, ctx, params) -> Selection:
    """The strategy's choice over (tensor, block) groups of `items`, expanded to the items."""
    members: dict[tuple[str, int], list[int]] = {}
    for i, it in enumerate(items):
        members.setdefault((it.tensor, it.block), []).append(i)
    groups = []
    for (tensor, block), idx in members.items():
        cost = sum(items[i].cost for i in idx)
        score = math.fsum(items[i].score for i in idx)
        l2 = math.sqrt(math.fsum(items[i].l2 ** 2 for i in idx))
        ratio = per_byte(score, cost, ctx.block_scale.get(tensor, 1.0))
        groups.append(Candidate(-ratio, tensor, items[idx[0]].row_start, "", "", block, cost, score, l2))
    groups.sort(key=lambda g: g[:4])
    chosen_groups = strat.select(groups, budget_bytes, ctx, params).chosen
    chosen = [False] * len(items)
    for g, take in zip(groups, chosen_groups):
        if take:
            for i in members[(g.tensor, g.block)]:
                chosen[i] = True
    return Selection(chosen)


def check_all_or_none(plan, deltas: dict, where: str) -> None:
    """Every block a joint plan (plan/record.py PlanRecord) reads for one expert it reads for
    every expert whose block differs from the base (ConfigError naming the key otherwise)."""
    read_blocks: dict[str, set[int]] = {}
    for per_tensor in plan.reads.values():
        for tensor, blocks in per_tensor.items():
            read_blocks.setdefault(tensor, set()).update(blocks)
    for name in plan.expert_names:
        for tensor, blocks in sorted(read_blocks.items()):
            same = deltas[name].tensors[tensor].identical
            mine = set(plan.reads_of(name).get(tensor, ()))
            missing = sorted(b for b in blocks if not same[b] and b not in mine)
            if missing:
                raise ConfigError(f"{where}: plan key reads.{name}.{tensor}: method {plan.method!r} reads each "
                                  f"block for all experts or none, block {missing[0]} is read for others only")


def describe(plan) -> list[str]:
    """`explain`'s lines for a joint plan (a PlanRecord; empty for any other): the all-or-none
    reads and where the statistics come from."""
    joint = plan.joint
    if not joint:
        return []
    blocks = {(t, b) for per in plan.reads.values() for t, bs in per.items() for b in bs}
    lines = ["", f"joint method {plan.method}: each block is read for all experts or for none "
                 f"({len(blocks)} (tensor, block) groups read; "
                 "an expert whose block equals the base is not read there)"]
    if joint.key is None:
        lines.append("joint statistics: none needed with these parameters")
    else:
        lines.append(f"joint statistics {joint.key[:16]}: one scan of every block of the base and every expert "
                     "before the merge, kept in the store (joint/<key>.stats) and reused by any merge of this family "
                     "and method; like the index, not counted in the budget")
    return lines


def check_tensor_parameters(method: str, m, params: dict, tensor_parameters: dict | None) -> None:
    """Per-tensor parameters (gradients, filters) may vary what a joint method does per block,
    not what its statistics are: those are keyed by the family and the top-level parameters.
    A group that changes a parameter the statistics depend on (`JointSpec.params`) or whether
    they are needed (`active`) is a config error naming it."""
    if tensor_parameters is None:
        return
    top = m.joint.active(m.params.model_validate(params))
    for g in tensor_parameters["groups"]:
        own = g.get("parameters", {})
        for key in m.joint.params:
            if key in own and own[key] != params.get(key):
                raise ConfigError(f"parameters.{key}: method {method!r} computes its joint statistics with one "
                                  f"{key} per merge; it cannot vary per tensor (got {own[key]!r} and "
                                  f"{params.get(key)!r})")
        if m.joint.active(m.params.model_validate({**params, **own})) != top:
            raise ConfigError(f"parameters: method {method!r} needs its joint statistics for some tensors and not "
                              f"others ({sorted(own)}); set these parameters once for all tensors")
