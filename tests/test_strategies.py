"""Plan strategies (issue 12): every registered strategy is budget-sound, deterministic
(whatever the order experts are listed in) and, at full budget, the plain full-read merge
byte for byte; the default adds nothing to the plan; balanced shares the budget per
expert; compensated's rescale factors are the index's norm ratios and the engine applies
them (torch path, compiled kernels bypassed) only where they are != 1."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.cli import main
from mergepipe.commands.explain import explain
from mergepipe.commands.pipeline import plan_config
from mergepipe.config.params import load_config
from mergepipe.engine.merge import run_merge
from mergepipe.errors import ConfigError
from mergepipe.index.store import Store
from mergepipe.plan.planner import PlanInput, PlanRequest, plan_hash
from mergepipe.plan.record import validate_plan
from mergepipe.plan.strategies import STRATEGIES
from mergepipe.plan.strategies.balanced import expert_shares
from mergepipe.plan.strategies.registry import PlanContext
from mergepipe.index.records import DeltaIndex, ModelIndex, TensorDelta, TensorEntry
from mergepipe.plan.record import plan_json
from tests.helpers import plan_doc, columnar, load_model, synthetic_indexes, write_config

OPTIONS = [None, {"strategy": "energy"}, {"strategy": "balanced"}, {"strategy": "balanced", "shares": "equal"},
           {"strategy": "compensated"}, {"strategy": "compensated", "select": "balanced", "max_scale": 2.0},
           {"strategy": "calibrated", "text": "c.txt"}, {"strategy": "calibrated", "text": "c.txt", "shares": "equal"},
           {"strategy": "sketch"}]

# real merges of the non-default strategies; calibrated needs a transformers model as base
# (its real merges are in tests/test_calibrated.py)
# (sketch's real merges are in tests/test_sketch.py)
REAL_OPTIONS = [o for o in OPTIONS[2:] if o["strategy"] not in ("calibrated", "sketch")]


class _SyntheticSketch:
    """What index/sketch.Sketch tells the planner, made up: every non-identical block sketched,
    alpha such that the sketch keeps (0.3 + (block % 3) / 5) of the block's energy."""

    def __init__(self, delta, expert: str):
        self.delta, self.digest = delta, f"{int(expert[1:]) + 7:064x}"

    def has(self, tensor: str, block: int) -> bool:
        return not self.delta.tensors[tensor].identical[block]

    def stats(self, tensor: str, block: int):
        l2, nnz = self.delta.tensors[tensor].block_l2[block], 32
        alpha = float(torch.tensor(l2 * math.sqrt((0.3 + (block % 3) / 5) / nnz), dtype=torch.float32))
        return alpha, alpha * nnz, nnz


def _calibration(idx, deltas) -> dict:
    """Synthetic importance energies (what commands/calibration.py would give): l2^2 times a
    factor that reorders blocks; every third tensor uncovered."""
    energies = {}
    for name, delta in deltas.items():
        per = {}
        for i, (t, td) in enumerate(sorted(delta.tensors.items())):
            if i % 3 != 2:
                per[t] = [l2 * l2 * (1 + (b * 7) % 3) for b, l2 in enumerate(td.block_l2)]
        energies[name] = per
    return {"artifact": "a" * 64, "text": "c" * 64, "energies": energies}


def _plan(base_index, experts, idx, deltas, budget_bytes, strategy, method="task_arithmetic", lam=1.0):
    kind = (strategy or {}).get("strategy")
    return plan_doc(PlanRequest(
        base=PlanInput("base", "/m/base", "b" * 64, 0.0), base_index=base_index, experts=experts,
        expert_indexes=idx, deltas=deltas, method=method, params={"lambda": lam}, seed=0,
        budget=f"{budget_bytes}B", budget_bytes=budget_bytes, block_bytes=4096,
        output={"dtype": None, "shard_bytes": None}, strategy=strategy,
        calibration=_calibration(idx, deltas) if kind == "calibrated" else None,
        sketches={n: _SyntheticSketch(d, n) for n, d in deltas.items()} if kind == "sketch" else None))


