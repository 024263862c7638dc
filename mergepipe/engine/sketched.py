"""Expert blocks the plan reads as a representation in place of their bytes (strategy
`sketch`: ternary sketches, index/sketch.py), as the merge engine sees them.

One object per merge (shared by the per-tensor-parameter copies of the merge state): which
(tensor, expert, block) are represented, their payloads read and checked by a reader thread
with the unit that holds them (`read_unit`), handed to the block that merges them, in the
form its path takes: a compiled kernel's (codes, scale) entries (`kernel_entries`) or the
torch path's fp32 delta (`delta`). Every payload handed out is counted in `bytes_read`, once.
A new representation adds its payload read and its decode here; the engine calls only these.
"""
from __future__ import annotations

import numpy as np

from mergepipe.checkpoint.safetensors import TensorInfo
from mergepipe.index.sketch import sketch_cost, unpack

Key = tuple[str, str, int]  # (expert, tensor, block)


class Represented:
    """The plan's represented blocks (`strategy.sketch.blocks`) and their payload store."""

    def __init__(self, blocks: dict[str, dict[str, list[int]]], stores: dict) -> None:
        self.stores = stores  # expert -> index.sketch.Sketch
        self.by_tensor: dict[str, dict[str, frozenset[int]]] = {}  # tensor -> expert -> blocks
        for expert, per in blocks.items():  # the plan's strategy.sketch.blocks
            for tensor, blocks in per.items():
                if blocks:
                    self.by_tensor.setdefault(tensor, {})[expert] = frozenset(blocks)
        self.bytes_read = 0
        self._pending: dict[Key, tuple[bytes, float]] = {}  # read by a reader thread, not yet merged

    def __bool__(self) -> bool:
        return bool(self.by_tensor)

    def of(self, tensor: str) -> dict[str, frozenset[int]] | None:
        """expert -> represented blocks of `tensor` (None: none)."""
        return self.by_tensor.get(tensor)

    def touches(self, tensor: str, b: int) -> bool:
        """Whether some expert's block b of `tensor` is represented."""
        per = self.by_tensor.get(tensor)
        return bool(per) and any(b in bs for bs in per.values())

    def read_unit(self, t: TensorInfo, ranges, unit: list[int]) -> dict[Key, tuple[bytes, float]]:
        """On a reader thread: the payloads of the represented blocks of tensor t's unit (rows
        `ranges[b]` for b in unit), checked (a plan never both represents a block and reads it
        in full: plan/record.py)."""
        per = self.by_tensor.get(t.name)
        if not per:
            return {}
        per_row = t.numel // t.shape[0] if t.shape else 1
        return {(e, t.name, b): self.stores[e].codes(t.name, b, (ranges[b][1] - ranges[b][0]) * per_row)
                for e, bs in per.items() for b in unit if b in bs}

    def arrived(self, payloads: dict[Key, tuple[bytes, float]]) -> None:
        """On the merging thread: a unit's payloads, kept until its blocks take them."""
        self._pending.update(payloads)

    def kernel_entries(self, tensor: str, b: int, n: int, experts, got) -> tuple[tuple[str, bytes, float], ...]:
        """(expert, codes, scale) of block b (n elements) for each expert in `experts` (canonical
        order) whose block is represented and not read in full (`got`): a compiled kernel's input."""
        per = self.by_tensor.get(tensor) or {}
        return tuple((e.name, *self._take(e.name, tensor, b, n)) for e in experts
                     if b in per.get(e.name, ()) and b not in got.get(e.name, {}))

    def delta(self, expert: str, tensor: str, b: int, n: int) -> np.ndarray | None:
        """The represented fp32 delta (n elements) of the expert's block b, or None where that
        block is not represented: the torch path's input."""
        if b not in (self.by_tensor.get(tensor) or {}).get(expert, ()):
            return None
        codes, alpha = self._take(expert, tensor, b, n)
        return unpack(codes, n, alpha)

    def _take(self, expert: str, tensor: str, b: int, n: int) -> tuple[bytes, float]:
        """A block's payload as its unit's reader thread read it, else read now; counted
        (on the merging thread only)."""
        got = self._pending.pop((expert, tensor, b), None)
        self.bytes_read += sketch_cost(n)
        return got if got is not None else self.stores[expert].codes(tensor, b, n)
