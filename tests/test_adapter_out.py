"""Adapters out (output.adapter; commands/adapter_run.py): LoRA experts combined into one PEFT
adapter, against PEFT's add_weighted_adapter (cat bit for bit after merging, svd by its
truncation error) and mergepipe's own full merge of the same adapters; the svd's reported errors
against an independent computation; negative weights; determinism; verify; refusals."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.cli import main
from mergepipe.config.params import load_config
from tests.helpers.equivalence import EPS32, RESIDUE_ULPS
from tests.helpers import fails_in_one_line, load_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
PREFIX = "base_model.model."


def _config():
    return transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                    attention_bias=True, max_position_embeddings=64)


def _model(folder: Path):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _adapter(base: Path, out: Path, *, seed: int, **lora) -> Path:
    torch.manual_seed(seed)
    model = peft.get_peft_model(_model(base), peft.LoraConfig(init_lora_weights=False, **lora))
    if lora.get("lora_bias") or lora.get("modules_to_save"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "modules_to_save" in name or name.endswith("lora_B.default.bias"):
                    p.add_(0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters-out")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).save_pretrained(root / "base")
    base = root / "base"
    qv = ["q_proj", "v_proj"]
    return {
        "root": root, "base": base,
        "a": _adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=qv),
        "b": _adapter(base, root / "b", seed=2, r=4, lora_alpha=16, target_modules=qv),
        "wide": _adapter(base, root / "wide", seed=3, r=8, lora_alpha=16, use_rslora=True,
                         target_modules=["q_proj", "o_proj", "embed_tokens", "up_proj"],
                         rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"o_proj": 3}),
        "bias": _adapter(base, root / "bias", seed=4, r=4, lora_alpha=8, target_modules=qv, lora_bias=True),
        "saved": _adapter(base, root / "saved", seed=5, r=4, lora_alpha=8, target_modules=qv,
                          modules_to_save=["lm_head"]),
    }


def _params(tmp_path: Path, fam: dict, weights: dict[str, float], *, tag: str = "out", method="task_arithmetic",
            adapter: dict | None = None, **extra) -> Path:
    cfg = {"base": str(fam["base"]), "method": method,
           "experts": [{"name": n, "adapter": str(fam[n]), "weight": w} for n, w in weights.items()],
           "output": {"dir": str(tmp_path / tag), **({} if adapter is None else {"adapter": adapter})},
           "cache_dir": str(tmp_path / "cache"), **extra}
    path = tmp_path / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _run(tmp_path: Path, fam: dict, weights: dict[str, float], *, tag: str = "out", **kw) -> Path:
    kw.setdefault("adapter", {"combination": "cat"})
    assert main(["run", "-q", str(_params(tmp_path, fam, weights, tag=tag, **kw))]) == 0
    return tmp_path / tag


def _report(out: Path) -> dict:
    return json.loads((out / "adapter_report.json").read_text())


def _merged(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    model = peft.PeftModel.from_pretrained(_model(base), adapter).merge_and_unload()
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def _peft_combined(fam: dict, order: list[str], weights: list[float], combination: str, **kw):
    """PEFT's add_weighted_adapter of the adapters in `order`: (the PeftModel, its merged state dict)."""
    model = peft.PeftModel.from_pretrained(_model(fam["base"]), fam[order[0]], adapter_name=order[0])
    for name in order[1:]:
        model.load_adapter(fam[name], adapter_name=name)
    model.add_weighted_adapter(order, weights, "combined", combination_type=combination, **kw)
    model.set_adapter("combined")
    factors = {k: v.detach().clone() for k, v in model.state_dict().items() if ".combined" in k}
    merged = model.merge_and_unload(adapter_names=["combined"])
    return factors, {k: v.detach().contiguous() for k, v in merged.state_dict().items()}


