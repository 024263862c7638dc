"""The output's file layout: which weight file each tensor goes to, and the shard index json.

Kept apart from the engine (merge.py) so that the writer of a split merge
(commands/parts.py) and the engine share one definition of where tensors go.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate, repeat
from math import prod
from operator import itemgetter, mul, sub

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE, Checkpoint, OutTensor, TensorInfo

__all__ = ["OUT_DTYPES", "OutTensor", "base_alignment", "output_layout", "shard_index_json", "usable_shard_names"]

OUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")


def usable_shard_names(names: list[str]) -> bool:
    """Whether the base's shard file names can name the output's shards too: each a plain
    `*.safetensors` name (so never one of the output's own files: README.md, config.json,
    manifest.json, run.json, tokenizer files, the index json), and no two alike (shards
    in different subfolders may share a name). Otherwise the output names its shards
    `model-0000i-of-0000n.safetensors`."""
    return len(set(names)) == len(names) and all(_SHARD_NAME.fullmatch(n) for n in names)


def base_alignment(base: Checkpoint, layout: dict[str, list[OutTensor]]) -> dict[str, int]:
    """Output file -> data start of the base file it mirrors byte for byte in its data section
    (same tensors, dtypes and shapes at the same data offsets), for SafetensorsWriter's
    `align_like`; files that mirror none (resharded, cast) are absent."""
    out: dict[str, int] = {}
    if len(layout) != len(base.files):
        return out
    for (fname, tensors), h in zip(layout.items(), base.files):
        if _mirrors(tensors, h):
            out[fname] = h.data_start
            continue
        offset, same = 0, len(tensors) == len(h.tensors)  # the definition, tensor by tensor
        for o, t in zip(tensors, h.tensors):
            same = same and (o.name, o.dtype, tuple(o.shape)) == (t.name, t.dtype, tuple(t.shape)) \
                and t.begin - h.data_start == offset
            offset += ITEMSIZE[o.dtype] * prod(o.shape)
        if same:
            out[fname] = h.data_start
    return out


def _mirrors(tensors: list[OutTensor], h) -> bool:
    """base_alignment's test in whole-column steps (C speed at 100k tensors): True only where
    the tensor-by-tensor test is; False may still be a mirror by it (shapes as lists)."""
    table = h.table  # the file's tensors as columns (checkpoint/tensor_table.py)
    if len(tensors) != len(table) or tensors != list(zip(table.names, table.dtypes, table.shapes)):
        return False
    sizes = map(mul, map(ITEMSIZE.__getitem__, map(itemgetter(1), tensors)), map(prod, map(itemgetter(2), tensors)))
    return list(map(sub, table.begins, repeat(h.data_start))) == [0, *accumulate(sizes)][:-1]


def output_layout(base: Checkpoint, *, dtype: str | None, shard_bytes: int | None) -> dict[str, list[OutTensor]]:
    """Output file name -> tensors, mirroring the base's sharding (and its shard names, where
    `usable_shard_names`) unless shard_bytes is set."""
    def out(t: TensorInfo) -> OutTensor:
        d = OUT_DTYPES[dtype] if dtype and t.dtype in FLOAT_DTYPES else t.dtype
        return OutTensor(t.name, d, t.shape)

    def outs(table) -> list[OutTensor]:  # a TensorTable's tensors (checkpoint/tensor_table.py)
        if not dtype:  # each OutTensor(name, dtype, shape) from the columns, without a Python call each
            return list(map(tuple.__new__, repeat(OutTensor), zip(table.names, table.dtypes, table.shapes)))
        return [out(t) for t in table.values()]

    if shard_bytes is None:
        if len(base.files) == 1:
            return {"model.safetensors": outs(base.tensors)}
        names = [h.path.name for h in base.files]
        if not usable_shard_names(names):  # README.md, config.json, a/x + b/x, ...: names of our own
            n = len(names)
            names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        return {name: outs(h.table) for name, h in zip(names, base.files)}
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in base.tensors.values():
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
