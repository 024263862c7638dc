"""A PEFT LoRA adapter as an expert: a virtual checkpoint of its base (docs/design.md, "LoRA
adapters").

Its tensors are the base's names, dtypes, shapes and file offsets. Tensor T reads as the
base's bytes, except:
- a LoRA target (`<module>.lora_A.weight`, `lora_B.weight`; `lora_embedding_A`, `_B`):
  T = round(base_T + Δ_T) to T's dtype, Δ computed for the rows read only, in fp32:
  Δ[i, j] = scale · Σ_k L[i, k] · R[k, j], k in order, each product and sum rounded to fp32
  (L, R = B, A; or Aᵀ, Bᵀ with fan_in_fan_out and for embeddings, PEFT's (B·A)ᵀ);
  scale = lora_alpha / r, or / sqrt(r) with use_rslora, per module (checkpoint/lora_config.py).
  A fixed-order sum, not BLAS: a BLAS product's bits depend on how the rows are grouped
  (and on the CPU), and a block must read the same bytes whether it is hashed for the index
  or read by the engine with its neighbours;
- a LoRA bias (`<module>.lora_B.bias`): <module>.bias + scale · lora_B.bias, likewise;
- a whole tensor the adapter stores (modules_to_save, a `base_layer` weight or bias): its
  values, rounded to the base's dtype, in place of the base's (then Δ, if any, on top).
The adapter's files are read once, when opened, and hashed into its identity; the base's
bytes are read through its readers (CheckpointReader opens a LoraReader for this checkpoint).
Only adapter_model.safetensors is read, through this project's safetensors parser; a
pickled adapter_model.bin is refused, never loaded. torch is imported only when opened.
"""
from __future__ import annotations

import json
import threading
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeVar

from blake3 import blake3

from mergepipe.checkpoint import _lora_kernel
from mergepipe.checkpoint.lora_config import ADAPTER_CONFIG, LoraSettings, read_settings
from mergepipe.checkpoint.safetensors import (FLOAT_DTYPES, INDEX_JSON, PICKLE_SUFFIXES, Checkpoint,
                                              CheckpointReader, ReadCounter, TensorInfo, as_tensor,
                                              open_checkpoint, tensor_bytes)
from mergepipe.errors import ConfigError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")  # a tensor, or its shape (check_adapter)

LORA_FORMAT = 1  # bump when an adapter's bytes change meaning (the Δ arithmetic, the key rules)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's key prefix: PeftModel.base_model (LoraModel).model
_PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "bias",
          ".lora_embedding_A": "emb_A", ".lora_embedding_B": "emb_B"}
_WRAPPERS = ("base_layer", "modules_to_save")  # PEFT's wrapper modules: not in the base's names


def is_adapter(path: str | Path) -> bool:
    """A folder with adapter_config.json and no model weights of its own (model.safetensors or
    a sharded index): a PEFT adapter."""
    path = Path(path)
    return (path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "model.safetensors").exists()
            and not (path / INDEX_JSON).exists())


@dataclass(frozen=True, slots=True)
class Delta:
    """Δ of one base tensor: rows of scale · L·R (matrix), or scale · vector (a LoRA bias)."""

    module: str
    scale: float
    left: torch.Tensor | None = None   # (rows, r)
    right: torch.Tensor | None = None  # (r, columns)
    vector: torch.Tensor | None = None
    embedding: bool = False    # the factors are lora_embedding_A/_B
    transposed: bool = False   # left, right = Aᵀ, Bᵀ (fan_in_fan_out, embeddings)
    right32: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        # every row slab multiplies by all of `right`: made fp32 and contiguous once, not per slab
        if self.right is not None:
            object.__setattr__(self, "right32", self.right.float().contiguous())

    def peft_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as PEFT stores them: Δ of the module = scale · B·A (transposed: its transpose)."""
        return (self.left.T, self.right.T) if self.transposed else (self.right, self.left)

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Δ[r0:r1] in fp32 (see the module docstring for the order of operations)."""
        import torch
        if self.vector is not None:
            return self.vector[r0:r1].float() * self.scale
        left, right = self.left[r0:r1].float(), self.right32
        kernel = _lora_kernel.load()
        if kernel is not None and left.shape[0] > 0:
            out = torch.empty(left.shape[0], right.shape[1])
            kernel(left.contiguous(), right, self.scale, out)
            return out
        acc = left[:, 0:1] * right[0:1]
        term = torch.empty_like(acc)
        for k in range(1, left.shape[1]):  # product, then sum: two roundings, never a fused one
            torch.mul(left[:, k:k + 1], right[k:k + 1], out=term)
            acc.add_(term)
        return acc.mul_(self.scale)


