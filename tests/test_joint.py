"""Joint statistics end to end (methods/joint.py, engine/stats.py, plan/joint_reads.py):
budgets read each block for all experts or none and stay within the budget; the bytes do
not depend on threads or on the order experts are listed in; at full budget the output is
the method applied to whole tensors (tests/helpers/joint.py, same block layout); the statistics
artifact is reused from the store and rebuilt when damaged; plans that break the contract
are refused; explain says what is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mergepipe.checkpoint.blocks import block_ranges
from mergepipe.cli import main
from mergepipe.commands.explain import explain
from mergepipe.commands.pipeline import open_inputs
from mergepipe.index import joint as artifact
from mergepipe.index.store import Store
from mergepipe.methods import get_method
from mergepipe.methods.joint import JointExpert, TensorContext, in_memory_statistics
from mergepipe.plan.planner import plan_hash
from mergepipe.output.run_record import record_path
from mergepipe.plan.record import validate_plan
from tests.helpers.joint import run_joint
from tests.helpers import load_model, write_config

METHODS = [("model_stock", {}), ("model_stock", {"filter_wise": True}), ("karcher", {}), ("multislerp", {}),
           ("sce", {"select_topk": 0.5})]
IDS = ["model_stock", "model_stock_fw", "karcher", "multislerp", "sce"]


def _run(tmp: Path, family: dict, method: str, params: dict, *, budget: str = "full", threads: int = 2,
         reverse: bool = False, cache: Path | None = None, experts: int | None = None) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg_path = write_config(tmp, family, method=method, parameters=params, budget=budget)
    if reverse or cache is not None or experts is not None:
        cfg = yaml.safe_load(cfg_path.read_text())
        if experts is not None:
            cfg["experts"] = cfg["experts"][:experts]
        if reverse:
            cfg["experts"] = cfg["experts"][::-1]
        if cache is not None:
            cfg["cache_dir"] = str(cache)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["run", str(cfg_path), "-q", "--threads", str(threads)]) == 0
    out = tmp / "out"
    return {"manifest": json.loads((out / "manifest.json").read_text()),
            "run": json.loads(record_path(out).read_text()), "out": out, "config": cfg_path}


def _groups(plan: dict) -> dict[tuple[str, int], set[str]]:
    got: dict[tuple[str, int], set[str]] = {}
    for expert, per in plan["reads"].items():
        for tensor, blocks in per.items():
            for b in blocks:
                got.setdefault((tensor, b), set()).add(expert)
    return got


@pytest.mark.parametrize(("method", "params"), METHODS, ids=IDS)
def test_partial_budget_reads_all_or_none_within_budget_deterministic(tmp_path, tiny_family, method, params):
    a = _run(tmp_path / "a", tiny_family, method, params, budget="30%")
    man = a["manifest"]
    b = man["bytes"]
    assert 0 < b["expert_bytes_read"] == b["planned_expert_bytes"] <= man["budget"]["bytes"] < b["total_expert_bytes"]
    plan = man["plan"]
    assert plan["joint"]["reads"] == "all-or-none"
    assert (plan["joint"]["key"] is None) == bool(params.get("filter_wise"))
    inputs = open_inputs(validate_plan(plan, "manifest"), Store(tmp_path / "a" / "cache"), Path("/"))
    groups = _groups(plan)
    assert groups
    for (tensor, block), readers in groups.items():
        differ = {e["name"] for e in plan["experts"] if not inputs.deltas[e["name"]].tensors[tensor].identical[block]}
        assert readers == differ, (tensor, block)
    # same bytes with one thread and with the experts listed in another order
    c = _run(tmp_path / "c", tiny_family, method, params, budget="30%", threads=1, reverse=True)
    assert c["manifest"]["outputs"] == man["outputs"]
    assert c["manifest"]["plan_hash"] == man["plan_hash"]


def test_arcee_fusion_budget_and_full_merge(tmp_path, tiny_family):
    """One expert: 30% is budget-sound and thread-independent; full is the method on whole tensors."""
    a = _run(tmp_path / "a", tiny_family, "arcee_fusion", {}, budget="30%", experts=1)
    b = a["manifest"]["bytes"]
    assert 0 < b["expert_bytes_read"] == b["planned_expert_bytes"] <= a["manifest"]["budget"]["bytes"]
    c = _run(tmp_path / "c", tiny_family, "arcee_fusion", {}, budget="30%", experts=1, threads=1)
    assert c["manifest"]["outputs"] == a["manifest"]["outputs"]
    _assert_full_is_whole_tensor(tmp_path / "full", tiny_family, "arcee_fusion", {}, experts=1)


@pytest.mark.parametrize(("method", "params"), METHODS, ids=IDS)
def test_full_budget_is_the_method_on_whole_tensors(tmp_path, tiny_family, method, params):
    _assert_full_is_whole_tensor(tmp_path, tiny_family, method, params)


def _assert_full_is_whole_tensor(tmp_path: Path, tiny_family: dict, method: str, params: dict,
                                 experts: int | None = None) -> None:
    r = _run(tmp_path, tiny_family, method, params, experts=experts)
    plan = r["manifest"]["plan"]
    assert r["manifest"]["bytes"]["planned_expert_bytes"] == plan["bytes"]["full_read_expert_bytes"]
    out = load_model(r["out"])
    base = load_model(Path(tiny_family["root"]) / "base")
    experts = {e["name"]: load_model(Path(e["path"])) for e in plan["experts"]}
    block_bytes = plan["block_bytes"]
    for name, w0 in base.items():
        if not w0.is_floating_point():
            continue
        b32 = w0.float()
        ranges = block_ranges(tuple(w0.shape), w0.element_size(), block_bytes)
        bounds = [r0 for r0, _ in ranges[1:]]
        ex = [{"name": e["name"], "hash": e["content_hash"], "weight": e["weight"],
               "delta": experts[e["name"]][name].float() - b32} for e in plan["experts"]]
        want = run_joint(method, params, b32, ex, boundaries=bounds, tensor=name).to(w0.dtype)
        assert torch.equal(out[name], want), name


def test_statistics_artifact_is_reused_and_rebuilt_when_damaged(tmp_path, tiny_family):
    cache = tmp_path / "cache"
    first = _run(tmp_path / "a", tiny_family, "model_stock", {}, cache=cache)
    stats = first["run"]["joint_statistics"]
    assert stats["key"] == first["manifest"]["plan"]["joint"]["key"] and stats["bytes_read"] > 0
    path = cache / "joint" / f"{stats['key']}.stats"
    data = path.read_bytes()
    assert stats["blake3"] == __import__("blake3").blake3(data).hexdigest()
    shutil.rmtree(cache / "merges")  # force a real merge of the same plan
    again = _run(tmp_path / "b", tiny_family, "model_stock", {}, cache=cache)
    assert again["run"]["joint_statistics"] == {**stats, "bytes_read": 0}  # loaded, not scanned
    assert again["manifest"]["outputs"] == first["manifest"]["outputs"]
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    shutil.rmtree(cache / "merges")
    rebuilt = _run(tmp_path / "c", tiny_family, "model_stock", {}, cache=cache)
    assert rebuilt["run"]["joint_statistics"]["bytes_read"] > 0
    assert rebuilt["manifest"]["outputs"] == first["manifest"]["outputs"]
    assert path.read_bytes() == data


def test_scan_equals_statistics_of_the_blocks_in_memory(tmp_path, tiny_family):
    """The engine's scan (reader window, block by block) computes what the definition
    (`in_memory_statistics` over the same blocks) does, bit for bit."""
    r = _run(tmp_path, tiny_family, "karcher", {})
    plan = r["manifest"]["plan"]
    _, _, stored = artifact.decode((tmp_path / "cache" / "joint" / f"{plan['joint']['key']}.stats").read_bytes())
    base = load_model(Path(tiny_family["root"]) / "base")
    experts = [load_model(Path(e["path"])) for e in plan["experts"]]
    m = get_method("karcher")
    p = m.params.model_validate(plan["parameters"])
    jexperts = tuple(JointExpert(e["name"], e["content_hash"], e["weight"]) for e in plan["experts"])
    for name, w0 in base.items():
        if not w0.is_floating_point():
            continue
        ranges = block_ranges(tuple(w0.shape), w0.element_size(), plan["block_bytes"])
        b32 = w0.float()
        want = in_memory_statistics(m.joint, TensorContext(name, tuple(w0.shape), jexperts, p), b32.numpy(),
                                    [(e[name].float() - b32).numpy() for e in experts], ranges)
        assert np.array_equal(np.frombuffer(stored[name], dtype=np.float64), want), name


def test_hand_edited_plans_are_refused(tmp_path, tiny_family):
    cfg = write_config(tmp_path, tiny_family, method="multislerp", parameters={}, budget="40%")
    assert main(["plan", str(cfg), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    cache = str(tmp_path / "cache")

    def merge(edited: dict, name: str) -> int:
        edited["plan_hash"] = plan_hash(edited)
        (tmp_path / f"{name}.json").write_text(json.dumps(edited))
        return main(["merge", str(tmp_path / f"{name}.json"), "-o", str(tmp_path / name), "--cache-dir", cache, "-q"])

    # one expert drops a block the others read: no longer all-or-none
    partial = json.loads(json.dumps(plan))
    (tensor, dropped), readers = next((g, r) for g, r in sorted(_groups(plan).items()) if len(r) > 1)
    expert = sorted(readers)[0]
    partial["reads"][expert][tensor].remove(dropped)
    if not partial["reads"][expert][tensor]:
        del partial["reads"][expert][tensor]
    cost = _block_cost(tiny_family, tensor, dropped, plan["block_bytes"])
    partial["bytes"]["planned_by_expert"][expert] -= cost
    partial["bytes"]["planned_expert_bytes"] -= cost
    partial["bytes"]["planned_pairs"] -= 1
    assert merge(partial, "partial") == 2
    wrong_key = json.loads(json.dumps(plan))
    wrong_key["joint"]["key"] = "0" * 64
    assert merge(wrong_key, "wrong_key") == 2
    assert not (tmp_path / "partial").exists() and not (tmp_path / "wrong_key").exists()
    assert merge(json.loads(json.dumps(plan)), "ok") == 0


def _block_cost(family: dict, tensor: str, block: int, block_bytes: int) -> int:
    w = load_model(Path(family["root"]) / "base")[tensor]
    r0, r1 = block_ranges(tuple(w.shape), w.element_size(), block_bytes)[block]
    row = w[0].numel() * w.element_size() if w.dim() >= 1 else w.element_size()
    return (r1 - r0) * (row if w.dim() >= 2 else w.element_size())


def test_per_expert_strategies_are_refused(tmp_path, tiny_family, capsys):
    cfg = write_config(tmp_path, tiny_family, method="model_stock", parameters={}, budget="40%",
                       plan={"strategy": "balanced"})
    assert main(["plan", str(cfg), "-q"]) == 2
    assert "all experts or none" in capsys.readouterr().err


def test_explain_shows_all_or_none_reads(tmp_path, tiny_family):
    cfg = write_config(tmp_path, tiny_family, method="karcher", parameters={"max_iter": 5}, budget="25%")
    text = explain(cfg, cache_dir=None)
    assert text.count("read for all experts or for none") == 1 and text.count("joint statistics ") == 1


def test_artifact_format_rejects_damage():
    data = artifact.encode("k" * 64, "karcher", {"a": np.arange(3.0).tobytes(), "b": b""})
    key, method, arrays = artifact.decode(data)
    assert (key, method, list(arrays)) == ("k" * 64, "karcher", ["a", "b"])
    assert list(arrays["a"]) == [0.0, 1.0, 2.0]
    for bad in (data[:-1], data[:20], b"X" + data[1:], data[:40] + b"\x01" + data[41:]):
        with pytest.raises(artifact.JointFormatError):
            artifact.decode(bad)


def test_mergekit_configs_of_the_joint_methods_import(tmp_path, tiny_family):
    from mergepipe.config.mergekit import import_mergekit
    root = Path(tiny_family["root"])
    models = [str(root / f"expert_{k}") for k in range(3)]

    def imported(doc: dict) -> dict:
        path = tmp_path / "mk.yaml"
        path.write_text(yaml.safe_dump(doc))
        return import_mergekit(path)

    ms = imported({"merge_method": "model_stock", "base_model": str(root / "base"),
                   "parameters": {"filter_wise": True}, "models": [{"model": m} for m in models]})
    assert ms["method"] == "model_stock" and ms["parameters"]["filter_wise"] is True
    assert [e["weight"] for e in ms["experts"]] == [1.0, 1.0, 1.0]
    # karcher without base_model: the first model is the base and one of the averaged inputs
    k = imported({"merge_method": "karcher", "parameters": {"max_iter": 4},
                  "models": [{"model": str(root / "base")}] + [{"model": m} for m in models]})
    assert k["method"] == "karcher" and k["base"] == str(root / "base") and len(k["experts"]) == 3
    assert k["parameters"].get("include_base", True) is True and k["parameters"]["max_iter"] == 4
    msl = imported({"merge_method": "multislerp", "base_model": str(root / "base"),
                    "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, (0.2, 0.3, 0.5))]})
    assert msl["method"] == "multislerp" and [e["weight"] for e in msl["experts"]] == [0.2, 0.3, 0.5]
    sce = imported({"merge_method": "sce", "base_model": str(root / "base"), "parameters": {"select_topk": 0.4},
                    "models": [{"model": m} for m in models]})
    assert sce["method"] == "sce" and sce["parameters"]["select_topk"] == 0.4
    fusion = imported({"merge_method": "arcee_fusion", "base_model": str(root / "base"),
                       "models": [{"model": models[0]}]})
    assert fusion["method"] == "arcee_fusion" and len(fusion["experts"]) == 1


def test_per_tensor_values_that_change_the_statistics_are_refused(tmp_path, tiny_family, capsys):
    cfg = write_config(tmp_path, tiny_family, method="sce", parameters={"select_topk": [0.2, 0.6]})
    assert main(["plan", str(cfg), "-q"]) == 2
    assert "cannot vary per tensor" in capsys.readouterr().err
    cfg = write_config(tmp_path, tiny_family, method="model_stock",
                       parameters={"filter_wise": [{"filter": "mlp", "value": True}, {"value": False}]})
    assert main(["plan", str(cfg), "-q"]) == 2
    assert "some tensors and not others" in capsys.readouterr().err
    # what only changes each block's arithmetic may vary: multislerp's per-tensor weights
    experts = yaml.safe_load(write_config(tmp_path, tiny_family).read_text())["experts"]
    experts[0]["weight"] = [{"filter": "mlp", "value": 0.2}, {"value": 0.9}]
    cfg = write_config(tmp_path, tiny_family, method="multislerp", parameters={}, experts=experts)
    assert main(["run", str(cfg), "-q"]) == 0


def test_split_merge_scans_its_own_tensors_and_gives_the_same_bytes(tmp_path, tiny_family):
    """merge --part I/N of a joint plan (fresh cache): each part scans only the tensors it
    merges and stores no artifact (it is not the family's); gather equals one job."""
    cfg = write_config(tmp_path, tiny_family, method="sce", parameters={"select_topk": 0.4}, budget="50%")
    plan_file = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan_file)]) == 0
    parts_cache = ["--cache-dir", str(tmp_path / "parts-cache")]
    for i in (1, 2):
        assert main(["merge", str(plan_file), "-q", "--part", f"{i}/2", "-o", str(tmp_path / "parts"),
                     *parts_cache]) == 0
    assert not (tmp_path / "parts-cache" / "joint").exists()
    assert main(["gather", str(plan_file), str(tmp_path / "parts"), "--parts", "2", "-o", str(tmp_path / "two"),
                 *parts_cache]) == 0
    assert main(["merge", str(plan_file), "-q", "-o", str(tmp_path / "one"), "--cache-dir",
                 str(tmp_path / "one-cache")]) == 0
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert one["outputs"] == two["outputs"] and one["manifest_hash"] == two["manifest_hash"]
    assert list((tmp_path / "one-cache" / "joint").iterdir())
    assert main(["verify", str(tmp_path / "one"), "--replay", "-q"]) == 0
