"""Planner properties, on synthetic indexes (no files) and on real merges."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.cli import main
from mergepipe.errors import BudgetError
from mergepipe.plan.planner import PlanInput, PlanRequest
from mergepipe.units import parse_budget
from tests.helpers import plan_doc, load_model, synthetic_indexes, write_config


def _plan(base_index, experts, idx, deltas, budget_bytes, method="task_arithmetic"):
    return plan_doc(PlanRequest(base=PlanInput("base", "/m/base", "b" * 64, 0.0), base_index=base_index,
                                 experts=experts, expert_indexes=idx, deltas=deltas, method=method,
                                 params={"lambda": 1.0}, seed=0, budget=f"{budget_bytes}B",
                                 budget_bytes=budget_bytes, block_bytes=64,
                                 output={"dtype": None, "shard_bytes": None}))


@given(st.lists(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5), min_size=1, max_size=4),
       st.integers(1, 4), st.integers(0, 2000), st.integers(0, 10))
def test_plan_is_budget_sound_and_order_independent(tensor_blocks, k, budget, seed):
    base_index, experts, idx, deltas = synthetic_indexes(tensor_blocks, k, seed)
    plan = _plan(base_index, experts, idx, deltas, budget)
    assert plan["bytes"]["planned_expert_bytes"] <= budget
    for e in experts:
        for tname, blocks in plan["reads"][e.name].items():
            for b in blocks:
                assert not deltas[e.name].tensors[tname].identical[b]  # identical blocks are free, never read
    again = _plan(base_index, list(reversed(experts)), idx, deltas, budget)
    assert again["reads"] == plan["reads"] and again["plan_hash"] == plan["plan_hash"]
    full = _plan(base_index, experts, idx, deltas, 10**9)
    nonzero = sum(1 for e in experts for t in deltas[e.name].tensors.values() for x in t.block_l2 if x > 0)
    assert full["bytes"]["planned_pairs"] == nonzero and full["bound"]["omitted_mass"] == 0.0


@given(st.lists(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5), min_size=1, max_size=4),
       st.integers(1, 4), st.integers(0, 10), st.sampled_from(["1%", "10%", "12.5%", "50%", 0.3, "full"]))
def test_relative_budget_is_a_share_of_the_full_merge_reads(tensor_blocks, k, seed, budget):
    """'10%' means a tenth of what the full merge reads (blocks identical to the base excluded)."""
    base_index, experts, idx, deltas = synthetic_indexes(tensor_blocks, k, seed)
    kw = dict(base=PlanInput("base", "/m/base", "b" * 64, 0.0), base_index=base_index, experts=experts,
              expert_indexes=idx, deltas=deltas, method="task_arithmetic", params={"lambda": 1.0}, seed=0,
              block_bytes=64, output={"dtype": None, "shard_bytes": None})
    full = plan_doc(PlanRequest(**kw, budget="full"))
    full_read = full["bytes"]["full_read_expert_bytes"]
    assert full_read == full["bytes"]["planned_expert_bytes"] == full["budget_bytes"]
    assert full_read == full["bytes"]["total_expert_bytes"] - sum(full["bytes"]["skipped_identical_by_expert"].values())
    share = parse_budget(budget)
    if full_read and share.resolve(full_read) < 64:  # below one 64-byte block: nothing to read
        with pytest.raises(BudgetError, match="smaller than any expert block"):  # plan/budget_floor.py
            plan_doc(PlanRequest(**kw, budget=budget))
        return
    plan = plan_doc(PlanRequest(**kw, budget=budget))
    assert plan["budget"] == str(share)
    assert plan["budget_bytes"] == share.resolve(full_read)
    assert plan["budget_bytes"] == (full_read if share.kind == "full" else int(share.fraction * full_read))
    assert plan["bytes"]["planned_expert_bytes"] <= plan["budget_bytes"]


def test_plan_hash_covers_budget_and_method():
    base_index, experts, idx, deltas = synthetic_indexes([[1.0, 2.0, 3.0]], 2, 0)
    a = _plan(base_index, experts, idx, deltas, 100)
    b = _plan(base_index, experts, idx, deltas, 101)
    c = _plan(base_index, experts, idx, deltas, 100, method="linear")
    assert len({a["plan_hash"], b["plan_hash"], c["plan_hash"]}) == 3


def test_certified_bound_holds_on_real_merges(tmp_path, tiny_family):
    """||M_S - M_full||_F <= the plan's bound, for task_arithmetic at several budgets."""
    full_cfg = write_config(tmp_path, tiny_family, budget="full", output={"dir": str(tmp_path / "full")})
    assert main(["run", str(full_cfg), "-q"]) == 0
    full = load_model(tmp_path / "full")
    for budget in ["5%", "20%", "50%"]:
        cfg = write_config(tmp_path, tiny_family, budget=budget, output={"dir": str(tmp_path / budget)})
        assert main(["run", str(cfg), "-q"]) == 0
        part = load_model(tmp_path / budget)
        dev = sum(float(((part[n].float() - full[n].float()) ** 2).sum()) for n in full) ** 0.5
        bound = json.loads((tmp_path / budget / "manifest.json").read_text())["bound"]
        # bf16 rounding of the two outputs adds up to half an ulp per element on top of the exact bound
        slack = sum(float(((full[n].float().abs() * 2 ** -8) ** 2).sum()) for n in full) ** 0.5
        assert bound["kind"] == "certified"
        assert dev <= bound["omitted_mass"] + slack, (budget, dev, bound)
        assert bound["omitted_mass"] > 0


def test_a_strategy_gets_its_extra_inputs_through_its_registration_hook():
    """A strategy is one file: what it needs beyond the candidates (here per-block scores made
    from the request) comes from the `inputs` hook it registers, and its selection is the plan's."""
    from pydantic import BaseModel

    from mergepipe.plan.strategies import STRATEGIES, Selection, StrategyInputs
    from mergepipe.plan.strategies.registry import STRATEGY_CONFIG, register

    class Params(BaseModel):
        model_config = STRATEGY_CONFIG
        strategy: str = "test_hooked"

    seen = {}

    def inputs(request, cands):
        seen["request"], seen["n"] = request, len(cands)
        return StrategyInputs(block_scores={(c.expert, c.tensor, c.block): float(c.block % 2) for c in cands})

    def select(cands, budget_bytes, ctx, p):
        """Odd blocks only."""
        return Selection([ctx.block_scores[(c.expert, c.tensor, c.block)] > 0 for c in cands])

    base_index, experts, idx, deltas = synthetic_indexes([[1.0, 2.0, 3.0, 4.0]], 2, 0)
    req = PlanRequest(base=PlanInput("base", "/m/base", "b" * 64, 0.0), base_index=base_index, experts=experts,
                      expert_indexes=idx, deltas=deltas, method="task_arithmetic", params={"lambda": 1.0}, seed=0,
                      budget="full", block_bytes=64, output={"dtype": None, "shard_bytes": None},
                      strategy={"strategy": "test_hooked"})
    register("test_hooked", params=Params, inputs=inputs)(select)
    try:
        plan = plan_doc(req)
    finally:
        del STRATEGIES["test_hooked"]
    assert seen["request"] is req and seen["n"] == plan["bytes"]["candidate_pairs"] > 0
    read = [b for per in plan["reads"].values() for blocks in per.values() for b in blocks]
    assert read and all(b % 2 for b in read)
    assert plan["strategy"]["name"] == "test_hooked"
    with pytest.raises(ValueError, match="registers no `inputs` hook"):
        register("test_unfed", params=Params, sketched=True)