def test_every_registered_strategy_is_exercised():
    assert {(o or {}).get("strategy", "energy") for o in OPTIONS} == set(STRATEGIES)


@given(st.lists(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5), min_size=1, max_size=4),
       st.integers(1, 4), st.integers(0, 2000), st.integers(0, 10), st.sampled_from(OPTIONS))
def test_budget_sound_deterministic_and_full_at_full_budget(tensor_blocks, k, budget, seed, strategy):
    base_index, experts, idx, deltas = synthetic_indexes(tensor_blocks, k, seed)
    plan = _plan(base_index, experts, idx, deltas, budget, strategy)
    assert plan["bytes"]["planned_expert_bytes"] + plan["bytes"].get("planned_sketch_bytes", 0) <= budget
    assert budget == plan["budget_bytes"]
    for e in experts:
        for tname, blocks in plan["reads"][e.name].items():
            assert all(not deltas[e.name].tensors[tname].identical[b] for b in blocks)
    # independent of the order experts are listed in, and of repetition
    again = _plan(base_index, list(reversed(experts)), idx, deltas, budget, strategy)
    assert again == plan
    assert _plan(base_index, experts, idx, deltas, budget, strategy) == plan
    # a plan with a strategy passes the plan-file validator (merge/gather/verify --replay)
    validate_plan(json.loads(json.dumps(plan)), "plan.json")
    # at (or above) the full read, every non-identical block is read, nothing rescaled, no bound
    full_bytes = plan["bytes"]["full_read_expert_bytes"]
    for b in (full_bytes, full_bytes + 999):
        full = _plan(base_index, experts, idx, deltas, b, strategy)
        plain = _plan(base_index, experts, idx, deltas, b, None)
        assert full["reads"] == plain["reads"]
        # a sketch plan says it sketched nothing
        assert full["bytes"].pop("planned_sketch_bytes", 0) == 0
        assert not any(full["bytes"].pop("sketch_by_expert", {}).values())
        assert not any(full.get("strategy", {}).get("sketch", {}).get("blocks", {}).values())
        assert full["bytes"] == plain["bytes"] and full["bound"]["omitted_mass"] == 0.0
        assert not full.get("strategy", {}).get("scales")


def test_default_strategy_adds_no_key_and_keeps_the_hash():
    base_index, experts, idx, deltas = synthetic_indexes([[1.0, 2.0, 3.0], [0.5, 4.0]], 3, 1)
    plain = _plan(base_index, experts, idx, deltas, 200, None)
    assert "strategy" not in plain
    assert _plan(base_index, experts, idx, deltas, 200, {"strategy": "energy"}) == plain
    assert _plan(base_index, experts, idx, deltas, 200, {}) == plain
    other = _plan(base_index, experts, idx, deltas, 200, {"strategy": "balanced"})
    assert other["strategy"] == {"name": "balanced", "parameters": {"strategy": "balanced", "shares": "weight"},
                                 "scales": {}}
    assert other["plan_hash"] != plain["plan_hash"] and other["plan_hash"] == plan_hash(other)
    eq = _plan(base_index, experts, idx, deltas, 200, {"strategy": "balanced", "shares": "equal"})
    assert eq["plan_hash"] != other["plan_hash"]  # options are covered by the hash


