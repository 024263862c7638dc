"""Expert blocks read as k-bit group-quantized deltas (index/groupquant.py) in place of their
bytes, as the torch path sees them: the same interface as engine/sketched.py's Represented
(payloads read on a reader thread with their unit, handed to the block that merges them as an
fp32 delta, each counted once in `bytes_read`, the block's group-quantized cost).

A decoded block is an ordinary fp32 delta to the method: TIES/Breadcrumbs trim it by its
tensor's magnitude cut of the exact delta (the index's rank cut, as for a full read) applied to
the decoded values and elect signs on what is left; DARE drops and rescales decoded elements (a
midrise quantizer has no zero level, so only a group whose scale is 0 decodes to zeros, and a
decoded block is trimmed like a dense one, unlike a sketch). No compiled-kernel entries: such a
block is merged on the torch path.

Not yet called by the engine: engine/sketched.py's hook is to hand `delta` to the torch path
once the plan records the quantized blocks (plan/strategies/quant.py).
"""
from __future__ import annotations

import numpy as np

from mergepipe.checkpoint.safetensors import TensorInfo
from mergepipe.errors import IntegrityError
from mergepipe.index.groupquant import block_cost

Key = tuple[str, str, int]  # (expert, tensor, block)


class Quantized:
    """The plan's group-quantized blocks and their opened files.

    `blocks`: expert -> tensor -> block -> kind (a Spec name, e.g. gq4g64); `stores`: expert ->
    kind -> index.groupquant.GroupQuant. A kind the expert has no file for is an IntegrityError
    at construction, naming expert, tensor, block and kind (the plan and the files disagree)."""

    def __init__(self, blocks: dict[str, dict[str, dict[int, str]]], stores: dict[str, dict]) -> None:
        self.by_tensor: dict[str, dict[str, dict[int, object]]] = {}  # tensor -> expert -> block -> file
        for expert, per in blocks.items():
            for tensor, kinds in per.items():
                if kinds:
                    self.by_tensor.setdefault(tensor, {})[expert] = {b: _file(stores, expert, tensor, b, k)
                                                                     for b, k in kinds.items()}
        self.bytes_read = 0
        self._pending: dict[Key, np.ndarray] = {}

    def __bool__(self) -> bool:
        return bool(self.by_tensor)

    def touches(self, tensor: str, b: int) -> bool:
        per = self.by_tensor.get(tensor)
        return bool(per) and any(b in bs for bs in per.values())

    def read_unit(self, t: TensorInfo, ranges, unit: list[int]) -> dict[Key, np.ndarray]:
        """On a reader thread: the decoded deltas of the quantized blocks of tensor t's unit
        (rows `ranges[b]` for b in unit), each payload checked against its blake3."""
        per = self.by_tensor.get(t.name)
        if not per:
            return {}
        per_row = t.numel // t.shape[0] if t.shape else 1
        return {(e, t.name, b): bs[b].delta(t.name, b, (ranges[b][1] - ranges[b][0]) * per_row)
                for e, bs in per.items() for b in unit if b in bs}

    def arrived(self, decoded: dict[Key, np.ndarray]) -> None:
        """On the merging thread: a unit's decoded blocks, kept until their blocks take them."""
        self._pending.update(decoded)

    def delta(self, expert: str, tensor: str, b: int, n: int) -> np.ndarray | None:
        """The decoded fp32 delta (n elements) of the expert's block b, or None where that block
        is not quantized; counted once (on the merging thread only)."""
        q = (self.by_tensor.get(tensor) or {}).get(expert, {}).get(b)
        if q is None:
            return None
        got = self._pending.pop((expert, tensor, b), None)
        self.bytes_read += block_cost(n, q.spec)
        return got if got is not None else q.delta(tensor, b, n)


def _file(stores: dict[str, dict], expert: str, tensor: str, b: int, kind: str):
    q = stores.get(expert, {}).get(kind)
    if q is None or not q.has(tensor, b):
        raise IntegrityError(f"the plan reads expert {expert!r} tensor {tensor!r} block {b} as {kind}, which its "
                             "group-quantized files do not hold")
    return q
