"""Plan strategy `sketch` (issue 12): ternary delta sketches read where a full block does not
fit. The sketch's sums are exact and order-independent; a sketched merge is base + the
weighted sum of (sketch or full) deltas, within budget, under its certified bound, the same
bytes whatever the experts' order; the full budget is the plain merge; damaged sketches and
edited plans are caught; methods that trim or elect signs are refused."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mergepipe.cli import main
from mergepipe.commands.pipeline import plan_config
from mergepipe.config.params import load_config
from mergepipe.engine.merge import run_merge
from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.index import sketch
from mergepipe.index.store import Store
from mergepipe.plan.planner import plan_hash
from mergepipe.plan.record import check_plan_reads, plan_json, validate_plan
from tests.helpers import load_model, write_config


def test_exact_abs_sum_is_exactly_rounded_and_order_independent():
    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 1e20):
        d = (rng.standard_normal(50_000) * np.exp(rng.uniform(-20, 20, 50_000)) * scale).astype(np.float32)
        d[::7] = 0
        want = math.fsum(abs(float(x)) for x in d)
        assert sketch.exact_abs_sum(d) == want
        assert sketch.exact_abs_sum(rng.permutation(d)) == want
    assert sketch.exact_abs_sum(np.zeros(5, np.float32)) == 0.0
    # subnormals, extremes
    tiny = np.array([1e-45, -3e-44, 2e-40, -1.1754942e-38, 1.1754944e-38, 3.0e38, -3.0e38], np.float32)
    assert sketch.exact_abs_sum(tiny) == math.fsum(abs(float(x)) for x in tiny)


def test_codes_round_trip_and_the_scale_is_the_l2_best():
    rng = np.random.default_rng(1)
    for n in (1, 3, 4, 5, 1001):
        d = rng.standard_normal(n).astype(np.float32)
        d[rng.random(n) < 0.3] = 0
        codes, alpha, s1, nnz = sketch.block_sketch(d)
        assert len(codes) == sketch.code_bytes(n) and nnz == int(np.count_nonzero(d))
        got = sketch.unpack(codes, n, alpha)
        assert np.array_equal(np.sign(got), np.sign(d))
        if nnz:
            assert alpha == pytest.approx(np.abs(d[d != 0]).mean(), rel=1e-6)
            l2 = float(np.sqrt(np.sum(d.astype(np.float64) ** 2)))
            want = float(np.sum((d.astype(np.float64) - got) ** 2))
            assert sketch.residual_sq(l2, alpha, s1, nnz) == pytest.approx(want, rel=1e-5, abs=1e-9)


def _bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_the_c_scan_gives_the_numpy_sketch_of_bf16_blocks():
    """index/sketch.py sketches bf16 blocks in C (methods/_bf16c.c mp_sketch_bf16): the same
    codes, alpha, S1 and nnz as block_sketch over the fp32 delta, specials included."""
    from mergepipe.methods import _ckernels
    if _ckernels.load() is None:
        pytest.skip("the C library is not built here")
    scan = _ckernels.load().sketch_bf16
    rng = np.random.default_rng(2)
    for n in (1, 2, 3, 4, 5, 7, 1000, 12345, 1 << 17):
        b = rng.standard_normal(n).astype(np.float32) * np.exp(rng.uniform(-30, 30, n)).astype(np.float32)
        e = b + (rng.standard_normal(n) * 1e-3 * (rng.random(n) < 0.6)).astype(np.float32)
        bb, eb = _bf16(b), _bf16(e)
        if n > 10:  # +Inf, NaN, subnormal deltas, -0 - +0, -Inf, a subnormal crossing zero
            eb[0], eb[1], bb[2], eb[2], eb[3], bb[3], eb[4], bb[5], eb[5] = (
                0x7F80, 0x7FC0, 0x0001, 0x0003, 0x8000, 0, 0xFF80, 0x8001, 0x0001)
        d = (eb.astype(np.uint32) << 16).view(np.float32) - (bb.astype(np.uint32) << 16).view(np.float32)
        assert sketch._sketch_rows(bb.tobytes(), eb.tobytes(), "BF16", n, scan) == sketch.block_sketch(d), n


def _plan_and_merge(tmp_path, family, name, **over):
    (tmp_path / name).mkdir(parents=True)
    cfg = load_config(write_config(tmp_path / name, family, cache_dir=str(tmp_path / "cache"), **over))
    store = Store(cfg.cache_dir)
    plan, inputs = plan_config(cfg, store)
    plan = plan_json(plan)  # the engine takes the plan's JSON form
    out = tmp_path / name / "out"
    out.mkdir()
    return plan, inputs, run_merge(plan, inputs, out), out


def test_merge_is_base_plus_weighted_sketches_and_within_budget(tmp_path, tiny_family_f32):
    fam = tiny_family_f32
    plan, inputs, realized, out = _plan_and_merge(tmp_path, fam, "s", budget="30%", plan={"strategy": "sketch"})
    b = plan["bytes"]
    assert b["planned_sketch_bytes"] > 0 and b["planned_expert_bytes"] > 0
    assert b["planned_expert_bytes"] + b["planned_sketch_bytes"] <= plan["budget_bytes"]
    assert sum(realized.expert_bytes_read.values()) == b["planned_expert_bytes"]
    assert realized.sketch_bytes_read == b["planned_sketch_bytes"]
    merged, base = load_model(out), load_model(fam["root"] / "base")
    experts = {e["name"]: (e, load_model(e["path"])) for e in plan["experts"]}
    sk_blocks = plan["strategy"]["sketch"]["blocks"]
    full_sq, dev_sq = 0.0, 0.0
    for tname in base:
        ranges = inputs.base_index.tensors[tname].ranges
        want, full = base[tname].clone(), base[tname].clone()
        for blk, (r0, r1) in enumerate(ranges):
            b0 = base[tname][r0:r1].float()
            terms, all_terms = [], []
            for name, (e, w) in experts.items():  # plan order = canonical (content hash) order
                d = w[tname][r0:r1].float() - b0
                weight = torch.tensor(e["weight"], dtype=torch.float32)
                if d.abs().sum() > 0:
                    all_terms.append(d * weight)
                if blk in plan["reads"][name].get(tname, []):
                    terms.append(d * weight)
                elif blk in sk_blocks[name].get(tname, []):
                    s = torch.from_numpy(inputs.sketches[name].delta(tname, blk, b0.numel())).reshape(b0.shape)
                    assert torch.equal(torch.sign(s), torch.sign(d))
                    terms.append(s * weight)
            for acc, ts in ((want, terms), (full, all_terms)):
                if ts:
                    total = ts[0]
                    for t in ts[1:]:
                        total = total + t
                    acc[r0:r1] = b0 + total
        assert torch.equal(merged[tname], want), tname
        full_sq += float(((full - base[tname]).double() ** 2).sum())
        dev_sq += float(((merged[tname] - full).double() ** 2).sum())
    # the certified bound holds: ||M_S - M|| <= omitted mass (sketch residuals included)
    assert math.sqrt(dev_sq) <= plan["bound"]["omitted_mass"] * (1 + 1e-4) + 1e-6
    assert plan["bound"]["full_update_norm_estimate"] == pytest.approx(math.sqrt(full_sq), rel=1e-3)


def test_full_budget_is_the_plain_merge_and_the_order_of_experts_does_not_matter(tmp_path, tiny_family):
    def run(name, **over):
        (tmp_path / name).mkdir()
        cfg = write_config(tmp_path / name, tiny_family, cache_dir=str(tmp_path / "cache"), **over)
        assert main(["run", str(cfg), "-q"]) == 0
        return json.loads((tmp_path / name / "out" / "manifest.json").read_text())

    plain = run("plain")
    full = run("full", plan={"strategy": "sketch"})
    assert full["outputs"]["tensors"] == plain["outputs"]["tensors"]
    assert full["bytes"]["sketch_bytes_read"] == 0 and full["plan"]["reads"] == plain["plan"]["reads"]
    a = run("a", plan={"strategy": "sketch"}, budget="20%")
    assert a["bytes"]["sketch_bytes_read"] > 0
    root = tiny_family["root"]
    rev = [{"name": f"e{k}", "path": str(root / f"expert_{k}"), "weight": w}
           for k, w in reversed(list(zip(range(len(tiny_family["experts"])), [1.0, 0.5, 0.7])))]
    b = run("b", plan={"strategy": "sketch"}, budget="20%", experts=rev)
    assert b["outputs"]["tensors"] == a["outputs"]["tensors"] and b["plan_hash"] == a["plan_hash"]
    # verify --replay rebuilds the sketches in a fresh store and gets the same bytes
    assert main(["verify", str(tmp_path / "a" / "out"), "--replay", "-q"]) == 0


def test_damaged_sketches_are_caught_or_rebuilt(tmp_path, tiny_family):
    plan, inputs, _, _ = _plan_and_merge(tmp_path, tiny_family, "s", budget="20%", plan={"strategy": "sketch"})
    name, per = next((n, per) for n, per in plan["strategy"]["sketch"]["blocks"].items() if per)
    tensor, blocks = next(iter(per.items()))
    sk = inputs.sketches[name]
    off = sk.tensors[tensor][blocks[0]][0]
    raw = bytearray(sk.path.read_bytes())
    raw[off] ^= 0x55
    sk.path.write_bytes(bytes(raw))  # the header (and its hash) unchanged: only the codes differ
    out = tmp_path / "again"
    out.mkdir()
    with pytest.raises(IntegrityError, match="do not match their blake3"):
        run_merge(plan, inputs, out)
    # a damaged header: the store is untrusted, so planning makes the sketch again
    sk.path.write_bytes(b"garbage")
    cfg = load_config(tmp_path / "s" / "params.yaml")
    again, inputs2 = plan_config(cfg, Store(cfg.cache_dir))
    assert again.plan_hash == plan["plan_hash"]
    out2 = tmp_path / "again2"
    out2.mkdir()
    run_merge(plan_json(again), inputs2, out2)


def test_edited_sketch_plans_are_refused(tmp_path, tiny_family):
    plan, inputs, _, _ = _plan_and_merge(tmp_path, tiny_family, "s", budget="20%", plan={"strategy": "sketch"})
    name, per = next((n, per) for n, per in plan["strategy"]["sketch"]["blocks"].items() if per)
    tensor, blocks = next(iter(per.items()))

    def edited(edit):
        bad = json.loads(json.dumps(plan))
        edit(bad)
        bad["plan_hash"] = plan_hash(bad)
        return bad

    record_edits = [
        (lambda p: p["reads"][name].__setitem__(tensor, sorted({*p["reads"][name].get(tensor, []), blocks[0]})),
         "both sketched and read"),
        (lambda p: p["bytes"].pop("planned_sketch_bytes"), "planned_sketch_bytes"),
        (lambda p: p["strategy"]["sketch"]["artifacts"].pop(name), "exactly the plan's experts"),
        (lambda p: p["bytes"].__setitem__("planned_sketch_bytes", p["budget_bytes"]), "sum of sketch_by_expert"),
        (lambda p: p["strategy"]["sketch"]["blocks"][name].__setitem__(tensor, [blocks[0], blocks[0]]),
         "sorted and distinct"),
    ]
    for edit, match in record_edits:
        with pytest.raises(ConfigError, match=match) as err:
            validate_plan(edited(edit), "plan.json")
        assert "\n" not in str(err.value)
    # against the indexes: more sketch bytes than recorded, a block outside its tensor
    n_blocks = len(inputs.base_index.tensors[tensor].ranges)
    for edit, match in [
        (lambda p: p["strategy"]["sketch"]["blocks"][name].__setitem__(tensor, [*blocks, n_blocks]), "outside"),
        (lambda p: p["bytes"]["sketch_by_expert"].__setitem__(name, 1), "sketch_by_expert"),
    ]:
        bad = edited(edit)
        with pytest.raises(ConfigError, match=match):
            check_plan_reads(validate_plan(bad, "plan.json"), inputs.base_index, inputs.expert_indexes,
                             inputs.deltas, "plan.json")


def test_methods_without_per_element_deltas_are_refused(tmp_path, tiny_family):
    with pytest.raises(ConfigError, match="does not merge per-element deltas"):
        _plan_and_merge(tmp_path, tiny_family, "t", budget="20%", method="slerp",
                        parameters={"t": 0.5}, plan={"strategy": "sketch"},
                        experts=[{"name": "e0", "path": str(tiny_family["root"] / "expert_0"), "weight": 1.0}])


def test_ties_keeps_a_sketch_untrimmed_and_trims_full_reads(tmp_path, tiny_family):
    """A TIES merge with sketches: the magnitude trim leaves a sketched delta as it is; at full
    budget it is the plain TIES merge."""
    from mergepipe.methods._common import sparsify_magnitude
    from mergepipe.methods.base import BlockInputs, ExpertBlock
    d = torch.tensor([0.5, -0.5, 0.0, 0.5])
    block = BlockInputs("t", 0, 4, (4,), torch.zeros(4), (), 0)
    assert torch.equal(sparsify_magnitude(d, ExpertBlock("e", "h", 1.0, d, density=0.25, sketched=True), block), d)
    kw = dict(method="ties", parameters={"lambda": 1.0, "density": 0.5})
    plan, _, realized, out = _plan_and_merge(tmp_path, tiny_family, "ties", budget="20%",
                                             plan={"strategy": "sketch"}, **kw)
    assert realized.sketch_bytes_read == plan["bytes"]["planned_sketch_bytes"] > 0
    assert plan["bound"]["kind"] == "heuristic"
    _, _, _, eout = _plan_and_merge(tmp_path, tiny_family, "energy", budget="20%", plan={"strategy": "energy"}, **kw)
    a, b = load_model(out), load_model(eout)
    assert not all(torch.equal(a[n], b[n]) for n in a)
    fplan, _, _, fout = _plan_and_merge(tmp_path, tiny_family, "full", plan={"strategy": "sketch"}, **kw)
    _, _, _, pout = _plan_and_merge(tmp_path, tiny_family, "plain", **kw)
    assert fplan["bytes"]["planned_sketch_bytes"] == 0
    a, b = load_model(fout), load_model(pout)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_gc_prunes_sketches_no_kept_plan_names_and_never_a_users_file(tmp_path, tiny_family):
    """gc keeps the sketches a --keep plan or output records (by header hash) and removes the
    rest; a file in sketch/ with a sketch's name but not a sketch's trailer is the user's."""
    cache = tmp_path / "cache"

    def plan(name, block):
        (tmp_path / name).mkdir()
        cfg = write_config(tmp_path / name, tiny_family, cache_dir=str(cache), budget="20%",
                           block_bytes=block, plan={"strategy": "sketch"})
        assert main(["plan", str(cfg), "-o", str(tmp_path / name / "plan.json"), "-q"]) == 0
        return tmp_path / name / "plan.json"

    kept, _ = plan("a", "16KiB"), plan("b", "32KiB")
    folder = cache / "sketch"
    assert len(list(folder.iterdir())) == 6
    lookalike = folder / ("d" * 40 + ".sk")
    lookalike.write_bytes(b"user data")
    assert main(["gc", "--cache-dir", str(cache), "--keep", str(kept), "-q"]) == 0
    want = set(json.loads(kept.read_text())["strategy"]["sketch"]["artifacts"].values())
    left = {p: sketch.header_digest(p) for p in folder.iterdir()}
    assert set(left.values()) == want | {None} and left[lookalike] is None
    assert lookalike.read_bytes() == b"user data"
    assert main(["merge", str(kept), "-o", str(tmp_path / "out"), "--cache-dir", str(cache), "-q"]) == 0


