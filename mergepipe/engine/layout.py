"""The output's file layout: which weight file each tensor goes to, and the shard index json.

Kept apart from the engine (merge.py) so that the writer of a split merge
(commands/parts.py) and the engine share one definition of where tensors go.
"""
from __future__ import annotations

import json
from math import prod

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE, Checkpoint, OutTensor, TensorInfo

__all__ = ["OUT_DTYPES", "OutTensor", "output_layout", "shard_index_json"]

OUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def output_layout(base: Checkpoint, *, dtype: str | None, shard_bytes: int | None) -> dict[str, list[OutTensor]]:
    """Output file name -> tensors, mirroring the base's sharding unless shard_bytes is set."""
    def out(t: TensorInfo) -> OutTensor:
        d = OUT_DTYPES[dtype] if dtype and t.dtype in FLOAT_DTYPES else t.dtype
        return OutTensor(t.name, d, t.shape)

    tensors = list(base.tensors.values())
    if shard_bytes is None:
        if len(base.files) == 1:
            return {"model.safetensors": [out(t) for t in tensors]}
        return {h.path.name: [out(t) for t in h.tensors] for h in base.files}
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        o = out(t)
        nbytes = ITEMSIZE[o.dtype] * t.numel
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(o)
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def shard_index_json(layout: dict[str, list[OutTensor]]) -> bytes:
    """model.safetensors.index.json for a sharded layout (sorted, stable bytes)."""
    total = sum(prod(t.shape) * ITEMSIZE[t.dtype] for ts in layout.values() for t in ts)
    weight_map = {t.name: fname for fname, ts in layout.items() for t in ts}
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
