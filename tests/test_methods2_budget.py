"""passthrough, nearswap, ram, ramplus_tl, della, della_linear and nuslerp (row, flatten and column
modes) through `mergepipe run`.

At full budget the output is the method's plain merge of the whole tensors (run block by block
at the engine's block layout, tests/helpers/cuts.run_method, cast to the output dtype): bit for bit.
At a partial budget the run reads at most the budget, gives the same bytes whatever the expert
order and thread count, and is exactly the merge of what it read: the plain merge with every
(expert, block) the plan left out treated as unread.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.cuts import run_method

from mergepipe.checkpoint.blocks import block_ranges
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, open_checkpoint
from mergepipe.cli import main
from mergepipe.methods import get_method
from mergepipe.methods.joint import JointExpert, TensorContext, in_memory_statistics
from tests.helpers import load_model, write_config

# (id, method, parameters, expert indexes with weights and knobs)
CASES = [
    ("passthrough", "passthrough", {"scale": 0.75}, [(0, {"weight": 1.0})]),
    ("nearswap", "nearswap", {"t": 0.004}, [(1, {"weight": 1.0})]),
    ("ram", "ram", {"epsilon": 1e-3}, [(0, {"weight": 1.0}), (1, {"weight": 1.0}), (2, {"weight": 1.0})]),
    ("ramplus_tl", "ramplus_tl", {"epsilon": 1e-3, "r": 0.5},
     [(0, {"weight": 1.0}), (1, {"weight": 1.0}), (2, {"weight": 1.0})]),
    ("della", "della", {"epsilon": 0.1, "rescale_mode": "keep_probability"},
     [(0, {"weight": 1.0, "density": 0.5}), (1, {"weight": 0.5, "density": 0.3}),
      (2, {"weight": 0.7, "density": 0.6})]),
    ("della_linear", "della_linear", {"epsilon": 0.2, "density": 0.4}, [(0, {"weight": 0.6}), (2, {"weight": 0.9})]),
    ("della_l1", "della", {"epsilon": 0.1, "rescale_mode": "l1"},
     [(0, {"weight": 1.0, "density": 0.5}), (1, {"weight": 0.5, "density": 0.3})]),
    ("nuslerp", "nuslerp", {"nuslerp_flatten": False}, [(0, {"weight": 0.4}), (1, {"weight": 0.8})]),
    ("nuslerp_nobase", "nuslerp", {"nuslerp_flatten": False, "base_weight": 0.3}, [(2, {"weight": 0.9})]),
    ("nuslerp_flat", "nuslerp", {}, [(0, {"weight": 0.4}), (1, {"weight": 0.8})]),
    ("nuslerp_flat_nobase", "nuslerp", {"base_weight": 0.3}, [(2, {"weight": 0.9})]),
    ("nuslerp_column", "nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True},
     [(1, {"weight": 0.5}), (2, {"weight": 0.5})]),
]


def _config(tmp_path: Path, family: dict, method: str, parameters: dict, picks: list, **overrides) -> Path:
    experts = [{"name": f"e{k}", "path": str(family["experts"][k]), **knobs} for k, knobs in picks]
    return write_config(tmp_path, family, method=method, parameters=parameters, experts=experts, **overrides)


def _expected(out: Path, family: dict) -> dict[str, torch.Tensor]:
    """The plain merge of what the manifest's plan read, at its block layout (expert e<k> is
    the family's expert_<k>, as _config names them)."""
    man = json.loads((out / "manifest.json").read_text())
    plan = man["plan"]
    base_dir = Path(family["base"])
    ckpt = open_checkpoint(base_dir)
    base = load_model(base_dir)
    models = {e["name"]: load_model(Path(family["experts"][int(e["name"][1:])])) for e in plan["experts"]}
    out_tensors = {}
    for name, w0 in base.items():
        t = ckpt.tensors[name]
        if t.dtype not in FLOAT_DTYPES:
            out_tensors[name] = w0
            continue
        ranges = block_ranges(tuple(t.shape), t.itemsize, plan["block_bytes"])
        omit = {(e["name"], r0) for e in plan["experts"] for b, (r0, _) in enumerate(ranges)
                if b not in set(plan["reads"][e["name"]].get(name, ()))}
        entries = [{"name": e["name"], "hash": e["content_hash"], "weight": e["weight"],
                    "delta": models[e["name"]][name].float() - w0.float(),
                    **{k: e[k] for k in ("density", "gamma") if e.get(k) is not None}} for e in plan["experts"]]
        merged = run_method(plan["method"], plan["parameters"], w0.float(), entries, tensor=name, seed=plan["seed"],
                            boundaries=[r0 for r0, _ in ranges[1:]], omit=omit,
                            joint=_joint_statistics(plan, name, w0.float(), entries, ranges))
        out_tensors[name] = merged.to(w0.dtype)
    return out_tensors