def test_a_config_without_plan_gets_sketch_below_full_for_the_measured_methods(tmp_path, tiny_family):
    """plan/strategies/default.py: no `plan:` gives `sketch` for task arithmetic, linear and TIES
    below the full budget, and `energy` (no plan key) at the full budget and for other
    methods; a config that names `energy` gets it."""
    def planned(name, **over):
        (tmp_path / name).mkdir()
        cfg = load_config(write_config(tmp_path / name, tiny_family, cache_dir=str(tmp_path / "cache"), **over))
        return plan_json(plan_config(cfg, Store(cfg.cache_dir))[0])

    ties = {"method": "ties", "parameters": {"lambda": 1.0, "density": 0.5}}
    for name, over in (("ta", {}), ("ties", ties), ("linear", {"method": "linear", "parameters": {}})):
        auto = planned(f"{name}-25", budget="25%", **over)
        assert auto["strategy"]["name"] == "sketch" and auto["bytes"]["planned_sketch_bytes"] > 0, name
        assert auto == planned(f"{name}-named", budget="25%", plan={"strategy": "sketch"}, **over)
        energy = planned(f"{name}-energy", budget="25%", plan={"strategy": "energy"}, **over)
        assert "strategy" not in energy and energy["plan_hash"] != auto["plan_hash"]
        assert "strategy" not in planned(f"{name}-full", budget="full", **over)
    dare = planned("dare", budget="25%", method="dare_ties", parameters={"lambda": 1.0, "density": 0.5})
    assert "strategy" not in dare


def test_bad_strategy_options_are_config_errors():
    base_index, experts, idx, deltas = synthetic_indexes([[1.0, 2.0]], 2, 0)
    for bad in ({"strategy": "nope"}, {"strategy": "balanced", "shares": "x"},
                {"strategy": "compensated", "max_scale": 0.5}, {"strategy": "energy", "max_scale": 2.0}):
        with pytest.raises(ConfigError):
            _plan(base_index, experts, idx, deltas, 100, bad)
    with pytest.raises(ConfigError, match="rescales"):
        _plan(base_index, experts[:1], idx, deltas, 100, {"strategy": "compensated"}, method="slerp")


def _two_experts(big: float, small: float, blocks: int = 8):
    """Two experts over one tensor: e0's blocks all `big`, e1's all `small` (64-byte blocks)."""
    t = TensorEntry("t", "BF16", (4 * blocks, 8), tuple((4 * b, 4 * b + 4) for b in range(blocks)),
                    tuple("0" * 64 for _ in range(blocks)))
    base_index = columnar(ModelIndex("b" * 64, 64, {"t": t}))
    experts, idx, deltas = [], {}, {}
    for k, v in enumerate((big, small)):
        h = f"{k + 1:064x}"
        experts.append(PlanInput(f"e{k}", f"/m/e{k}", h, 1.0))
        idx[f"e{k}"] = columnar(ModelIndex(h, 64, {"t": t}))
        l2 = tuple(v * (1 + 0.01 * b) for b in range(blocks))
        deltas[f"e{k}"] = columnar(DeltaIndex(h, "b" * 64, 64, {"t": TensorDelta(
            "t", blocks * 32, sum(l2), math.sqrt(sum(x * x for x in l2)), 0, l2, l2, (32,) * blocks,
            (False,) * blocks, (), (), (), (), {})}))
    return base_index, experts, idx, deltas


def test_balanced_gives_the_small_expert_its_share():
    base_index, experts, idx, deltas = _two_experts(10.0, 0.1)
    energy = _plan(base_index, experts, idx, deltas, 8 * 64, None)
    assert energy["bytes"]["planned_by_expert"] == {"e0": 512, "e1": 0}  # energy: all to the big expert
    balanced = _plan(base_index, experts, idx, deltas, 8 * 64, {"strategy": "balanced"})
    assert balanced["bytes"]["planned_by_expert"] == {"e0": 256, "e1": 256}
    # inside its share, greedy by energy: e1's largest blocks (the last four)
    assert balanced["reads"]["e1"] == {"t": [4, 5, 6, 7]}
    # shares by |weight|: e0 weighted 3x gets 3/4 of the budget
    heavy = [PlanInput("e0", "/m/e0", experts[0].content_hash, 3.0), experts[1]]
    by_weight = _plan(base_index, heavy, idx, deltas, 8 * 64, {"strategy": "balanced"})
    assert by_weight["bytes"]["planned_by_expert"] == {"e0": 384, "e1": 128}
    equal = _plan(base_index, heavy, idx, deltas, 8 * 64, {"strategy": "balanced", "shares": "equal"})
    assert equal["bytes"]["planned_by_expert"] == {"e0": 256, "e1": 256}