@pytest.mark.parametrize("method,parameters", [("task_arithmetic", {"lambda": 0.7}),
                                               ("ties", {"lambda": 0.9, "density": 0.4}),
                                               ("ties", {"lambda": 1.0, "density": 1.0, "normalize": False})])
def test_bf16_merges_read_sketches_in_the_c_loop_with_the_torch_bytes(tmp_path, tiny_family, monkeypatch,
                                                                      method, parameters):
    """bf16 task arithmetic and TIES merge sketched blocks in the compiled C loops
    (mp_task_arithmetic_sketch_bf16, mp_ties_bf16 with codes), byte for byte as the torch path does."""
    from mergepipe.methods import _compiled
    plan, inputs, realized, out = _plan_and_merge(tmp_path, tiny_family, "c", budget="20%", method=method,
                                                  plan={"strategy": "sketch"}, parameters=parameters)
    assert plan["bytes"]["planned_sketch_bytes"] > 0 and plan["bytes"]["planned_expert_bytes"] > 0
    calls = []
    real = _compiled.CompiledCombine._with_sketches
    monkeypatch.setattr(_compiled.CompiledCombine, "_with_sketches",
                        lambda self, block: calls.append(block.tensor) or real(self, block))
    again = tmp_path / "c" / "again"
    again.mkdir()
    assert run_merge(plan, inputs, again).sketch_bytes_read == plan["bytes"]["planned_sketch_bytes"]
    torch_out = tmp_path / "c" / "torch"
    torch_out.mkdir()
    assert run_merge(plan, inputs, torch_out, compiled=False).sketch_bytes_read == realized.sketch_bytes_read
    if getattr(_compiled.kernels(), "backend", None) == "c":
        assert calls  # the C loop merged sketched blocks
    a, b = load_model(again), load_model(torch_out)
    assert all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_sketch_files_are_the_same_from_the_c_scan_on_two_threads_and_numpy_on_one(tmp_path, tiny_family,
                                                                                   monkeypatch):
    """A sketch file's bytes depend on the inputs only: the C scan on two threads writes the
    numpy scan's file on one thread (blocks are written in the index's order)."""
    from mergepipe.methods import _ckernels
    plan, inputs, _, _ = _plan_and_merge(tmp_path, tiny_family, "s", budget="20%", plan={"strategy": "sketch"})
    files = {name: sk.path.read_bytes() for name, sk in inputs.sketches.items()}
    for sk in inputs.sketches.values():
        sk.close()
        sk.path.unlink()
    monkeypatch.setattr(sketch, "SCAN_THREADS", 1)
    monkeypatch.setattr(sketch, "IN_FLIGHT", 2)
    monkeypatch.setattr(_ckernels, "load", lambda: None)
    cfg = load_config(tmp_path / "s" / "params.yaml")
    again, inputs2 = plan_config(cfg, Store(cfg.cache_dir))
    assert again.plan_hash == plan["plan_hash"]
    assert {name: sk.path.read_bytes() for name, sk in inputs2.sketches.items()} == files


