"""LoRA extraction's inputs (docs/design.md, "LoRA extraction"): which tensors of a dense
fine-tune become LoRA factors, which are kept whole, and each one's Δ = expert − base read and
factored alone (one tensor's bytes and its fp64 Δ in memory, never the model).

From the headers only (`plan_extraction`, before any weight is read): the expert and the base
must have the same tensor names and shapes (float dtypes may differ; other dtypes must match).
A LoRA target is `<module>.weight`, 2-D, float, its module not kept whole; a vocabulary
embedding (`EMBEDDINGS`) is one only with `embed_lora` (factored as Δᵀ, PEFT's
lora_embedding_A/B). `keep` patterns select modules kept whole by PEFT's modules_to_save rule
(the module's name ends with the pattern). A fixed --rank must fit every target.

Per tensor (`extract`): identical bytes or equal values: unchanged (nothing written); a target
with a non-zero Δ: its factors (checkpoint/lora_factor.py, run by the caller with one intra-op
thread); any other changed tensor: the expert's bytes, kept whole. NaN or Inf in either
model's tensor is refused (Δ undefined). torch is imported on first use.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blake3 import blake3

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, CheckpointReader, TensorInfo, as_tensor
from mergepipe.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

# modules PEFT wraps as nn.Embedding (lora_embedding_A/B): token and position tables
EMBEDDINGS = frozenset({"embed_tokens", "wte", "wpe", "word_embeddings", "embed_in", "tok_embeddings",
                        "embed_positions", "position_embeddings"})


@dataclass(frozen=True, slots=True)
class RankRule:
    """A fixed rank, or the smallest rank whose retained energy reaches `energy` (0 < e ≤ 1)."""

    rank: int | None = None
    energy: float | None = None

    def recipe(self) -> dict:
        return {"rank": self.rank} if self.rank is not None else {"energy": self.energy}


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor of the expert and its role."""

    name: str
    module: str
    target: str | None  # "linear" | "embedding": factored; None: kept whole if changed
    expert: TensorInfo
    base: TensorInfo


@dataclass(frozen=True, slots=True)
class Extracted:
    item: Item
    expert_blake3: str  # of the tensor's bytes in each input
    base_blake3: str
    b: torch.Tensor | None = None  # fp32 factors (target), B·A = Δ (embedding: Δᵀ)
    a: torch.Tensor | None = None
    full_rank: int = 0
    energy: float = 1.0
    whole: bytes | None = None  # the expert's bytes of a changed tensor kept whole

    @property
    def changed(self) -> bool:
        return self.b is not None or self.whole is not None


def module_of(name: str) -> str:
    return name.rpartition(".")[0]


def kept_modules(names: list[str], patterns: list[str]) -> set[str]:
    """The modules owning tensors whose name ends with a pattern (PEFT's modules_to_save rule).

    Raises:
        ConfigError: a pattern that matches no module.
    """
    modules = sorted({module_of(n) for n in names})
    kept = set()
    for p in patterns:
        hit = {m for m in modules if m.endswith(p)}
        if not p or not hit:
            raise ConfigError(f"--modules-to-save {p!r}: no module of the expert ends with it (modules are "
                              "tensor names without their last part, e.g. model.norm, lm_head)")
        kept |= hit
    return kept


def _target(t: TensorInfo, kept: set[str], embed_lora: bool) -> str | None:
    module, _, param = t.name.rpartition(".")
    if param != "weight" or len(t.shape) != 2 or t.dtype not in FLOAT_DTYPES or module in kept:
        return None
    if module.rpartition(".")[2] in EMBEDDINGS:
        return "embedding" if embed_lora else None
    return "linear"


def plan_extraction(expert: Checkpoint, base: Checkpoint, *, rule: RankRule, keep: list[str],
                    embed_lora: bool) -> list[Item]:
    """Every tensor of the expert, by name, with its role (from headers only).

    Raises:
        CheckpointError: tensor names, shapes or non-float dtypes that differ from the base's.
        ConfigError: a --rank larger than a target's smaller side, a pattern matching nothing.
    """
    names = sorted(expert.tensors.names)
    for name in names:
        if name not in base.tensors:
            raise CheckpointError(f"{expert.root}: tensor {name!r} is not in the base {base.root}; "
                                  "is this a fine-tune of another model?")
    missing = sorted(set(base.tensors.names) - set(names))
    if missing:
        raise CheckpointError(f"{base.root}: tensor {missing[0]!r} of the base is not in the expert {expert.root}")
    kept = kept_modules(names, keep)
    items = []
    for name in names:
        e, b = expert.tensors[name], base.tensors[name]
        if tuple(e.shape) != tuple(b.shape):
            raise CheckpointError(f"{expert.root}: tensor {name!r} has shape {list(e.shape)}, the base's "
                                  f"{list(b.shape)}; is this a fine-tune of another model?")
        if e.dtype != b.dtype and not {e.dtype, b.dtype} <= FLOAT_DTYPES:
            raise CheckpointError(f"{expert.root}: tensor {name!r} is {e.dtype}, the base's {b.dtype}")
        target = _target(e, kept, embed_lora)
        if target is not None and rule.rank is not None and rule.rank > min(e.shape):
            raise ConfigError(f"--rank {rule.rank}: larger than tensor {name!r}'s smaller side "
                              f"({list(e.shape)}); give at most {min(e.shape)}, or --energy")
        items.append(Item(name, module_of(name), target, e, b))
    return items


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside (restored after): MKL's eigh and matmul give other
    last bits at other thread counts, so every factorization runs single-threaded."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


