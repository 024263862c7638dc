"""The files of `mergepipe extract-lora` (docs/design.md, "LoRA extraction"): a PEFT LoRA adapter
(adapter_config.json, adapter_model.safetensors), extract_report.json (rank and retained energy
per module) and manifest.json (kind peft-lora-adapter, written last), all in the publisher's temp
folder.

Memory stays one tensor's: each tensor's bytes are appended to a spill file as it is extracted
(the ranks `--energy` picks, and so the header, are known only at the end), then copied into
adapter_model.safetensors by the kernel, tensors in name order, and the spill removed. Bytes
follow from the extracted tensors and the recipe only: sorted keys, no timestamps, no paths but
the manifest's record of the inputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from blake3 import blake3

from mergepipe.checkpoint.lora import ADAPTER_WEIGHTS, PREFIX
from mergepipe.checkpoint.lora_config import ADAPTER_CONFIG
from mergepipe.checkpoint.lora_extract import Extracted
from mergepipe.checkpoint.safetensors import OutTensor, SafetensorsWriter, tensor_bytes
from mergepipe.output.adapter_out import ADAPTER_KIND, scale_one_config
from mergepipe.output.manifest import MANIFEST, MANIFEST_SCHEMA, manifest_hash, versions, write_manifest
from mergepipe.util.canonical import canonical_blake3
from mergepipe.util.fs import canonical_json, hash_file

EXTRACT_REPORT = "extract_report.json"
EXTRACT_FORMAT = 1  # bump when the same recipe and inputs would write other bytes
_SPILL = ".extract-spill"


@dataclass(slots=True)
class _Spilled:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    blake3: str


@dataclass(slots=True)
class AdapterWriter:
    """Collects the extracted tensors into `folder` (a publisher's temp folder)."""

    folder: Path
    ranks: dict[str, int] = field(default_factory=dict)
    modules: dict[str, dict] = field(default_factory=dict)  # the report's per-module records
    whole: dict[str, str] = field(default_factory=dict)  # tensor -> its saved key (set at finish)
    _factors: dict[str, _Spilled] = field(default_factory=dict)  # by saved key
    _wholes: dict[str, _Spilled] = field(default_factory=dict)  # by tensor name
    _fd: int = -1
    _end: int = 0

    def __post_init__(self) -> None:
        self._fd = os.open(self.folder / _SPILL, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def _spill(self, dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> _Spilled:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], self._end + done)
        spilled = _Spilled(dtype, tuple(shape), self._end, len(view), blake3(view).hexdigest())
        self._end += len(view)
        return spilled

    def add(self, x: Extracted) -> None:
        """A changed tensor: its factors under the module's A/B keys, or its bytes kept whole."""
        item = x.item
        if x.whole is not None:
            self._wholes[item.name] = self._spill(item.expert.dtype, item.expert.shape, x.whole)
            return
        a_key, b_key = lora_keys(item.module, embedding=item.target == "embedding")
        for key, t in ((a_key, x.a), (b_key, x.b)):
            self._factors[key] = self._spill("F32", tuple(t.shape), tensor_bytes(t))
        rank = int(x.a.shape[0])
        self.ranks[item.module] = rank
        self.modules[item.module] = {"kind": item.target, "shape": list(item.expert.shape), "rank": rank,
                                     "full_rank": x.full_rank, "energy": x.energy}

    def finish(self, report: dict) -> dict:
        """Writes the adapter and the report; returns the manifest's `outputs` (files, tensors).
        Whole tensors of factored modules are saved as PEFT saves a wrapped layer's own
        parameters (`<module>.base_layer.<param>`); the others' modules go to modules_to_save."""
        keys: dict[str, str] = {}
        saved_modules: set[str] = set()
        for name in self._wholes:
            module, _, param = name.rpartition(".")
            wrapped = module in self.ranks
            keys[name] = f"{PREFIX}{module}.base_layer.{param}" if wrapped else f"{PREFIX}{name}"
            if not wrapped:
                saved_modules.add(module)
        self.whole = dict(sorted(keys.items()))
        spans = sorted([*self._factors.items(), *((keys[n], s) for n, s in self._wholes.items())],
                       key=lambda ks: ks[0])
        tensors = self._write_weights(spans)
        config = scale_one_config(self.ranks, fan_in_fan_out=False, base_model=None, task_type=None)
        config["modules_to_save"] = sorted(saved_modules) or None
        config["bias"] = "all" if any(".base_layer." in k for k in keys.values()) else "none"
        (self.folder / ADAPTER_CONFIG).write_bytes(canonical_json(config, indent=2))
        full = {**report, "modules": dict(sorted(self.modules.items())), "whole": self.whole}
        (self.folder / EXTRACT_REPORT).write_bytes(canonical_json(full, indent=2))
        files = {ADAPTER_WEIGHTS: {"blake3": hash_file(self.folder / ADAPTER_WEIGHTS),
                                   "size": (self.folder / ADAPTER_WEIGHTS).stat().st_size},
                 ADAPTER_CONFIG: {"blake3": hash_file(self.folder / ADAPTER_CONFIG)},
                 EXTRACT_REPORT: {"blake3": hash_file(self.folder / EXTRACT_REPORT)}}
        return {"files": files, "tensors": tensors}

    def _write_weights(self, spans: list[tuple[str, _Spilled]]) -> dict[str, str]:
        writer = SafetensorsWriter(self.folder / ADAPTER_WEIGHTS,
                                   [OutTensor(key, s.dtype, s.shape) for key, s in spans], metadata={"format": "pt"})
        try:
            for key, s in spans:
                if s.nbytes:
                    writer.copy_rows(key, 0, self._fd, s.offset, s.nbytes)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        self.close()
        return {key: s.blake3 for key, s in spans}

    def close(self) -> None:
        """Removes the spill (also on failure: the publisher removes the whole temp folder)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            (self.folder / _SPILL).unlink(missing_ok=True)


def lora_keys(module: str, *, embedding: bool) -> tuple[str, str]:
    """PEFT's saved keys of a module's A and B."""
    if embedding:
        return f"{PREFIX}{module}.lora_embedding_A", f"{PREFIX}{module}.lora_embedding_B"
    return f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"


def recipe_hash(recipe: dict, inputs: dict) -> str:
    return canonical_blake3({"format": EXTRACT_FORMAT, "recipe": recipe, "inputs": inputs})


def write_extract_manifest(folder: Path, recipe: dict, inputs: dict, outputs: dict) -> dict:
    """manifest.json, last: kind peft-lora-adapter (the folder is an adapter mergepipe wrote, so a
    rerun may replace it), `recipe.extract` naming how it was made; every file and tensor hashed."""
    man = {"schema": MANIFEST_SCHEMA, "kind": ADAPTER_KIND, "versions": versions(),
           "recipe_hash": recipe_hash(recipe, inputs), "recipe": recipe, "inputs": inputs,
           "outputs": {"files": dict(sorted(outputs["files"].items())),
                       "tensors": dict(sorted(outputs["tensors"].items()))}}
    man["manifest_hash"] = manifest_hash(man)
    write_manifest(folder / MANIFEST, man)
    return man
