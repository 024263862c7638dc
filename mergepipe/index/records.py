"""The index records: ModelIndex (per-block hashes of one checkpoint) and DeltaIndex (an
expert against a base), the content hash, and a JSON dump (to_json, for comparisons). An
index as readers get it holds columns (index/columns.py) as its `tensors`; the dicts of
TensorEntry / TensorDelta here are what index/build.py fills and index/binfmt.py encodes."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from json.encoder import encode_basestring_ascii as _esc

from blake3 import blake3

from mergepipe.checkpoint.blocks import BlockLayout


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelIndex:
    content_hash: str
    block_bytes: int
    tensors: dict[str, TensorEntry]  # checkpoint order
    embedding_block_bytes: int | None = None  # vocabulary tensors' block size, when not block_bytes

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.block_bytes, self.embedding_block_bytes)

    def to_json(self) -> dict:
        return {"content_hash": self.content_hash, "block_bytes": self.block_bytes,
                **_emb_json(self.embedding_block_bytes),
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                             "ranges": [list(r) for r in t.ranges], "hashes": list(t.hashes)}
                            for t in self.tensors.values()]}


@dataclass(frozen=True, slots=True)
class TensorDelta:
    name: str
    numel: int
    l1: float
    l2: float
    nonfinite: int
    block_l2: tuple[float, ...]
    block_max: tuple[float, ...]
    block_nnz: tuple[int, ...]
    identical: tuple[bool, ...]
    ranks: tuple[int, ...]
    values: tuple[float, ...]  # |delta| at each rank (inf for rank 0)
    count_gt: tuple[int, ...]  # elements with |delta| > value
    count_eq: tuple[int, ...]  # elements with |delta| == value
    # rank position -> per-block count of elements == value; only where a cut
    # splits a run of equal values (0 < rank - count_gt < count_eq)
    block_eq: dict[int, tuple[int, ...]]
    # whole-tensor sums (fp64, in a fixed order: kernels.slerp_sums) that give slerp its angle
    base_sq: float = 0.0
    expert_sq: float = 0.0
    dot: float = 0.0


@dataclass(frozen=True, slots=True)
class DeltaIndex:
    expert_hash: str
    base_hash: str
    block_bytes: int
    tensors: dict[str, TensorDelta]
    embedding_block_bytes: int | None = None  # as ModelIndex's

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.block_bytes, self.embedding_block_bytes)

    def to_json(self) -> dict:
        out = []
        for t in self.tensors.values():
            d = {f: getattr(t, f) for f in TensorDelta.__slots__}
            d["block_eq"] = {str(k): list(v) for k, v in sorted(t.block_eq.items())}
            d["values"] = [_enc_float(v) for v in t.values]
            out.append({k: list(v) if isinstance(v, tuple) else v for k, v in d.items()})
        return {"expert_hash": self.expert_hash, "base_hash": self.base_hash,
                "block_bytes": self.block_bytes, **_emb_json(self.embedding_block_bytes), "tensors": out}


def _emb_json(embedding_block_bytes: int | None) -> dict:
    """The key only when set: plain-layout records keep their bytes."""
    return {} if embedding_block_bytes is None else {"embedding_block_bytes": embedding_block_bytes}


def _enc_float(v: float) -> float | str:
    return v if math.isfinite(v) else repr(v)


def content_hash(tensors: dict[str, TensorEntry]) -> str:
    """blake3 over (name, dtype, shape, block hashes) in name order: sharding-independent."""
    h = blake3()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(_row_json(name, t).encode() + b"\n")
    return h.hexdigest()


def _row_json(name: str, t: TensorEntry) -> str:
    """json.dumps([name, dtype, shape, hashes]), the same text, built from the C string
    escaper: one json.dumps per tensor was most of loading a cached index of 100k tensors."""
    if not (type(name) is type(t.dtype) is str and all(type(d) is int for d in t.shape)
            and all(type(x) is str for x in t.hashes)):
        return json.dumps([name, t.dtype, list(t.shape), list(t.hashes)])  # odd types: as they always were
    return f'[{_esc(name)}, {_esc(t.dtype)}, [{", ".join(map(str, t.shape))}], [{", ".join(map(_esc, t.hashes))}]]'
