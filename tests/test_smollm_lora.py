"""The real-weight LoRA trainer (mergepipe_eval/smollm_lora.py) on a tiny Llama: a seed fixes the
adapter's bytes, the files are PEFT's format with the recipe's rank and targets, and PEFT loads
them back onto the base."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.tiny_llama import tiny_llama

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def material(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast
    root = tiny_llama(tmp_path_factory.mktemp("tiny-lora"))
    tok = PreTrainedTokenizerFast.from_pretrained(root / "base")
    tok.pad_token = "<unk>"  # the word-level tokenizer has none; the trainer pads with it
    tok.save_pretrained(root / "base")
    task = root / "task"
    task.mkdir()
    (task / "task.json").write_text(json.dumps({"task": "noun_cat", "labels": ["cat", "dog"]}))
    rows = [{"text": "the cat sat on a mat", "label": "cat"}, {"text": "a dog ran far away", "label": "dog"},
            {"text": "then the cat slept in sun", "label": "cat"}, {"text": "the dog sat in rain", "label": "dog"}]
    (task / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _train(material: Path, out: Path, seed: int) -> Path:
    from mergepipe_eval.smollm_lora import LoraRecipe, train_adapter
    recipe = LoraRecipe(lr=1e-2, steps=3, batch_size=2, weight_decay=0.01, r=4, lora_alpha=8)
    train_adapter(material / "base", material / "task", out, recipe, seed=seed)
    return out / "adapter"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_seed_fixes_the_adapter_bytes(material, tmp_path):
    first = _files(_train(material, tmp_path / "a", seed=0))
    assert first == _files(_train(material, tmp_path / "b", seed=0))
    other = _files(_train(material, tmp_path / "c", seed=1))
    assert other["adapter_model.safetensors"] != first["adapter_model.safetensors"]
    assert sorted(first) == ["adapter_config.json", "adapter_model.safetensors"]
    info = json.loads((tmp_path / "a" / "train.json").read_text())
    assert info["steps"] == 3 and info["recipe"]["r"] == 4


def test_peft_format_rank_targets_and_trained_factors(material, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from mergepipe_eval.smollm import load_model
    from mergepipe_eval.smollm_lora import TARGETS
    adapter = _train(material, tmp_path / "a", seed=0)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sorted(TARGETS)
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == 2 * len(TARGETS) * 2  # A and B of every target, 2 layers
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert all(t.shape[0] == 4 for k, t in tensors.items() if "lora_A" in k)
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)  # B starts at 0
    model = PeftModel.from_pretrained(load_model(material / "base"), str(adapter))
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert b.detach().equal(tensors[key])