def _joint_statistics(plan: dict, name: str, base: torch.Tensor, entries: list[dict], ranges):
    """What the engine's joint scan gives a joint method for this tensor: sums over every
    block of every expert (the scan is outside the budget), in block order; None otherwise."""
    method = get_method(plan["method"])
    params = method.params.model_validate(plan["parameters"])
    if method.joint is None or not method.joint.active(params):
        return None
    experts = tuple(JointExpert(e["name"], e["hash"], e["weight"], e.get("density", getattr(params, "density", None)),
                                e.get("gamma")) for e in entries)
    ctx = TensorContext(name, tuple(base.shape), experts, params, plan["seed"])
    return in_memory_statistics(method.joint, ctx, base.numpy(), [e["delta"].numpy() for e in entries],
                                list(ranges))


def _assert_output_is(out: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_model(out)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name].view(torch.int16) if got[name].dtype == torch.bfloat16 else got[name],
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want), name


@pytest.mark.parametrize("cid,method,parameters,picks", CASES, ids=[c[0] for c in CASES])
def test_full_budget_is_the_plain_merge(tmp_path, tiny_family, cid, method, parameters, picks):
    cfg = _config(tmp_path, tiny_family, method, parameters, picks)
    assert main(["run", str(cfg), "-q"]) == 0
    out = tmp_path / "out"
    man = json.loads((out / "manifest.json").read_text())
    assert man["bytes"]["expert_bytes_read"] == man["bytes"]["planned_expert_bytes"] > 0
    assert man["plan"]["parameters"] == get_method(method).params.model_validate(parameters).model_dump(
        mode="json", by_alias=True)
    _assert_output_is(out, _expected(out, tiny_family))


@pytest.mark.parametrize("cid,method,parameters,picks", CASES, ids=[c[0] for c in CASES])
def test_partial_budget_is_sound_deterministic_and_the_merge_of_what_was_read(tmp_path, tiny_family, cid, method,
                                                                             parameters, picks):
    results = []
    for i, (order, threads) in enumerate([(picks, "1"), (picks[::-1], "2")]):
        d = tmp_path / f"r{i}"
        d.mkdir()
        cfg = _config(d, tiny_family, method, parameters, order, budget="35%")
        assert main(["run", str(cfg), "-q", "--threads", threads]) == 0
        man = json.loads((d / "out" / "manifest.json").read_text())
        b = man["bytes"]
        assert 0 < b["expert_bytes_read"] == b["planned_expert_bytes"] <= man["budget"]["bytes"]
        assert b["planned_expert_bytes"] < b["total_expert_bytes"]
        results.append((man["plan_hash"], man["outputs"]))
    assert results[0] == results[1]
    _assert_output_is(tmp_path / "r0" / "out", _expected(tmp_path / "r0" / "out", tiny_family))


def test_passthrough_of_the_base_itself_reads_nothing_and_scales_every_float_tensor(tmp_path, tiny_family):
    """mergekit's one-model passthrough as import-mergekit writes it: the model is base and expert."""
    experts = [{"name": "self", "path": str(tiny_family["base"]), "weight": 1.0}]
    for scale, name in ((None, "plain"), (0.5, "half")):
        d = tmp_path / name
        d.mkdir()
        cfg = write_config(d, tiny_family, method="passthrough", experts=experts,
                           parameters={} if scale is None else {"scale": scale})
        assert main(["run", str(cfg), "-q"]) == 0
        man = json.loads((d / "out" / "manifest.json").read_text())
        assert man["bytes"]["expert_bytes_read"] == 0
        base = load_model(Path(tiny_family["base"]))
        got = load_model(d / "out")
        for tname, w0 in base.items():
            want = w0 if scale is None or not w0.is_floating_point() else (w0.float() * scale).to(w0.dtype)
            assert torch.equal(got[tname], want), tname
        if scale is None:  # nothing read or merged: every byte copied from the base
            assert man["bytes"]["base_bytes_read"] == 0
        else:
            assert man["bytes"]["base_bytes_copied"] == 0



def test_explain_shows_the_method_parameters(tmp_path, tiny_family):
    from mergepipe.commands.explain import explain

    _, method, parameters, picks = next(c for c in CASES if c[0] == "della")
    cfg = _config(tmp_path, tiny_family, method, parameters, picks, budget="50%")
    text = explain(cfg, cache_dir=None)
    line = next(x for x in text.splitlines() if x.startswith("parameters "))
    shown = json.loads(line[len("parameters "):])
    assert shown == get_method(method).params.model_validate(parameters).model_dump(mode="json", by_alias=True)
    assert shown["epsilon"] == 0.1 and shown["rescale"] is True
