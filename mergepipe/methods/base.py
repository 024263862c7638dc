"""What a merge method sees: one block of the base and of each expert's delta,
plus what the whole tensor contributes (exact top-k cuts from the index); the raw
block a compiled kernel sees; each expert's density/gamma. Pure data; no I/O."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mergepipe.util.lazy import torch
from blake3 import blake3


@dataclass(frozen=True, slots=True)
class RankCut:
    """Where the `rank` largest |delta| of a whole tensor end, seen from one block.

    Order is (|delta| descending, flat index ascending), so "the rank largest" is
    exact even with ties: keep every element with |delta| > value, then the first
    `eq_keep` elements of this block whose |delta| == value (flat order).
    rank == 0 keeps nothing (value = inf).
    """

    rank: int
    value: float
    eq_keep: int
    # True when `eq_keep` covers every element of this block with |delta| == value, so a
    # compiled kernel need not scan the block for where to stop keeping them
    eq_all: bool = False


@dataclass(frozen=True, slots=True)
class ExpertBlock:
    name: str
    content_hash: str
    weight: float
    # fp32 delta (expert - base) for this block; None when the plan did not read it
    # or the block is byte-identical to the base: it contributes nothing.
    delta: torch.Tensor | None
    density: float = 1.0
    gamma: float = 0.01
    # rank -> RankCut for this block; backed by the index, so a budgeted merge
    # never rereads a tensor to find its magnitude thresholds.
    cut: Callable[[int], RankCut] | None = None
    # slerp only: cos of the angle between the whole base tensor and this expert's
    # whole tensor (each flattened), from tensor-level sums (see methods/slerp.py,
    # `cosine_from_sums`); None lets slerp compute it when the block is the whole tensor.
    cosine: float | None = None
    # factor on this block's (sparsified) delta, from the plan's `strategy.scales` (the
    # `compensated` strategy); 1.0, the default, leaves the arithmetic untouched
    scale: float = 1.0
    # the delta is a ternary sketch (plan strategy `sketch`, index/sketch.py): its elements
    # share one magnitude, so magnitude trims leave it as it is (its zeros are its trim)
    sketched: bool = False


@dataclass(frozen=True, slots=True)
class BlockInputs:
    tensor: str
    row_start: int
    row_end: int
    tensor_shape: tuple[int, ...]
    base: torch.Tensor  # fp32, this block's rows of the base
    experts: tuple[ExpertBlock, ...]  # canonical order: sorted by content hash
    seed: int = 0
    # a joint method's whole-tensor statistics (fp64 numpy array, methods/joint.py), from the
    # engine's joint scan; None for other methods (or when a test hands over the whole tensor)
    joint: object | None = None

    @property
    def tensor_numel(self) -> int:
        n = 1
        for d in self.tensor_shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class RawBlock:
    """One block as stored bytes, for a method's compiled kernel (`Method.compiled`)."""

    tensor: str
    tensor_numel: int
    base: memoryview  # the base rows, in the tensor's dtype
    experts: tuple[tuple[str, memoryview], ...]  # (name, rows) of the experts read, canonical order
    cut: Callable[[str, int], RankCut]  # (expert, rank) -> the whole tensor's cut seen from this block
    # (name, codes, alpha) of the experts read as ternary sketches (plan strategy `sketch`)
    sketches: tuple[tuple[str, bytes, float], ...] = ()


def expert_knobs(params, expert: dict) -> dict[str, float]:
    """An expert's density and gamma: its own (plan entry), else the method's parameter of
    that name; absent when neither has one (ExpertBlock's defaults then apply, unused)."""
    knobs = {}
    for key in ("density", "gamma"):
        value = expert.get(key)
        if value is None:
            value = getattr(params, key, None)
        if value is not None:
            knobs[key] = float(value)
    return knobs


def block_rng(seed: int, expert_hash: str, tensor: str, row_start: int) -> torch.Generator:
    """Generator for one (expert, block): independent of order, threads and budget."""
    digest = blake3(f"{seed}:{expert_hash}:{tensor}:{row_start}".encode()).digest(8)
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