def test_balanced_passes_leftovers_on():
    base_index, experts, idx, deltas = _two_experts(10.0, 0.1, blocks=2)
    # e1 has 128 bytes in all; its unused share goes to e0 (budget 6 blocks of 64 B, 4 exist)
    plan = _plan(base_index, experts, idx, deltas, 3 * 64, {"strategy": "balanced", "shares": "equal"})
    assert plan["bytes"]["planned_expert_bytes"] == 192  # 3 of the 4 blocks: nothing is wasted
    ctx = PlanContext((("a", "1"), ("b", "2"), ("c", "3")), {"a": 1.0, "b": 2.0, "c": 0.0})
    assert expert_shares(1000, ctx, "weight") == {"a": 333, "b": 666, "c": 0}
    assert expert_shares(1000, ctx, "equal") == {"a": 333, "b": 333, "c": 333}


def test_compensated_scales_are_norm_ratios_and_enter_the_bound():
    base_index, experts, idx, deltas = synthetic_indexes([[1.0, 2.0, 3.0, 4.0], [0.5, 4.0, 0.1]], 2, 3)
    budget = 300
    energy = _plan(base_index, experts, idx, deltas, budget, None)
    comp = _plan(base_index, experts, idx, deltas, budget, {"strategy": "compensated"})
    assert comp["reads"] == energy["reads"]  # select: energy reads the same blocks
    scales = comp["strategy"]["scales"]
    assert scales  # something is partly read at this budget
    for e in experts:
        for tname, td in deltas[e.name].tensors.items():
            read = comp["reads"][e.name].get(tname, [])
            nonid = [b for b in range(len(td.block_l2)) if not td.identical[b]]
            c = scales.get(e.name, {}).get(tname)
            if not read or len(read) == len(nonid):
                assert c is None
                continue
            want = math.sqrt(sum(td.block_l2[b] ** 2 for b in nonid)) / math.sqrt(sum(td.block_l2[b] ** 2
                                                                                      for b in read))
            assert c == pytest.approx(min(4.0, want), rel=1e-6) and c >= 1.0
            assert c == float(torch.tensor(c, dtype=torch.float32))  # exactly an fp32
    # the rescale's own error is counted: compensated's bound is never below energy's
    assert comp["bound"]["omitted_mass"] >= energy["bound"]["omitted_mass"]
    capped = _plan(base_index, experts, idx, deltas, 30, {"strategy": "compensated", "max_scale": 1.5})
    assert all(c <= 1.5 for per in capped["strategy"]["scales"].values() for c in per.values())


def test_plan_file_scales_are_checked():
    base_index, experts, idx, deltas = synthetic_indexes([[1.0, 2.0, 3.0, 4.0]], 2, 3)
    plan = _plan(base_index, experts, idx, deltas, 150, {"strategy": "compensated"})
    (expert, per), = list(plan["strategy"]["scales"].items())[:1]
    tensor = next(iter(per))
    for edit, match in [(lambda p: p["strategy"]["scales"][expert].__setitem__(tensor, 5.0), "max_scale"),
                        (lambda p: p["strategy"]["scales"][expert].__setitem__("zz", 2.0), "reads no block"),
                        (lambda p: p["strategy"]["scales"][expert].__setitem__(tensor, 0.5), "greater than"),
                        (lambda p: p["strategy"].__setitem__("name", "balanced"), "normalized options"),
                        (lambda p: p["strategy"]["parameters"].__setitem__("strategy", "energy"),
                         "Extra inputs"),
                        (lambda p: p["strategy"]["parameters"].pop("shares"), "normalized options")]:
        bad = json.loads(json.dumps(plan))
        edit(bad)
        bad["plan_hash"] = plan_hash(bad)
        with pytest.raises(ConfigError, match=match) as err:
            validate_plan(bad, "plan.json")
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------ real merges

def _run(tmp_path, family, name, **over):
    (tmp_path / name).mkdir(parents=True)
    cfg = write_config(tmp_path / name, family, output={"dir": str(tmp_path / name / "out")},
                       cache_dir=str(tmp_path / "cache"), **over)
    assert main(["run", str(cfg), "-q"]) == 0
    return json.loads((tmp_path / name / "out" / "manifest.json").read_text())