@dataclass(frozen=True, slots=True)
class Adapter:
    """What an adapter changes in its base, by base tensor name."""

    folder: Path
    deltas: dict[str, Delta]
    replaced: dict[str, bytearray]  # the whole tensor's bytes in the base's dtype

    def merged_rows(self, t: TensorInfo, r0: int, r1: int, base_rows: memoryview) -> memoryview | bytearray:
        """Rows r0:r1 of tensor t as this adapter's expert holds them, from the base's bytes of
        those rows."""
        rb = t.row_bytes()
        whole = self.replaced.get(t.name)
        rows = memoryview(whole)[r0 * rb:r1 * rb] if whole is not None else base_rows
        delta = self.deltas.get(t.name)
        if delta is None:
            return rows
        import torch
        base = as_tensor(bytearray(rows), t.dtype, (r1 - r0, *t.shape[1:]))
        work = torch.float64 if t.dtype == "F64" else torch.float32
        return tensor_bytes((base.to(work) + delta.rows(r0, r1).to(work)).to(base.dtype))


class LoraReader(CheckpointReader):
    """Reads of an AdapterCheckpoint: the base's bytes, with the adapter's tensors' rows made
    as `Adapter.merged_rows` says. Counted as the bytes returned, like a dense expert's."""

    ckpt: AdapterCheckpoint

    def __init__(self, ckpt: AdapterCheckpoint, *, counter: ReadCounter | None = None,
                 random_access: bool = True) -> None:
        super().__init__(ckpt, counter=counter, random_access=random_access)
        self._edges: CheckpointReader | None = None  # uncounted: rows that a read cuts through
        self._edges_lock = threading.Lock()  # readers are shared by the engine's pool threads

    def close(self) -> None:
        if self._edges is not None:
            self._edges.close()
            self._edges = None
        super().close()

    def read_range(self, t: TensorInfo, begin: int, end: int) -> bytearray | memoryview:
        buf = super().read_range(t, begin, end)
        for p in self.ckpt.changed_in(t.file, begin, end):
            self._patch(buf, begin, end, p)
        return buf

    def _patch(self, buf: bytearray | memoryview, begin: int, end: int, p: TensorInfo) -> None:
        """Overwrite the part of buf (file bytes begin:end) that holds tensor p."""
        rb = p.row_bytes()
        lo, hi = max(begin, p.begin), min(end, p.end)
        r0, r1 = (lo - p.begin) // rb, -(-(hi - p.begin) // rb)
        a, b = p.begin + r0 * rb, p.begin + r1 * rb  # whole rows
        view = memoryview(buf).cast("B")
        if begin <= a and b <= end:
            base_rows = view[a - begin:b - begin]
        else:
            with self._edges_lock:
                if self._edges is None:
                    self._edges = CheckpointReader(self.ckpt.base, counter=ReadCounter(), random_access=False)
            base_rows = memoryview(self._edges.read_range(p, a, b)).cast("B")
        merged = memoryview(self.ckpt.adapter.merged_rows(p, r0, r1, base_rows)).cast("B")
        view[lo - begin:hi - begin] = merged[lo - a:hi - a]


@dataclass(frozen=True, slots=True)
class AdapterCheckpoint(Checkpoint):
    """An adapter's expert: `root` is the adapter folder; `files` and `tensors` are the base's
    (the bytes they hold are read through LoraReader). `identity` names the bytes: blake3 over
    (LORA_FORMAT, the base's content hash, the adapter's file hashes)."""

    reader_class: ClassVar[type] = LoraReader
    base: Checkpoint = field(repr=False)
    adapter: Adapter = field(repr=False)
    identity: str
    _changed: dict[Path, tuple[list[int], list[int], list[str]]] = field(repr=False)

    def changed_in(self, file: Path, begin: int, end: int) -> Iterator[TensorInfo]:
        """The adapter's tensors in `file` with bytes in [begin, end)."""
        begins, ends, names = self._changed.get(file, ((), (), ()))
        i = bisect_right(ends, begin)  # tensors tile the file: ends are sorted as begins are
        while i < len(names) and begins[i] < end:
            if ends[i] > begins[i]:
                yield self.base.tensors[names[i]]
            i += 1


