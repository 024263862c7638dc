"""LoRA adapters (PEFT) of SmolLM2-135M-Instruct for the real-weight tasks (issue 25).

The same task, data, prompts, loss, batches (the seeded permutation of smollm.fit), warmup and
decay as a dense `smollm.train_expert` expert; only the trained parameters differ: a rank-r
LoRA on every attention and MLP linear (`TARGETS`), the base frozen, no dropout (so a seed
fixes every step), AdamW(fused) on the LoRA factors only. The factors' initialisation comes from
torch's global generator, seeded with the training seed just before PEFT wraps the model.

Writes out_dir/adapter/ in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`,
fp32 factors, loadable by `PeftModel.from_pretrained` and as a mergepipe `adapter:` expert) and
out_dir/train.json. Nothing is written anywhere else.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from mergepipe_eval import smollm

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's save_pretrained adds a README.md model card: not part of the adapter
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True, slots=True)
class LoraRecipe:
    lr: float
    steps: int
    batch_size: int
    weight_decay: float
    r: int = 16
    lora_alpha: int = 32
    warmup: float = 0.1
    max_text_tokens: int = 48

    def schedule(self) -> smollm.Recipe:
        """The dense recipe fields fit() reads (steps, batches, warmup)."""
        return smollm.Recipe(lr=self.lr, steps=self.steps, batch_size=self.batch_size,
                             weight_decay=self.weight_decay, warmup=self.warmup,
                             max_text_tokens=self.max_text_tokens)


def wrap(model: nn.Module, recipe: LoraRecipe, *, seed: int) -> nn.Module:
    """model with a LoRA on every TARGETS linear (base frozen); factors initialised from `seed`."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=recipe.r, lora_alpha=recipe.lora_alpha, target_modules=list(TARGETS),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    return get_peft_model(model, config)


def save_adapter(model: nn.Module, out: Path) -> None:
    """PEFT's adapter files in `out` (the model card PEFT adds is removed)."""
    model.save_pretrained(str(out), safe_serialization=True)
    for extra in out.iterdir():
        if extra.name not in ADAPTER_FILES:
            extra.unlink()
    # PEFT keeps target_modules as a set and writes it in hash order (PYTHONHASHSEED): sorted,
    # the file is the same bytes on every run
    path = out / "adapter_config.json"
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def train_adapter(base_dir: Path, task_dir: Path, out_dir: Path, recipe: LoraRecipe, *,
                  seed: int) -> dict:
    """Train one task's LoRA adapter; writes out_dir/adapter/ and out_dir/train.json."""
    smollm.set_threads()
    tokenizer = smollm.load_tokenizer(base_dir)
    model = wrap(smollm.load_model(base_dir), recipe, seed=seed)
    data = smollm.encode(tokenizer, task_dir, "train", max_text_tokens=recipe.max_text_tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95),
                            weight_decay=recipe.weight_decay, fused=True)
    start = time.time()
    losses = smollm.fit(model, opt, data, recipe.schedule(), seed=seed,
                        pad_id=tokenizer.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_adapter(model, out_dir / "adapter")
    info = smollm.train_info(recipe.schedule(), seed, len(data.y), losses, time.time() - start)
    info["recipe"] = asdict(recipe)
    info["trainable_parameters"] = sum(p.numel() for p in params)
    (out_dir / "train.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info
