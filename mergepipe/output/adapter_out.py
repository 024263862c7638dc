"""The files of an adapter output (docs/design.md, "Adapters out"): a PEFT LoRA adapter
folder (adapter_config.json, adapter_model.safetensors) that PeftModel.from_pretrained loads
on the base, its report (adapter_report.json: rank and truncation error per module) and its
manifest (manifest.json, written last; `mergepipe verify` checks it as any manifest).

Everything is written into the publisher's temp folder (output/publish.py), with bytes that
follow from the combined modules and the recipe only: sorted keys, no timestamps, no host.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from blake3 import blake3

from mergepipe.checkpoint.lora import ADAPTER_WEIGHTS, PREFIX
from mergepipe.checkpoint.lora_combine import Combined
from mergepipe.checkpoint.lora_config import ADAPTER_CONFIG
from mergepipe.checkpoint.safetensors import OutTensor, SafetensorsWriter, tensor_bytes
from mergepipe.output.manifest import MANIFEST, MANIFEST_SCHEMA, manifest_hash, versions, write_manifest
from mergepipe.util.canonical import canonical_blake3
from mergepipe.util.fs import canonical_json, hash_file

if TYPE_CHECKING:
    import torch

ADAPTER_REPORT = "adapter_report.json"
ADAPTER_KIND = "peft-lora-adapter"  # manifest `kind`; a model output's manifest has no `kind`
ADAPTER_OUTPUT_FORMAT = 1  # bump when the same recipe and inputs would write other bytes
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True, slots=True)
class OutModule:
    name: str
    combined: Combined
    embedding: bool


def tensor_names(m: OutModule) -> tuple[str, str]:
    """PEFT's saved keys of the module's A and B (the adapter name removed, as save_pretrained does)."""
    if m.embedding:
        return f"{PREFIX}{m.name}.lora_embedding_A", f"{PREFIX}{m.name}.lora_embedding_B"
    return f"{PREFIX}{m.name}.lora_A.weight", f"{PREFIX}{m.name}.lora_B.weight"


def adapter_config(modules: list[OutModule], *, fan_in_fan_out: bool, base_model: str | None,
                   task_type: str | None) -> dict:
    """`scale_one_config` of the modules' ranks."""
    return scale_one_config({m.name: m.combined.rank for m in modules}, fan_in_fan_out=fan_in_fan_out,
                            base_model=base_model, task_type=task_type)


def scale_one_config(ranks: dict[str, int], *, fan_in_fan_out: bool, base_model: str | None,
                     task_type: str | None) -> dict:
    """A LoraConfig of modules (full names) -> rank whose every module's scale is 1: lora_alpha = r,
    and each module whose rank is not r in rank_pattern and alpha_pattern (keys: the module's name
    as a regular expression matching only it, PEFT's pattern rule), no rsLoRA."""
    counts = Counter(ranks.values())
    r = max(counts, key=lambda k: (counts[k], k))  # the most common rank; ties: the larger
    pattern = {re.escape(name): rank for name, rank in sorted(ranks.items()) if rank != r}
    return {
        "peft_type": "LORA", "r": r, "lora_alpha": r, "rank_pattern": pattern, "alpha_pattern": dict(pattern),
        "target_modules": sorted(ranks), "use_rslora": False, "use_dora": False, "fan_in_fan_out": fan_in_fan_out,
        "bias": "none", "lora_bias": False, "lora_dropout": 0.0, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base_model,
        "task_type": task_type,
    }


def write_adapter(folder: Path, modules: list[OutModule], config: dict, *, dtype: str | None) -> tuple[dict, dict]:
    """adapter_model.safetensors (modules in name order, A then B; `dtype` null: fp32) and
    adapter_config.json in `folder`. Returns (file records, tensor name -> blake3 of its bytes)."""
    import torch
    out_dtype = _DTYPES[dtype or "float32"]
    torch_dtype = getattr(torch, dtype or "float32")
    tensors: dict[str, torch.Tensor] = {}
    for m in sorted(modules, key=lambda m: m.name):
        a_name, b_name = tensor_names(m)
        tensors[a_name] = m.combined.a.to(torch_dtype).contiguous()
        tensors[b_name] = m.combined.b.to(torch_dtype).contiguous()
    writer = SafetensorsWriter(folder / ADAPTER_WEIGHTS,
                               [OutTensor(n, out_dtype, tuple(t.shape)) for n, t in tensors.items()],
                               metadata={"format": "pt"})
    hashes = {}
    try:
        for name, t in tensors.items():
            data = tensor_bytes(t)
            writer.write_rows(name, 0, data)
            hashes[name] = blake3(data).hexdigest()
    except BaseException:
        writer.abort()
        raise
    writer.close()
    (folder / ADAPTER_CONFIG).write_bytes(_pretty(config))
    files = {ADAPTER_WEIGHTS: {"blake3": hash_file(folder / ADAPTER_WEIGHTS),
                               "size": (folder / ADAPTER_WEIGHTS).stat().st_size},
             ADAPTER_CONFIG: {"blake3": hash_file(folder / ADAPTER_CONFIG)}}
    return files, hashes


def write_report(folder: Path, report: dict) -> dict:
    """adapter_report.json; its file record."""
    (folder / ADAPTER_REPORT).write_bytes(_pretty(report))
    return {ADAPTER_REPORT: {"blake3": hash_file(folder / ADAPTER_REPORT)}}


def recipe_hash(recipe: dict, inputs: dict) -> str:
    """Names what the output's bytes follow from (the published output is up to date with it)."""
    return canonical_blake3({"format": ADAPTER_OUTPUT_FORMAT, "recipe": recipe, "inputs": inputs})


def adapter_manifest(recipe: dict, inputs: dict, files: dict, tensors: dict) -> dict:
    """The manifest: recipe and inputs (by their files' blake3), every output file and tensor
    hashed (plain blake3: no hash tree, no plan), and manifest_hash."""
    man = {"schema": MANIFEST_SCHEMA, "kind": ADAPTER_KIND, "versions": versions(),
           "recipe_hash": recipe_hash(recipe, inputs), "recipe": recipe, "inputs": inputs,
           "outputs": {"files": dict(sorted(files.items())), "tensors": dict(sorted(tensors.items()))}}
    man["manifest_hash"] = manifest_hash(man)
    return man


def write_adapter_manifest(folder: Path, man: dict) -> None:
    write_manifest(folder / MANIFEST, man)


def _pretty(obj: dict) -> bytes:
    return canonical_json(obj, indent=2)


def refuse_adapter_manifest(man: dict, out_dir: Path, command: str) -> None:
    """A command that reads a model output's plan, given an adapter output: one line.

    Raises:
        ConfigError: `man` is an adapter output's manifest.
    """
    from mergepipe.errors import ConfigError
    if isinstance(man, dict) and man.get("kind") == ADAPTER_KIND:
        raise ConfigError(f"{out_dir}: an adapter output (manifest kind {ADAPTER_KIND}) has no plan for {command}; "
                          "`mergepipe verify --inputs --replay` checks it against its inputs")