def open_adapter(folder: str | Path, base: Checkpoint, base_content_hash: str) -> AdapterCheckpoint:
    """The expert that PEFT adapter `folder` makes of `base` (whose content hash is given).

    Raises:
        ConfigError: a bad adapter_config.json, an unsupported PEFT type or LoRA variant, a
        pickled adapter_model.bin, or a tensor that is not in the base or does not fit it
        (naming the module).
        CheckpointError: adapter_model.safetensors is malformed.
    """
    folder = Path(folder)
    settings, config_bytes = read_settings(folder)
    weights = _weights_file(folder)
    tensors, weights_hash = _read_tensors(weights)
    adapter = _build(folder, weights, tensors, settings, base)
    identity = blake3(json.dumps({"format": LORA_FORMAT, "base": base_content_hash,
                                  "config": blake3(config_bytes).hexdigest(), "weights": weights_hash},
                                 sort_keys=True).encode()).hexdigest()
    changed: dict[Path, list[tuple[int, int, str]]] = {}
    for name in {*adapter.deltas, *adapter.replaced}:
        t = base.tensors[name]
        changed.setdefault(t.file, []).append((t.begin, t.end, name))
    columns = {f: tuple(map(list, zip(*sorted(rows)))) for f, rows in changed.items()}
    return AdapterCheckpoint(folder, base.files, base.tensors, base, adapter, identity, columns)


def check_adapter(folder: str | Path, base: Checkpoint) -> None:
    """What open_adapter refuses about adapter `folder` and `base`, from adapter_config.json and
    the safetensors header alone (no factor is read: `mergepipe check`); NaN/Inf factors are
    found only when the adapter is opened.

    Raises:
        ConfigError, CheckpointError: as open_adapter, with its messages, in its order.
    """
    folder = Path(folder)
    settings, _ = read_settings(folder)
    weights = _weights_file(folder)
    shapes = {}
    for t in open_checkpoint(weights).files[0].tensors:  # data-offset order, as _read_tensors
        _check_float(weights, t)
        shapes[t.name] = tuple(t.shape)
    modules, wholes = _group(weights, shapes)
    for name, (key, shape) in wholes.items():
        _check_whole(weights, key, name, shape, base)
    for module, parts in sorted(modules.items()):
        _check_module(weights, module, parts, settings, base)


def _weights_file(folder: Path) -> Path:
    """The adapter's safetensors file (a pickled one is refused, never unpickled)."""
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise ConfigError(f"{folder / pickles[0]}: pickled adapter weights are refused (never "
                              f"unpickled); save the adapter as {ADAPTER_WEIGHTS} "
                              "(save_pretrained(safe_serialization=True))")
        raise ConfigError(f"{weights}: missing; a PEFT adapter folder holds {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS}")
    return weights


def _check_float(path: Path, t: TensorInfo) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ConfigError(f"{path}: tensor {t.name!r} is {t.dtype}; adapter tensors are floats")


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the adapter's safetensors file, and the blake3 of the file's bytes (its
    header, then its tensors in offset order: they tile the file, as the parser checked)."""
    ckpt = open_checkpoint(path)
    digest = blake3(ckpt.files[0].header_bytes)
    out = {}
    with CheckpointReader(ckpt, random_access=False) as reader:
        for t in ckpt.files[0].tensors:  # data-offset order
            buf = reader.read_range(t, t.begin, t.end)
            digest.update(buf)
            _check_float(path, t)
            out[t.name] = as_tensor(buf, t.dtype, t.shape)
    return out, digest.hexdigest()


def _split_key(key: str, path: Path) -> tuple[str, str]:
    """(module, part) of a LoRA factor's key, or (base tensor name, "whole")."""
    if not key.startswith(PREFIX):
        raise ConfigError(f"{path}: tensor {key!r}: not a PEFT adapter key (expected {PREFIX!r} + module "
                          "name)")
    rest = key[len(PREFIX):]
    for suffix, part in _PARTS.items():
        if rest.endswith(suffix):
            return rest[:-len(suffix)], part
    segments = rest.split(".")
    if any(s.startswith("lora_") for s in segments):
        raise ConfigError(f"{path}: tensor {key!r}: not a plain LoRA factor (DoRA magnitudes and other "
                          "variants' tensors are not supported)")
    return ".".join(s for s in segments if s not in _WRAPPERS), "whole"


def _group(path: Path, items: dict[str, T]) -> tuple[dict[str, dict[str, T]], dict[str, tuple[str, T]]]:
    """The adapter's tensors (or their shapes) by key, grouped: ({module: {part: item}},
    {base tensor name: (key, item)} for whole tensors).

    Raises:
        ConfigError: a key that is not a plain LoRA factor or a base tensor, a base tensor stored twice.
    """
    modules: dict[str, dict[str, T]] = {}
    wholes: dict[str, tuple[str, T]] = {}
    for key, item in items.items():
        name, part = _split_key(key, path)
        if part == "whole":
            if name in wholes:
                raise ConfigError(f"{path}: tensor {key!r}: a second tensor for base tensor {name!r}")
            wholes[name] = (key, item)
        else:
            modules.setdefault(name, {})[part] = item
    return modules, wholes


