"""schemas/manifest.schema.json describes the manifests of adapters mergepipe writes (kind
peft-lora-adapter): adapters out (cat, svd, a seeded dare_*_svd) and extract-lora, checked with
jsonschema and json alone, as anyone without mergepipe would; and rejects what they never hold."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from mergepipe.cli import main

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "manifest.schema.json"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-schema")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    for seed, name in ((1, "a"), (2, "b")):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj", "v_proj"])
                            ).save_pretrained(root / name)
    out = {}
    for tag, adapter in (("cat", {"combination": "cat"}), ("svd", {"combination": "svd", "rank": 2}),
                         ("dare", {"combination": "dare_ties_svd", "rank": 2, "density": 0.5})):
        params = {"base": str(root / "base"), "method": "task_arithmetic", "seed": 3,
                  "experts": [{"name": n, "adapter": str(root / n), "weight": w} for n, w in (("a", 1.0), ("b", -0.5))],
                  "output": {"dir": str(root / tag), "adapter": adapter}, "cache_dir": str(root / "cache")}
        (root / f"{tag}.yaml").write_text(yaml.safe_dump(params))
        assert main(["run", "-q", str(root / f"{tag}.yaml")]) == 0
        out[tag] = root / tag
    expert = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    with torch.no_grad():
        expert.model.layers[0].self_attn.q_proj.weight.add_(0.01 * torch.randn(32, 32))
        expert.model.norm.weight.add_(0.01)
    expert.save_pretrained(root / "expert")
    for tag, rule in (("rank", ["--rank", "2"]), ("energy", ["--energy", "0.9"])):
        assert main(["extract-lora", str(root / "expert"), "--base", str(root / "base"), *rule,
                     "-o", str(root / tag), "-q"]) == 0
        out[tag] = root / tag
    return out


def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("tag", ["cat", "svd", "dare", "rank", "energy"])
def test_every_adapter_manifest_validates(outputs, tag):
    man = _manifest(outputs[tag])
    assert man["kind"] == "peft-lora-adapter"
    errors = [e.message for e in _validator().iter_errors(man)]
    assert not errors, errors


def _edits(man: dict) -> list[dict]:
    """Copies of `man`, each with one thing an adapter manifest never holds."""
    def edited(change) -> dict:
        copy = json.loads(json.dumps(man))
        change(copy)
        return copy

    return [
        edited(lambda m: m.pop("kind")),
        edited(lambda m: m.update(kind="model")),
        edited(lambda m: m.update(plan={})),
        edited(lambda m: m["outputs"]["files"].pop("adapter_model.safetensors")),
        edited(lambda m: m["outputs"]["files"].update({"../x.json": {"blake3": "0" * 64}})),
        edited(lambda m: m["outputs"]["tensors"].update({next(iter(m["outputs"]["tensors"])): "not-a-hash"})),
        edited(lambda m: m.update(recipe_hash="0" * 63)),
        edited(lambda m: m["inputs"]["base"].update(tensor_tabel="0" * 64)),
        edited(lambda m: m["recipe"].update(extra=1)),
    ]


@pytest.mark.parametrize("tag", ["dare", "rank"])
def test_the_schema_rejects_what_an_adapter_manifest_never_holds(outputs, tag):
    v = _validator()
    for bad in _edits(_manifest(outputs[tag])):
        assert list(v.iter_errors(bad)), bad


def test_the_recipe_must_be_its_kind_s(outputs):
    """A merged adapter's recipe with an extraction's inputs (or the reverse) is neither kind; a
    combination or sign method mergepipe does not write is refused."""
    v = _validator()
    merged, extracted = _manifest(outputs["dare"]), _manifest(outputs["rank"])
    assert list(v.iter_errors({**merged, "inputs": extracted["inputs"]}))
    assert list(v.iter_errors({**extracted, "inputs": merged["inputs"]}))
    for key, value in (("combination", "linear"), ("majority_sign_method", "sum"), ("density", 0)):
        bad = json.loads(json.dumps(merged))
        bad["recipe"]["adapter"][key] = value
        assert list(v.iter_errors(bad)), (key, value)
    bad = json.loads(json.dumps(merged))
    bad["recipe"]["method"] = "ties"
    assert list(v.iter_errors(bad))