def test_sketch_report_renders_the_committed_results(tmp_path):
    """EVAL.md's sketch section is generated from the committed screen results (no typed numbers)."""
    from pathlib import Path
    from mergepipe_eval import sketch_report as sr
    res = Path(__file__).resolve().parent.parent / "workflows" / "real" / "results"
    smollm = [json.loads((res / f"strategies_smollm_sketch{s}.json").read_text()) for s in ("", "_ties")]
    per_seed = [json.loads((res / f"strategies_minilm_sketch_s{i}.json").read_text()) for i in (0, 1)]
    mean = json.loads((res / "strategies_minilm_sketch_seeds.json").read_text())
    md = tmp_path / "EVAL.md"
    md.write_text("# before\n")
    for _ in range(2):  # a second splice replaces the section
        sr.splice_section(md, sr.render(smollm, per_seed, mean, "notes", "sketch.png"))
    text = md.read_text()
    assert text.startswith("# before\n") and text.count(sr.BEGIN) == 1 and text.count(sr.END) == 1
    assert "| 0 | ta_l1.0 | 25% | sketch |" in text and "![sketch vs energy](sketch.png)" in text
    sr.plot(smollm, mean, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_check_sketch_blocks_counts_bytes_and_refuses_an_identical_or_outside_block():
    """Per expert, the sketch bytes of its sketched blocks; a block identical to the base, or
    past its tensor, is refused naming the plan key (each block of a tensor checked)."""
    from types import SimpleNamespace as NS

    from mergepipe.plan.sketch_reads import check_sketch_blocks
    entry = NS(shape=(8, 4), dtype="BF16", ranges=[(0, 4), (4, 8)])
    indexes = {"e": NS(tensors={"w": entry})}
    deltas = {"e": NS(tensors={"w": NS(identical=[False, False])})}

    def blocks(bs):
        return {"e": {"w": bs}}
    assert check_sketch_blocks(blocks([0, 1]), ["e"], indexes, deltas, "p.json") == {"e": 2 * sketch.sketch_cost(16)}
    deltas["e"].tensors["w"].identical[1] = True
    with pytest.raises(ConfigError, match=r"strategy\.sketch\.blocks\.e\.w: block 1 is identical"):
        check_sketch_blocks(blocks([0, 1]), ["e"], indexes, deltas, "p.json")
    assert check_sketch_blocks(blocks([0, 1]), ["e"], indexes, None, "p.json") == {"e": 2 * sketch.sketch_cost(16)}
    with pytest.raises(ConfigError, match="block 2 is outside tensor 'w'"):
        check_sketch_blocks(blocks([2]), ["e"], indexes, deltas, "p.json")