def _build(folder: Path, path: Path, tensors: dict[str, torch.Tensor], settings: LoraSettings,
           base: Checkpoint) -> Adapter:
    """The adapter's Δ and whole tensors by base tensor name, each checked against the base."""
    from mergepipe.checkpoint.safetensors import DTYPES
    modules, wholes = _group(path, tensors)
    replaced: dict[str, bytearray] = {}
    for name, (key, tensor) in wholes.items():
        t = _check_whole(path, key, name, tuple(tensor.shape), base)
        replaced[name] = bytearray(tensor_bytes(tensor.to(DTYPES[t.dtype][1])))
    deltas: dict[str, Delta] = {}
    for module, parts in sorted(modules.items()):
        deltas.update(_module_deltas(path, module, parts, settings, base))
    return Adapter(folder, deltas, replaced)


def _check_whole(path: Path, key: str, name: str, shape: tuple[int, ...], base: Checkpoint) -> TensorInfo:
    """The base tensor a whole tensor of the adapter replaces, checked to take its shape."""
    t = base.tensors.get(name)
    if t is None:
        raise ConfigError(f"{path}: tensor {key!r}: module tensor {name!r} is not in the base {base.root}; "
                          "is this an adapter of another model?")
    if shape != tuple(t.shape):
        raise ConfigError(f"{path}: tensor {key!r} has shape {list(shape)}, the base's {name!r} "
                          f"{list(t.shape)}; is this an adapter of another model?")
    if t.dtype not in FLOAT_DTYPES:
        raise ConfigError(f"{path}: tensor {key!r}: the base's {name!r} is {t.dtype}, not a float")
    return t


def _check_module(path: Path, module: str, shapes: dict[str, tuple[int, ...]], settings: LoraSettings,
                  base: Checkpoint) -> tuple[TensorInfo, bool, TensorInfo | None]:
    """(the target weight, whether the factors are transposed, the base bias a LoRA bias adds to)
    of `module`, its factors' `shapes` by part checked against the config's rank and the base.

    Raises:
        ConfigError: naming the module.
    """
    def fail(message: str) -> ConfigError:
        return ConfigError(f"{path}: module {module!r}: {message}")

    embedding = "emb_A" in shapes or "emb_B" in shapes
    a_part, b_part = ("emb_A", "emb_B") if embedding else ("A", "B")
    allowed = {a_part, b_part} if embedding else {a_part, b_part, "bias"}
    if set(shapes) - allowed or a_part not in shapes or b_part not in shapes:
        raise fail(f"needs both {a_part} and {b_part} (and at most a lora_B bias), got {sorted(shapes)}")
    a, b = shapes[a_part], shapes[b_part]
    if len(a) != 2 or len(b) != 2:
        raise fail(f"LoRA factors must be matrices, got A {list(a)} and B {list(b)} "
                   "(convolution adapters are not supported)")
    r = settings.rank_of(module)
    if a[0] != r or b[1] != r:
        raise fail(f"rank {r} in {ADAPTER_CONFIG}, but A is {list(a)} and B {list(b)}")
    weight = base.tensors.get(f"{module}.weight")
    if weight is None:
        raise fail(f"target {module}.weight is not in the base {base.root}; is this an adapter of another "
                   "model?")
    if weight.dtype not in FLOAT_DTYPES:
        raise fail(f"target {module}.weight is {weight.dtype}, not a float")
    transposed = embedding or settings.fan_in_fan_out
    want = (a[1], b[0]) if transposed else (b[0], a[1])
    if tuple(weight.shape) != want:
        layout = "(B·A)ᵀ" if transposed else "B·A"
        raise fail(f"{layout} is {list(want)}, the base's {module}.weight {list(weight.shape)}; is this an "
                   "adapter of another model?")
    bias = None
    if "bias" in shapes:
        bias = base.tensors.get(f"{module}.bias")
        if bias is None or bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (b[0],) \
                or shapes["bias"] != (b[0],):
            raise fail(f"lora_B bias {list(shapes['bias'])} needs a float base {module}.bias of shape "
                       f"[{b[0]}]")
    return weight, transposed, bias


def _module_deltas(path: Path, module: str, parts: dict[str, torch.Tensor], settings: LoraSettings,
                   base: Checkpoint) -> dict[str, Delta]:
    """Δ of `module`'s weight (and of its bias, with a LoRA bias), checked against the base."""
    weight, transposed, bias = _check_module(path, module, {p: tuple(t.shape) for p, t in parts.items()},
                                             settings, base)
    embedding = "emb_A" in parts
    a, b = (parts["emb_A"], parts["emb_B"]) if embedding else (parts["A"], parts["B"])
    scale = settings.scale_of(module)
    left, right = (a.T, b.T) if transposed else (b, a)
    out = {weight.name: Delta(module, scale, left=left, right=right, embedding=embedding, transposed=transposed)}
    if bias is not None:
        out[bias.name] = Delta(module, scale, vector=parts["bias"])
    return out
