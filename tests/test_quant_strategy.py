"""Rate-distortion allocation over group-quantized deltas and sketches (plan/strategies/quant.py,
issue 29 item 3) and the torch path's decode of a quantized block (engine/quantized.py):
budget-sound, the same choices whatever the experts' order, the plain full read at a full
budget, optimal at the hull's breakpoints, and on real group-quantized files the predicted
error of the merged delta is the measured one (one expert: exactly, up to rounding)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.checkpoint.safetensors import ITEMSIZE, CheckpointReader
from mergepipe.engine.quantized import Quantized
from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.index import groupquant as gq
from mergepipe.index.scan import _decode
from mergepipe.index.store import Store
from mergepipe.plan.strategies import quant
from mergepipe.plan.strategies.registry import Candidate, PlanContext


def _cand(expert: str, tensor: str, block: int, cost: int, l2: float, e: float = 1.0) -> Candidate:
    return Candidate(-(e * l2) / cost, tensor, block * 4, f"h-{expert}", expert, block, cost, e * l2, l2)


def _family(draw_blocks: list[tuple[int, float, list[tuple[int, float]]]], experts=("a", "b", "c")):
    """Candidates (energy order) and options from (cost, l2, [(option cost, residual share)])."""
    cands, options = [], {}
    for name, (b, (cost, l2, opts)) in itertools.product(experts, enumerate(draw_blocks)):
        c = _cand(name, f"t{b % 3}", b, cost, l2 * (1 + "abc".index(name)))
        cands.append(c)
        options[(name, c.tensor, b)] = [quant.Option(f"gq{k}", oc, share * c.l2 ** 2)
                                        for k, (oc, share) in enumerate(opts)]
    cands.sort()
    return cands, options


_blocks = st.lists(st.tuples(st.integers(8, 4096), st.floats(0.0, 10.0),
                             st.lists(st.tuples(st.integers(1, 5000), st.floats(0.0, 1.5)), max_size=4)),
                   min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(_blocks, st.floats(0.0, 1.2))
def test_budget_sound_order_free_and_full_at_full_budget(blocks, share):
    cands, options = _family(blocks)
    full = sum(c.cost for c in cands)
    weight = {(c.expert, c.tensor, c.block): 1.0 for c in cands}
    budget = int(full * share)
    chosen = quant.allocate(cands, options, budget, weight)
    assert sum(ch.cost for ch in chosen) <= budget
    for c, ch in zip(cands, chosen):  # each choice is one of the candidate's own options
        assert ch.kind in (quant.NOTHING, quant.EXACT) or quant.Option(ch.kind, ch.cost, ch.r2) in options[
            (c.expert, c.tensor, c.block)]
    # the experts listed in another order: the same candidates (the energy order), the same choices
    cands2, options2 = _family(blocks, experts=("c", "a", "b"))
    assert cands2 == cands and quant.allocate(cands2, options2, budget, weight) == chosen
    assert quant.allocate(list(cands), dict(reversed(options.items())), budget, weight) == chosen
    if budget >= full:
        assert all(ch.kind == quant.EXACT for ch in chosen)


def test_the_hull_drops_dominated_and_concave_points():
    c = _cand("a", "t", 0, 1000, 10.0)  # l2^2 = 100
    opts = [quant.Option("gq1", 100, 40.0), quant.Option("gq2", 200, 35.0),  # gq2 above the hull
            quant.Option("gq4", 300, 5.0), quant.Option("gq8", 1000, 0.0),  # gq8 costs the full read
            quant.Option("bad", 50, 120.0)]  # keeps nothing
    assert [p.kind for p in quant.hull(c, opts)] == [quant.NOTHING, "gq1", "gq4", quant.EXACT]


def test_at_a_breakpoint_the_greedy_is_the_exhaustive_optimum():
    cands = sorted([_cand("a", "t", 0, 1000, 10.0), _cand("b", "t", 0, 1000, 6.0), _cand("a", "u", 1, 500, 4.0)])
    options = {("a", "t", 0): [quant.Option("gq4", 250, 4.0), quant.Option("gq1", 70, 45.0)],
               ("b", "t", 0): [quant.Option("gq4", 250, 1.5), quant.Option("gq1", 70, 16.0)],
               ("a", "u", 1): [quant.Option("gq4", 125, 0.6)]}
    weight = dict.fromkeys(options, 1.0)
    for budget in (70, 140, 320, 500, 625, 1000, 2500):
        got = quant.allocate(cands, options, budget, weight)
        menus = [[quant.Choice(quant.NOTHING, 0, c.l2 ** 2), quant.Choice(quant.EXACT, c.cost, 0.0)]
                 + [quant.Choice(*o) for o in options[(c.expert, c.tensor, c.block)]] for c in cands]
        best = min(sum(ch.r2 for ch in pick) for pick in itertools.product(*menus)
                   if sum(ch.cost for ch in pick) <= budget)
        assert sum(ch.cost for ch in got) <= budget
        assert quant.predicted_error_sq(cands, got, weight) == pytest.approx(best), budget


def test_calibrated_weights_scale_the_distortion():
    c = _cand("a", "t", 0, 1000, 10.0)
    ctx = PlanContext(experts=(("a", "h-a"),), effective={"a": 0.5}, block_scores={("a", "t", 0): 300.0})
    assert quant.weights([c], ctx) == {("a", "t", 0): 0.25 * 3.0}
    assert quant.weights([c], PlanContext(experts=(("a", "h-a"),), effective={"a": 0.5})) == {("a", "t", 0): 0.25}


SPECS = [gq.Spec(1, 64), gq.Spec(2, 128), gq.Spec(4, 64), gq.Spec(8, 128)]


def _real(tiny_family, tmp_path, k: int = 1):
    """Expert k of the tiny family (named e<k>): its candidates, its blocks' fp32 deltas, its
    opened files."""
    store = Store(tmp_path / "cache")
    root = tiny_family["root"]
    base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
    expert, index = store.model_index(root / f"expert_{k}", block_bytes=16 << 10)
    delta = store.delta_index(base, base_index, expert, index)
    paths = {s: gq.cache_path(tmp_path / "gq", index.content_hash, base_index.content_hash, base_index.layout.key, s)
             for s in SPECS}
    gq.build(paths, base, base_index, expert, index, delta)
    files = {s.name: gq.GroupQuant(p, expert=index.content_hash, base=base_index.content_hash,
                                   base_index=base_index, spec=s) for s, p in paths.items()}
    cands, deltas = [], {}
    with CheckpointReader(base) as br, CheckpointReader(expert) as er:
        for name, entry in base_index.tensors.items():
            t = base.tensors[name]
            if name not in files["gq1g64"].tensors:
                continue
            for b, (r0, r1) in enumerate(entry.ranges):
                if delta.tensors[name].identical[b]:
                    continue
                n = (r1 - r0) * (t.numel // t.shape[0] if t.shape else 1)
                d = (_decode(er.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32))
                     - _decode(br.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32)))
                deltas[(name, b)] = d
                l2 = float(np.sqrt(np.sum(d.astype(np.float64) ** 2)))
                cands.append(Candidate(-l2 / (n * ITEMSIZE[t.dtype]), name, r0, index.content_hash, f"e{k}", b,
                                       n * ITEMSIZE[t.dtype], l2, l2))
    cands.sort()
    return base, base_index, files, cands, deltas


@pytest.mark.parametrize("share", [0.10, 0.25, 0.5, 1.0])
def test_on_real_files_the_prediction_is_the_merged_error_and_the_bytes_are_the_engines(tiny_family, tmp_path, share):
    base, base_index, files, cands, deltas = _real(tiny_family, tmp_path)
    assert len(cands) > 10
    options = quant.options_of(cands, {"e1": list(files.values())})
    weight = {("e1", c.tensor, c.block): 1.0 for c in cands}
    budget = int(share * sum(c.cost for c in cands))
    chosen = quant.allocate(cands, options, budget, weight)
    assert sum(ch.cost for ch in chosen) <= budget
    kinds = {ch.kind for ch in chosen}
    if share < 1:
        assert kinds & {s.name for s in SPECS}, kinds  # the representations are used below full
    else:
        assert kinds == {quant.EXACT}
    recorded = json.loads(json.dumps(quant.record_blocks(cands, chosen)))  # as a plan file holds it
    blocks = quant.parse_blocks(recorded, ["e1"], {n: len(e.ranges) for n, e in base_index.tensors.items()}, "p.json")
    assert sum(map(len, blocks.get("e1", {}).values())) == sum(ch.kind in quant.KINDS for ch in chosen)
    reader = Quantized(blocks, {"e1": files})
    err = 0.0
    for c, ch in zip(cands, chosen):  # task arithmetic with one expert at lambda 1: merged delta error
        d = deltas[(c.tensor, c.block)]
        got = reader.delta("e1", c.tensor, c.block, d.size)
        if ch.kind == quant.EXACT:
            assert got is None
        elif ch.kind == quant.NOTHING:
            assert got is None
            err += float(np.sum(d.astype(np.float64) ** 2))
        else:
            err += float(np.sum((np.where(np.isfinite(d), d, 0) - got).astype(np.float64) ** 2))
    assert reader.bytes_read == sum(ch.cost for ch in chosen if ch.kind not in (quant.NOTHING, quant.EXACT))
    assert err == pytest.approx(quant.predicted_error_sq(cands, chosen, weight), rel=1e-5, abs=1e-12)
    for f in files.values():
        f.close()


@pytest.mark.parametrize("raw, says", [
    ([], "plan key strategy.quant.blocks: expected a mapping"),
    ({"zz": {}}, "strategy.quant.blocks.zz: not an expert"),
    ({"a": []}, "strategy.quant.blocks.a: not an expert"),
    ({"a": {"nope": [[0, "gq4g64"]]}}, "strategy.quant.blocks.a.nope: the base has no such tensor"),
    ({"a": {"t": []}}, "strategy.quant.blocks.a.t: expected a non-empty list"),
    ({"a": {"t": [[0, "gq3g64"]]}}, "strategy.quant.blocks.a.t: [0, 'gq3g64'] is not [block, kind]"),
    ({"a": {"t": [[4, "gq4g64"]]}}, "blocks increasing below 4"),
    ({"a": {"t": [[-1, "gq4g64"]]}}, "is not [block, kind]"),
    ({"a": {"t": [[1, "gq4g64"], [1, "gq8g64"]]}}, "[1, 'gq8g64'] is not"),
    ({"a": {"t": [[True, "gq4g64"]]}}, "[True, 'gq4g64'] is not"),
    ({"a": {"t": [[0.0, "gq4g64"]]}}, "is not [block, kind]"),
    ({"a": {"t": [[0, "gq4g64", 1]]}}, "is not [block, kind]"),
    ({"a": {"t": [[0, "sketch"]]}}, "is not [block, kind]"),  # sketches are strategy.sketch.blocks
])
def test_a_hostile_plan_field_is_refused_in_one_line(raw, says):
    with pytest.raises(ConfigError) as e:
        quant.parse_blocks(raw, ["a", "b"], {"t": 4}, "plan.json")
    msg = str(e.value)
    assert says in msg and "\n" not in msg and msg.startswith("plan.json: ")
    good = quant.parse_blocks({"a": {"t": [[0, "gq4g64"], [3, "gq1g128"]]}}, ["a"], {"t": 4}, "plan.json")
    assert good == {"a": {"t": {0: "gq4g64", 3: "gq1g128"}}}


def test_the_decode_refuses_a_kind_its_files_lack(tiny_family, tmp_path):
    _, _, files, cands, _ = _real(tiny_family, tmp_path)
    c = cands[0]
    held = {"e1": {n: f for n, f in files.items() if n != "gq4g128"}}
    for expert, block, kind in [("e1", c.block, "gq4g128"), ("e2", c.block, "gq4g64"), ("e1", 999, "gq4g64")]:
        with pytest.raises(IntegrityError, match=f"expert '{expert}' tensor '{c.tensor}' block {block} as {kind},"):
            Quantized({expert: {c.tensor: {block: kind}}}, held)
    assert Quantized({"e1": {c.tensor: {c.block: "gq4g64"}}}, held)
    for f in files.values():
        f.close()


PREDICTION_TOLERANCE = 0.005  # |predicted - measured| relative error, three experts (docs/budgets.md)


@pytest.mark.parametrize("share", [0.05, 0.10, 0.25, 0.5])
def test_the_predicted_relative_error_tracks_the_measured_one_for_three_experts(tiny_family, tmp_path, share):
    """Task arithmetic (lambda 1) over the tiny family's three experts: the plan's uncorrelated
    estimate against the merged update's measured relative error."""
    cands, files, deltas = [], {}, {}
    for k in range(3):
        _, _, f, c, d = _real(tiny_family, tmp_path, k)
        cands += c
        files[f"e{k}"] = list(f.values())
        deltas.update({(f"e{k}", *key): v for key, v in d.items()})
    cands.sort()
    options = quant.options_of(cands, files)
    weight = {(c.expert, c.tensor, c.block): 1.0 for c in cands}
    chosen = quant.allocate(cands, options, int(share * sum(c.cost for c in cands)), weight)
    decoded = {(c.expert, c.tensor, c.block): ch.kind for c, ch in zip(cands, chosen)}
    by_kind = {(e, q.spec.name): q for e, qs in files.items() for q in qs}
    err = ref = 0.0
    for tensor, block in sorted({(c.tensor, c.block) for c in cands}):
        exact, got = 0.0, 0.0
        for e in files:
            d = deltas.get((e, tensor, block))
            if d is None:
                continue
            d = np.where(np.isfinite(d), d, 0).astype(np.float64)
            kind = decoded[(e, tensor, block)]
            exact = exact + d
            got = got + (d if kind == quant.EXACT else 0.0 if kind == quant.NOTHING
                         else by_kind[(e, kind)].delta(tensor, block, d.size).astype(np.float64))
        err += float(np.sum((got - exact) ** 2))
        ref += float(np.sum(exact ** 2))
    measured = (err / ref) ** 0.5
    predicted = quant.predicted_relative_error(cands, chosen, weight)
    assert 0 < measured < 1 and abs(predicted - measured) <= PREDICTION_TOLERANCE, (predicted, measured)
    for qs in files.values():
        for q in qs:
            q.close()
