"""One rule for a budget too small to read anything (plan/budget_floor.py): whatever its form
(bytes, a percentage, a fraction), a budget that resolves below the smallest read the plan's
strategy can make (an expert block; a block of every expert for a joint method; a block's
sketch for the sketch strategy) is refused in one line naming the budget and that read; at or
above it the plan reads something, and plans of budgets that worked before are unchanged."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.cli import main
from mergepipe.errors import BudgetError
from mergepipe.index.sketch import sketch_cost
from mergepipe.plan.planner import PlanInput, PlanRequest
from mergepipe.units import parse_budget
from tests.helpers import plan_doc, load_model, synthetic_indexes, write_config

BLOCK = 4 * 8 * 2  # synthetic_indexes: 4 rows of 8 bf16 per block
SKETCH = sketch_cost(32)
STRATEGIES = [None, {"strategy": "balanced"}, {"strategy": "compensated"},
              {"strategy": "calibrated", "text": "c.txt"}, {"strategy": "sketch"}]


class _Sketch:
    """What index/sketch.Sketch tells the planner, made up: every changed block sketched, keeping
    half of its energy."""

    def __init__(self, delta):
        self.delta, self.digest = delta, "5" * 64

    def has(self, tensor: str, block: int) -> bool:
        return not self.delta.tensors[tensor].identical[block]

    def stats(self, tensor: str, block: int):
        l2, nnz = self.delta.tensors[tensor].block_l2[block], 32
        alpha = float(torch.tensor(l2 * math.sqrt(0.5 / nnz), dtype=torch.float32))
        return alpha, alpha * nnz, nnz


def _plan(indexes, budget, strategy=None, method="task_arithmetic"):
    base_index, experts, idx, deltas = indexes
    name = (strategy or {}).get("strategy")
    calibration = None
    if name == "calibrated":
        calibration = {"artifact": "a" * 64, "text": "c" * 64, "energies": {
            n: {t: [x * x for x in td.block_l2] for t, td in d.tensors.items()} for n, d in deltas.items()}}
    params = {"lambda": 1.0} if method == "task_arithmetic" else {}
    return plan_doc(PlanRequest(
        base=PlanInput("base", "/m/base", "b" * 64, 0.0), base_index=base_index, experts=experts,
        expert_indexes=idx, deltas=deltas, method=method, params=params, seed=0, budget=budget,
        block_bytes=4096, output={"dtype": None, "shard_bytes": None}, strategy=strategy,
        calibration=calibration, sketches={n: _Sketch(d) for n, d in deltas.items()} if name == "sketch" else None))


def _reads(plan) -> int:
    sketched = (plan.get("strategy") or {}).get("sketch", {}).get("blocks", {})
    return plan["bytes"]["planned_pairs"] + sum(len(b) for per in sketched.values() for b in per.values())


BUDGETS = st.one_of(st.integers(1, 400).map(lambda b: f"{b}B"),
                    st.sampled_from(["0.000001%", "0.1%", "1%", "2.5%", "5%", "12.5%", 0.01, 0.3, "full"]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5), min_size=1, max_size=4),
       st.integers(1, 3), st.integers(0, 10), BUDGETS, st.sampled_from(STRATEGIES))
def test_a_budget_below_the_smallest_read_is_refused_and_one_above_reads(tensor_blocks, k, seed, budget, strategy):
    indexes = synthetic_indexes(tensor_blocks, k, seed)
    full = _plan(indexes, "full", strategy)["bytes"]["full_read_expert_bytes"]
    resolved = parse_budget(budget).resolve(full)
    smallest = SKETCH if (strategy or {}).get("strategy") == "sketch" else BLOCK
    if full and resolved < smallest:
        with pytest.raises(BudgetError) as err:
            _plan(indexes, budget, strategy)
        message = str(err.value)
        assert "\n" not in message and f"budget {parse_budget(budget)} ({resolved} bytes)" in message
        assert f"({smallest} bytes)" in message
        assert ("expert sketch" if smallest == SKETCH else "expert block") in message
        return
    plan = _plan(indexes, budget, strategy)
    assert (_reads(plan) > 0) == (full > 0)


@pytest.mark.parametrize("budget", ["0.000001%", "1B", "40B", "63B", 0.0001])
def test_refused_whatever_the_form_of_the_budget(budget):
    indexes = synthetic_indexes([[1.0, 2.0, 3.0], [0.5, 4.0]], 2, 1)
    with pytest.raises(BudgetError, match=rf"smaller than any expert block \({BLOCK} bytes\), so the merge would "
                                          "read nothing and publish the base"):
        _plan(indexes, budget)
    assert _plan(indexes, f"{BLOCK}B")["bytes"]["planned_pairs"] == 1


def test_a_percentage_below_the_floor_says_which_percentage_reads():
    indexes = synthetic_indexes([[1.0, 2.0, 3.0], [0.5, 4.0]], 2, 1)
    with pytest.raises(BudgetError) as err:
        _plan(indexes, "0.000001%")
    wanted = str(err.value).split("raise it to at least ")[1].split(" ")[0]
    assert _plan(indexes, wanted)["bytes"]["planned_pairs"] >= 1


def test_the_sketch_strategy_reads_a_sketch_below_one_block():
    indexes = synthetic_indexes([[1.0, 2.0, 3.0], [0.5, 4.0]], 2, 1)
    plan = _plan(indexes, f"{SKETCH}B", {"strategy": "sketch"})
    assert plan["bytes"]["planned_sketch_bytes"] == SKETCH and plan["bytes"]["planned_pairs"] == 0
    with pytest.raises(BudgetError, match=rf"smaller than any expert sketch \({SKETCH} bytes\)"):
        _plan(indexes, f"{SKETCH - 1}B", {"strategy": "sketch"})


def test_a_joint_method_floor_is_one_block_of_every_expert():
    indexes = synthetic_indexes([[1.0, 2.0, 3.0], [0.5, 4.0]], 3, 2)
    group = min(sum(BLOCK for d in indexes[3].values() if not d.tensors[t].identical[b])
                for t, td in indexes[3]["e0"].tensors.items() for b in range(len(td.identical))
                if any(not d.tensors[t].identical[b] for d in indexes[3].values()))
    with pytest.raises(BudgetError, match=rf"smaller than any block read for all experts at once \({group} bytes\)"):
        _plan(indexes, f"{group - 1}B", method="sce")
    assert _plan(indexes, f"{group}B", method="sce")["bytes"]["planned_pairs"] >= 1


def test_nothing_to_read_has_no_floor():
    indexes = synthetic_indexes([[0.0, 0.0]], 2, 0)  # every expert equals the base
    assert _plan(indexes, "1B")["bytes"]["planned_pairs"] == 0


def test_plans_of_budgets_that_worked_keep_their_hash():
    """Plan hashes at budgets above the floor, as the planner made them before the floor (e735232),
    but for the base's `files` (issue 28: the base's copied non-weight files, here none)."""
    indexes = synthetic_indexes([[1.0, 2.0, 3.0], [0.5, 4.0, 0.2]], 3, 4)
    hashes = {str(b): _plan(indexes, b)["plan_hash"] for b in ("64B", "200B", "10%", "50%", "full")}
    assert hashes == EXPECTED_HASHES


EXPECTED_HASHES = {
    "64B": "6fb51febdcf51b82d2e61d6f7c9230cc831ef276e1eee36d93c4a8d7bb00d2fe",
    "200B": "9fab1b4655d1c357a3d930220013e92b6527d3e9fb1831c6fff14b5022c7c093",
    "10%": "3fd6da1d62a839539904efe0bdc9cb88b83ac8104223abbf3a10b7a20d186f77",
    "50%": "2bec51dd4718afca5699e1e17ac57d89b785514cb9e6cc74abfcd787486f0b60",
    "full": "7547b30fb23ff503a4438640e81d00890fe1b950128516d65af01a3eddfb47e3",
}


def _cli(tmp_path: Path, family, budget, plan=None):
    overrides = {"budget": budget, "output": {"dir": str(tmp_path / "out")}}
    if plan is not None:
        overrides["plan"] = plan
    return main(["run", str(write_config(tmp_path, family, **overrides)), "-q"])


@pytest.mark.parametrize("plan", [{"strategy": "energy"}, {"strategy": "sketch"}], ids=["energy", "sketch"])
@pytest.mark.parametrize("budget", ["0.000001%", "1B"])
def test_run_refuses_in_one_line_and_publishes_nothing(tmp_path, tiny_family, capsys, budget, plan):
    """The reported case: `budget: 0.000001%` published the base byte for byte, exit 0."""
    assert _cli(tmp_path, tiny_family, budget, plan) == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"budget {parse_budget(budget)}" in err, err
    assert ("expert sketch (36 bytes)" if plan["strategy"] == "sketch" else "expert block (256 bytes)") in err, err
    assert not (tmp_path / "out").exists()


def test_run_with_a_sketch_sized_budget_merges_a_sketch(tmp_path, tiny_family):
    """40B was refused as smaller than any block (256 bytes); a 36-byte sketch fits."""
    assert _cli(tmp_path, tiny_family, "40B", {"strategy": "sketch"}) == 0
    base = load_model(Path(tiny_family["root"]) / "base")
    merged = load_model(tmp_path / "out")
    assert any(not torch.equal(base[n], merged[n]) for n in base)