@pytest.mark.parametrize("method,params", [("task_arithmetic", {"lambda": 0.5}),
                                           ("ties", {"lambda": 1.0, "density": 0.5})])
def test_full_budget_is_the_plain_merge_byte_for_byte(tmp_path, tiny_family, method, params):
    plain = _run(tmp_path, tiny_family, "plain", method=method, parameters=params)
    for i, opts in enumerate(REAL_OPTIONS):
        man = _run(tmp_path, tiny_family, f"s{i}", method=method, parameters=params, plan=opts)
        # the weights byte for byte (the model card names the plan hash, which covers the strategy)
        assert man["outputs"]["tensors"] == plain["outputs"]["tensors"], opts
        weights = {n: f for n, f in plain["outputs"]["files"].items() if n != "README.md"}
        assert {n: f for n, f in man["outputs"]["files"].items() if n != "README.md"} == weights, opts
        assert man["plan"]["strategy"]["scales"] == {}
        assert man["plan"]["reads"] == plain["plan"]["reads"]


def _plan_and_merge(tmp_path, family, name, *, compiled=True, **over):
    (tmp_path / name).mkdir(parents=True)
    cfg_path = write_config(tmp_path / name, family, cache_dir=str(tmp_path / "cache"), **over)
    cfg = load_config(cfg_path)
    plan, inputs = plan_config(cfg, Store(cfg.cache_dir))
    plan = plan_json(plan)  # the engine takes the plan's JSON form
    out = tmp_path / name / ("out" if compiled else "torch")
    out.mkdir(parents=True)
    realized = run_merge(plan, inputs, out, compiled=compiled)
    return plan, realized, out


def test_compensated_merge_applies_the_scales(tmp_path, tiny_family_f32):
    """fp32 task arithmetic: the merged rows are base + sum_k w_k c_kt delta_k over the read
    blocks, computed here in the engine's fp32 order; unscaled tensors equal energy's."""
    fam = tiny_family_f32
    kw = dict(budget="30%", parameters={"lambda": 1.0})
    plan, _, out = _plan_and_merge(tmp_path, fam, "comp", plan={"strategy": "compensated"}, **kw)
    eplan, _, eout = _plan_and_merge(tmp_path, fam, "energy", plan={"strategy": "energy"}, **kw)
    assert plan["reads"] == eplan["reads"] and plan["strategy"]["scales"]
    merged, plain = load_model(out), load_model(eout)
    base = load_model(fam["root"] / "base")
    experts = {e["name"]: (e, load_model(e["path"])) for e in plan["experts"]}
    scaled = {t for per in plan["strategy"]["scales"].values() for t in per}
    _, inputs = plan_config(load_config(tmp_path / "comp" / "params.yaml"), Store(tmp_path / "cache"))
    for tname in base:
        ranges = inputs.base_index.tensors[tname].ranges
        want = base[tname].clone()
        for b, (r0, r1) in enumerate(ranges):
            b0 = base[tname][r0:r1].float()
            terms = []
            for name, (e, w) in experts.items():
                if b not in plan["reads"][name].get(tname, []):
                    continue
                d = w[tname][r0:r1].float() - b0
                c = plan["strategy"]["scales"].get(name, {}).get(tname, 1.0)
                if c != 1.0:
                    d = d * torch.tensor(c, dtype=torch.float32)
                terms.append(d * torch.tensor(e["weight"], dtype=torch.float32))
            if terms:
                total = terms[0]
                for t in terms[1:]:
                    total = total + t
                want[r0:r1] = b0 + total
        assert torch.equal(merged[tname], want), tname
        if tname not in scaled:
            assert torch.equal(merged[tname], plain[tname]), tname
        else:
            assert not torch.equal(merged[tname], plain[tname]), tname


@pytest.mark.parametrize("method,params", [("task_arithmetic", {"lambda": 0.5}),
                                           ("ties", {"lambda": 1.0, "density": 0.5})])