SLAB_ELEMENTS = 1 << 22  # Δ is made this many elements at a time: its fp64 transients stay ~64 MiB


def _slabs(item: Item, e_data: memoryview, b_data: memoryview, roots: tuple) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, Δ = expert − base of a slab of rows in fp64, as (rows, elements per row)): each
    element the same fp64 difference a whole-tensor subtraction gives, the fp64 transients one
    slab. A NaN or Inf in either tensor is refused, naming it."""
    e, b = item.expert, item.base
    rows = e.shape[0] if e.shape else 1
    x = as_tensor(e_data, e.dtype, e.shape).reshape(rows, -1)
    y = as_tensor(b_data, b.dtype, b.shape).reshape(rows, -1)
    step = max(1, SLAB_ELEMENTS // max(1, x.shape[1]))
    for r0 in range(0, rows, step):
        yield r0, _finite(x[r0:r0 + step], e, roots[0]) - _finite(y[r0:r0 + step], b, roots[1])


def _changed(slabs: Iterator[tuple[int, torch.Tensor]]) -> bool:
    """Whether any element of Δ is nonzero; every slab is made, so a NaN anywhere is refused."""
    changed = False
    for _, slab in slabs:
        changed |= bool(slab.any())
    return changed


def _delta(item: Item, slabs: Iterator[tuple[int, torch.Tensor]], transposed: bool) -> torch.Tensor:
    """Δ in fp64, in the weight's layout (`transposed`: its transpose, contiguous, for a 2-D
    embedding), filled slab by slab: only Δ is held at full size."""
    import torch
    shape = item.expert.shape
    rows = shape[0] if shape else 1
    cols = math.prod(shape) // rows if shape else 1
    out = torch.empty((cols, rows) if transposed else (rows, cols), dtype=torch.float64)
    for r0, slab in slabs:
        if transposed:
            out[:, r0:r0 + slab.shape[0]] = slab.T
        else:
            out[r0:r0 + slab.shape[0]] = slab
    return out if transposed else out.reshape(shape)


def _finite(rows: torch.Tensor, t: TensorInfo, root) -> torch.Tensor:
    import torch
    x = rows.to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise CheckpointError(f"{root}: tensor {t.name!r} holds NaN or Inf; its Δ to the base is undefined")
    return x


def extract(item: Item, expert: CheckpointReader, base: CheckpointReader, rule: RankRule) -> Extracted:
    """One tensor: unchanged, factored (call inside `one_thread`) or kept whole (see the module docs)."""
    from mergepipe.checkpoint.lora_factor import factors, spectrum
    e, b = item.expert, item.base
    e_data = memoryview(expert.read_range(e, e.begin, e.end)).cast("B")
    b_data = memoryview(base.read_range(b, b.begin, b.end)).cast("B")
    hashes = blake3(e_data).hexdigest(), blake3(b_data).hexdigest()
    if e.dtype == b.dtype and e_data == b_data:
        return Extracted(item, *hashes)
    if e.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{expert.ckpt.root}: tensor {item.name!r} ({e.dtype}) differs from the base's; "
                              "an adapter holds float tensors only")
    roots = (expert.ckpt.root, base.ckpt.root)
    if item.target is None:  # kept whole if changed: Δ itself is never held
        changed = _changed(_slabs(item, e_data, b_data, roots))
        return Extracted(item, *hashes, whole=bytes(e_data)) if changed else Extracted(item, *hashes)
    d = _delta(item, _slabs(item, e_data, b_data, roots), item.target == "embedding")
    del e_data, b_data  # the factorization holds Δ and its factors only
    if not bool(d.any()):
        return Extracted(item, *hashes)
    spec = spectrum(d)
    rank = rule.rank if rule.rank is not None else spec.rank_for_energy(rule.energy)
    fb, fa = factors(d, spec, rank)
    return Extracted(item, *hashes, b=fb, a=fa, full_rank=spec.full_rank, energy=spec.energy(rank))