def _exact_deltas(fam: dict, weights: dict[str, float], lam: float = 1.0, *,
                  magnitudes: bool = False) -> dict[str, torch.Tensor]:
    """Σ_k c_k s_k B_k A_k per target weight, in fp64 from the adapters' files (PEFT's layouts);
    `magnitudes`: Σ_k |c_k s_k| |B_k| |A_k| instead (a bound on the terms rounded into each element)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        config = json.loads((fam[name] / "adapter_config.json").read_text())
        tensors = load_file(fam[name] / "adapter_model.safetensors")
        for key, a in tensors.items():
            for a_part, b_part, transposed in ((".lora_A.weight", ".lora_B.weight", False),
                                               (".lora_embedding_A", ".lora_embedding_B", True)):
                if not key.endswith(a_part):
                    continue
                module = key[len(PREFIX):-len(a_part)]
                r = next((v for k, v in config["rank_pattern"].items() if module.endswith(k)), config["r"])
                alpha = next((v for k, v in config["alpha_pattern"].items() if module.endswith(k)),
                             config["lora_alpha"])
                scale = alpha / (r ** 0.5 if config["use_rslora"] else r)
                b = tensors[key[:-len(a_part)] + b_part].double()
                delta = (abs(lam * w * scale) * (b.abs() @ a.double().abs()) if magnitudes
                         else lam * w * scale * (b @ a.double()))
                delta = delta.T if transposed else delta
                out[f"{module}.weight"] = out.get(f"{module}.weight", 0) + delta
    return out


def test_cat_is_peft_s_cat_bit_for_bit_after_merging_negative_weights_included(fam, tmp_path):
    weights = {"a": 0.7, "b": -1.3}
    out = _run(tmp_path, fam, weights)
    order = _report(out)["experts"]
    factors, theirs = _peft_combined(fam, order, [weights[n] for n in order], "cat")
    ours_factors = load_file(out / "adapter_model.safetensors")
    assert len(ours_factors) == 8
    for key, tensor in ours_factors.items():  # the same factors: PEFT folds c·s into A in the same order
        peft_key = key.replace(".lora_A.weight", ".lora_A.combined.weight").replace(".lora_B.weight",
                                                                                     ".lora_B.combined.weight")
        assert torch.equal(tensor, factors[peft_key]), key
    ours = _merged(fam["base"], out)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    exact = _exact_deltas(fam, weights)
    base = load_model(fam["base"])
    for name, delta in exact.items():  # and the sign: a negative weight subtracts (PEFT #3004)
        assert torch.allclose(ours[name].double() - base[name].double(), delta, atol=1e-5), name


def test_cat_equals_mergepipe_s_full_merge_of_the_same_adapters(fam, tmp_path):
    weights = {"a": 1.0, "wide": -0.5}
    out = _run(tmp_path, fam, weights, parameters={"lambda": 0.8})
    assert main(["run", "-q", str(_params(tmp_path, fam, weights, tag="model", parameters={"lambda": 0.8}))]) == 0
    model = load_model(tmp_path / "model")
    ours = _merged(fam["base"], out)
    base = load_model(fam["base"])
    exact = _exact_deltas(fam, weights, lam=0.8, magnitudes=True)
    assert exact.keys() >= {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"}
    for name, tensor in model.items():
        if name not in exact:
            assert torch.equal(ours[name], tensor), name
            continue
        mags = base[name].double().abs() + exact[name]  # the magnitudes rounded into each element, both sides
        assert ((ours[name].double() - tensor.double()).abs() <= RESIDUE_ULPS * EPS32 * mags + 1e-12).all(), name


def test_modules_of_only_some_adapters_get_only_their_ranks(fam, tmp_path):
    out = _run(tmp_path, fam, {"a": 1.0, "wide": 1.0})
    config = json.loads((out / "adapter_config.json").read_text())
    ranks = _report(out)["modules"]
    assert ranks["model.layers.0.self_attn.q_proj"]["rank"] == 4 + 8
    assert ranks["model.layers.1.self_attn.q_proj"]["rank"] == 4 + 2  # wide's rank_pattern
    assert ranks["model.layers.0.self_attn.v_proj"]["rank"] == 4  # a's only
    assert ranks["model.layers.0.mlp.up_proj"]["rank"] == 8  # wide's only
    assert config["lora_alpha"] == config["r"] and config["alpha_pattern"] == config["rank_pattern"]
    assert config["use_rslora"] is False
    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors[f"{PREFIX}model.layers.0.self_attn.v_proj.lora_A.weight"].shape == (4, 32)
    assert tensors[f"{PREFIX}model.embed_tokens.lora_embedding_A"].shape == (8, 40)
    peft_model = peft.PeftModel.from_pretrained(_model(fam["base"]), out)  # PEFT reads every rank as written
    layer = peft_model.base_model.model.model.layers[0].self_attn.v_proj
    assert layer.r["default"] == 4 and layer.scaling["default"] == 1.0


@pytest.mark.parametrize("rank", [2, 6])
def test_svd_reports_the_truncation_error_peft_s_svd_has(fam, tmp_path, rank, capsys):
    weights = {"a": 0.6, "b": -0.9}
    path = _params(tmp_path, fam, weights, adapter={"combination": "svd", "rank": rank})
    capsys.readouterr()
    assert main(["run", str(path)]) == 0
    out = tmp_path / "out"
    report = _report(out)["modules"]
    err = capsys.readouterr().err
    for module, m in report.items():  # on stderr too, one line per module
        assert f"  {module}: rank {rank}, relative error {m['relative_error']:.3e}" in err
    tensors = load_file(out / "adapter_model.safetensors")
    exact = _exact_deltas(fam, weights)
    order = _report(out)["experts"]
    factors, _ = _peft_combined(fam, order, [weights[n] for n in order], "svd", svd_rank=rank)
    for name, delta in exact.items():
        module = name[:-len(".weight")]
        a = tensors[f"{PREFIX}{module}.lora_A.weight"].double()
        b = tensors[f"{PREFIX}{module}.lora_B.weight"].double()
        error = float((delta - b @ a).norm() / delta.norm())
        sigma = torch.linalg.svdvals(delta)
        optimal = float(sigma[rank:].norm() / sigma.norm())
        assert report[module]["relative_error"] == pytest.approx(optimal, rel=1e-9, abs=1e-12)
        assert error == pytest.approx(optimal, rel=1e-4, abs=1e-6)  # the factors, rounded to fp32
        pa = factors[f"{PREFIX}{module}.lora_A.combined.weight"].double()
        pb = factors[f"{PREFIX}{module}.lora_B.combined.weight"].double()
        assert float((delta - pb @ pa).norm() / delta.norm()) == pytest.approx(error, rel=1e-4, abs=1e-6)
        assert report[module]["rank"] == rank
    assert all(v["relative_error"] > 0 for v in report.values()) == (rank < 8)


def test_the_same_recipe_writes_the_same_bytes_in_any_order_and_thread_count(fam, tmp_path):
    def files(out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    svd = {"combination": "svd", "rank": 5}
    first = files(_run(tmp_path, fam, {"a": 0.5, "wide": 1.5}, tag="one", adapter=svd))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        second = files(_run(tmp_path, fam, {"wide": 1.5, "a": 0.5}, tag="two", adapter=svd))
    finally:
        torch.set_num_threads(threads)
    assert first == second


def test_the_output_verifies_is_up_to_date_and_names_a_damaged_tensor(fam, tmp_path, capsys):
    out = _run(tmp_path, fam, {"a": 1.0, "b": 1.0})
    assert main(["verify", str(out), "--deep"]) == 0
    stamp = os.stat(out / "adapter_model.safetensors").st_mtime_ns
    capsys.readouterr()
    assert main(["run", str(tmp_path / "out.yaml")]) == 0
    assert "up to date" in capsys.readouterr().err
    assert os.stat(out / "adapter_model.safetensors").st_mtime_ns == stamp
    data = bytearray((out / "adapter_model.safetensors").read_bytes())
    data[-3] ^= 1
    (out / "adapter_model.safetensors").write_bytes(data)
    assert main(["verify", str(out), "--deep"]) == 6
    assert "lora_B.weight" in capsys.readouterr().err


def test_the_standalone_checker_reads_an_adapter_manifest(fam, tmp_path):
    import subprocess
    import sys
    script = Path(__file__).resolve().parent.parent / "scripts" / "check_manifest.py"
    out = _run(tmp_path, fam, {"a": 1.0, "wide": 0.5})
    ok = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert ok.returncode == 0 and "OK (3 files, 18 tensors" in ok.stdout, ok.stderr
    data = bytearray((out / "adapter_model.safetensors").read_bytes())
    data[-3] ^= 1
    (out / "adapter_model.safetensors").write_bytes(data)
    bad = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert bad.returncode == 1 and "lora_B.weight' does not match" in bad.stderr, bad.stderr


@pytest.mark.parametrize("weights, kw, fragments", [
    ({"a": 1.0}, {"method": "ties"}, ["method 'ties' is not linear", "task_arithmetic"]),
    ({"a": 1.0}, {"budget": "50%"}, ["budget 50%", "budget: full"]),
    ({"a": 0.5, "b": 0.7}, {"method": "linear", "parameters": {"normalize": False}}, ["linear", "not 1"]),
    ({"a": 1.0}, {"adapter": {"combination": "svd"}}, ["needs a rank"]),
    ({"a": 1.0}, {"adapter": {"combination": "cat", "rank": 4}}, ["rank is for combination svd"]),
    ({"bias": 1.0}, {}, ["lora_B.bias", "q_proj"]),
    ({"saved": 1.0}, {}, ["lm_head", "modules_to_save"]),
    ({"a": 1.0}, {"plan": {"strategy": "energy"}}, ["plan"]),
])
def test_what_cannot_be_one_adapter_is_refused_in_one_line(fam, tmp_path, capsys, weights, kw, fragments):
    kw.setdefault("adapter", {"combination": "cat"})
    fails_in_one_line(capsys, ["run", str(_params(tmp_path, fam, weights, **kw))], 2, *fragments)
    assert not (tmp_path / "out").exists()


def test_a_dense_expert_and_plan_are_refused(fam, tmp_path, capsys):
    path = _params(tmp_path, fam, {"a": 1.0}, adapter={"combination": "cat"})
    cfg = yaml.safe_load(path.read_text())
    cfg["experts"].append({"name": "dense", "path": str(fam["base"]), "weight": 1.0})
    path.write_text(yaml.safe_dump(cfg))
    fails_in_one_line(capsys, ["run", str(path)], 2, "'dense' is a model folder")
    fails_in_one_line(capsys, ["plan", str(_params(tmp_path, fam, {"a": 1.0}, adapter={}))], 2, "has no plan")


def test_the_config_key_is_normalized_only_when_set(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"base": "b", "method": "task_arithmetic",
                                    "experts": [{"name": "x", "adapter": "x", "weight": 1}]}))
    assert "adapter" not in load_config(path).normalized()["output"]
    cfg = yaml.safe_load(path.read_text())
    cfg["output"] = {"adapter": {"combination": "svd", "rank": 3}}
    path.write_text(yaml.safe_dump(cfg))
    assert load_config(path).normalized()["output"]["adapter"] == {"combination": "svd", "rank": 3}


def test_verify_inputs_and_replay_rehash_the_adapters_and_rebuild(fam, tmp_path, capsys):
    import shutil
    mine = dict(fam, a=tmp_path / "a-copy")
    shutil.copytree(fam["a"], mine["a"])
    out = _run(tmp_path, mine, {"a": 1.0, "b": -0.25}, adapter={"combination": "svd", "rank": 3})
    capsys.readouterr()
    assert main(["verify", str(out), "--inputs", "--replay"]) == 0
    assert "replay identical" in capsys.readouterr().out
    weights = mine["a"] / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(data)
    fails_in_one_line(capsys, ["verify", str(out), "--inputs"], 6,
                      "a-copy/adapter_model.safetensors", "recorded adapter file")


def test_the_output_adapter_is_an_adapter_expert_giving_the_same_merge(fam, tmp_path):
    weights = {"a": 1.0, "wide": -0.5}
    out = _run(tmp_path, fam, weights)
    assert main(["run", "-q", str(_params(tmp_path, fam, weights, tag="model"))]) == 0
    again = dict(fam, combined=out)
    assert main(["run", "-q", str(_params(tmp_path, again, {"combined": 1.0}, tag="again"))]) == 0
    model, base = load_model(tmp_path / "model"), load_model(fam["base"])
    exact = _exact_deltas(fam, weights, magnitudes=True)
    for name, tensor in load_model(tmp_path / "again").items():
        mags = base[name].double().abs() + exact.get(name, 0)
        assert ((tensor.double() - model[name].double()).abs() <= RESIDUE_ULPS * EPS32 * mags).all(), name


def test_check_runs_the_adapter_checks_and_plan_readers_refuse_an_adapter_output(fam, tmp_path, capsys):
    good = _params(tmp_path, fam, {"a": 1.0}, adapter={"combination": "cat"})
    capsys.readouterr()
    assert main(["check", str(good)]) == 0
    assert "output.adapter: cat of 1 adapter(s)" in capsys.readouterr().out
    bad = _params(tmp_path, fam, {"a": 1.0}, tag="ties", method="ties", adapter={"combination": "cat"})
    assert main(["check", str(bad)]) == 2
    assert "method 'ties' is not linear" in capsys.readouterr().out
    out = _run(tmp_path, fam, {"a": 1.0})
    for argv in (["explain", str(out)], ["audit", str(out)], ["provenance", str(out), "-o", str(tmp_path / "p.json")]):
        fails_in_one_line(capsys, argv, 2, "an adapter output", "has no plan", argv[0])