def test_compensated_bf16_bypasses_the_kernels_with_the_same_bytes(tmp_path, tiny_family, method, params):
    kw = dict(budget="25%", method=method, parameters=params, plan={"strategy": "compensated"})
    plan, r1, _ = _plan_and_merge(tmp_path, tiny_family, "a", **kw)
    _, r2, _ = _plan_and_merge(tmp_path, tiny_family, "b", compiled=False, **kw)
    assert plan["strategy"]["scales"] and r1.files == r2.files and r1.tensors == r2.tensors
    # unscaled tensors still take the kernel: same bytes as the energy plan's merge there
    _, r3, _ = _plan_and_merge(tmp_path, tiny_family, "c", **{**kw, "plan": {"strategy": "energy"}})
    scaled = {t for per in plan["strategy"]["scales"].values() for t in per}
    assert scaled and all(r1.tensors[t] == r3.tensors[t] for t in r1.tensors if t not in scaled)
    assert any(r1.tensors[t] != r3.tensors[t] for t in scaled)


def test_certified_bound_holds_for_every_strategy(tmp_path, tiny_family):
    full = load_model(_run_dir(tmp_path, tiny_family, "full", budget="full"))
    for i, opts in enumerate(REAL_OPTIONS):
        for budget in ("10%", "40%"):
            out = _run_dir(tmp_path, tiny_family, f"s{i}-{budget}", budget=budget, plan=opts)
            part = load_model(out)
            dev = sum(float(((part[n].float() - full[n].float()) ** 2).sum()) for n in full) ** 0.5
            bound = json.loads((out / "manifest.json").read_text())["bound"]
            slack = sum(float(((full[n].float().abs() * 2 ** -8) ** 2).sum()) for n in full) ** 0.5
            assert bound["kind"] == "certified" and dev <= bound["omitted_mass"] + slack, (opts, budget)


def _run_dir(tmp_path, family, name, **over):
    _run(tmp_path, family, name, **over)
    return tmp_path / name / "out"


def test_explain_shows_energy_kept_and_scales(tmp_path, tiny_family, capsys):
    cfg = write_config(tmp_path, tiny_family, budget="25%", plan={"strategy": "compensated"},
                       cache_dir=str(tmp_path / "cache"))
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    text = explain(tmp_path / "plan.json", cache_dir=tmp_path / "cache")
    assert "energy kept" in text and "rescale" in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert "strategy compensated" in text
    # the kept share per expert, from the index: between 0 and 1, and 100% at full budget
    assert main(["plan", str(cfg), "-q", "--budget", "full", "-o", str(tmp_path / "full.json")]) == 0
    full = explain(tmp_path / "full.json", cache_dir=tmp_path / "cache")
    assert full.count("100.00%") >= len(plan["experts"])
    # before running: explain a params.yaml at a budget
    text = explain(cfg, cache_dir=None, budget="10%")
    assert "budget 10%" in text and "energy kept" in text


def test_compensated_split_merge_is_byte_identical(tmp_path, tiny_family):
    """merge --part I/N + gather of a rescaling plan gives the single job's bytes."""
    cfg = write_config(tmp_path, tiny_family, budget="20%", method="ties",
                       parameters={"lambda": 1.0, "density": 0.5}, plan={"strategy": "compensated"},
                       cache_dir=str(tmp_path / "cache"))
    plan_file = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan_file)]) == 0
    assert json.loads(plan_file.read_text())["strategy"]["scales"]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["merge", str(plan_file), "-q", "-o", str(tmp_path / "one"), *cache]) == 0
    for i in (1, 2, 3):
        assert main(["merge", str(plan_file), "-q", "--part", f"{i}/3", "-o", str(tmp_path / "parts"), *cache]) == 0
    assert main(["gather", str(plan_file), str(tmp_path / "parts"), "--parts", "3", "-o", str(tmp_path / "two"),
                 *cache]) == 0
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert one["outputs"] == two["outputs"]
