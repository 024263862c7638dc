"""The store's binary file format for ModelIndex and DeltaIndex (version 1).

Loads in O(blocks) with no parsing of per-block data: a small JSON header (one entry
per tensor: its name and integer sizes) and then little-endian arrays that are cast
in place (`memoryview.cast`, no numpy: a cached `mergepipe index` must not pay for
importing it) and cut per tensor.

    offset 0   8 bytes   magic b"MPINDEX\\0"
           8   4 bytes   u32 format version (VERSION)
          12   4 bytes   u32 kind (1 model index, 2 delta index)
          16   8 bytes   u64 header length H
          24   H bytes   JSON header: {"meta": {...}, "tensors": [[name, ints...], ...],
                         "arrays": {name: [offset, count, typecode]}}
               ...       arrays, each at an 8-aligned offset (from the file start)
         end  32 bytes   blake3 of every byte before it

Model index arrays: `ranges` (q: row start, row end per block), `hashes` (B: 32-byte
blake3 digests per block). Delta index arrays: `scalars` (d: l1, l2, base_sq,
expert_sq, dot per tensor), per block `block_l2`, `block_max` (d), `block_nnz` (q),
`identical` (B: 0/1), per rank `ranks`, `count_gt`, `count_eq` (q) and `values`
(d, +inf at rank 0), and the split-run counts `block_eq_keys` (q: the rank
positions) with `block_eq` (q: one count per block of the tensor for each key).

Anything else is not ours: `decode_*` raise BinFormatError on a wrong magic, version
or kind, a bad checksum, a header that does not parse, or sizes and offsets that do
not add up; the store then treats the file as a cache miss.
"""
from __future__ import annotations

import json
import struct
import sys
from itertools import chain

from blake3 import blake3

from mergepipe.index.columns import BlockEq, DeltaColumns, ModelColumns  # noqa: F401 (BlockEq: re-exported)
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.util.gcpause import paused_gc

MAGIC = b"MPINDEX\0"
VERSION = 1
KIND_MODEL, KIND_DELTA = 1, 2
_PREFIX = struct.Struct("<8sIIQ")
_DIGEST = 32
_ITEM = {"q": 8, "d": 8, "B": 1}
_LITTLE = sys.byteorder == "little"


class BinFormatError(ValueError):
    """Not a well-formed index file of this version."""


def _encode(kind: int, meta: dict, tensors: list, arrays: dict[str, tuple[str, object]]) -> bytes:
    import array
    blobs, layout = [], {}
    header_guess = 0
    for name, (code, values) in arrays.items():
        a = array.array(code, values)
        if not _LITTLE:
            a.byteswap()
        blobs.append((name, code, len(a), a.tobytes()))
    # the header names the arrays' offsets, which depend on its own length: settle both
    while True:
        pos = _align(_PREFIX.size + header_guess)
        layout = {}
        for name, code, count, data in blobs:
            layout[name] = [pos, count, code]
            pos = _align(pos + len(data))
        header = json.dumps({"meta": meta, "tensors": tensors, "arrays": layout}, separators=(",", ":"),
                            allow_nan=False).encode()
        if len(header) <= header_guess:
            break
        header_guess = len(header) + 64
    header = header.ljust(header_guess, b" ")
    out = bytearray(_PREFIX.pack(MAGIC, VERSION, kind, len(header)))
    out += header
    for name, code, count, data in blobs:
        out += b"\0" * (layout[name][0] - len(out))
        out += data
    out += b"\0" * (_align(len(out)) - len(out))
    out += blake3(out).digest()
    return bytes(out)


def _align(n: int) -> int:
    return (n + 7) & ~7


class _File:
    """A decoded container: header and the arrays as typed views of the file's bytes."""

    def __init__(self, data: bytes, kind: int) -> None:
        if len(data) < _PREFIX.size + _DIGEST:
            raise BinFormatError("truncated")
        magic, version, got_kind, hlen = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != VERSION or got_kind != kind:
            raise BinFormatError("not an index file of this version and kind")
        body = memoryview(data)[:-_DIGEST]
        if blake3(body).digest() != data[-_DIGEST:]:
            raise BinFormatError("checksum mismatch")
        if _PREFIX.size + hlen > len(body):
            raise BinFormatError("header runs past the end")
        try:
            head = json.loads(bytes(body[_PREFIX.size:_PREFIX.size + hlen]))
        except (ValueError, RecursionError) as e:
            raise BinFormatError(f"header: {e}") from None
        if not isinstance(head, dict) or not isinstance(head.get("arrays"), dict) \
                or not isinstance(head.get("tensors"), list) or not isinstance(head.get("meta"), dict):
            raise BinFormatError("header fields")
        self.meta, self.tensors = head["meta"], head["tensors"]
        self.arrays: dict[str, list] = {}
        self.raw: dict[str, memoryview] = {}
        for name, spec in head["arrays"].items():
            if not (isinstance(spec, list) and len(spec) == 3 and spec[2] in _ITEM
                    and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in spec[:2])):
                raise BinFormatError(f"array {name!r}: bad spec")
            off, count, code = spec
            end = off + count * _ITEM[code]
            if off < _PREFIX.size + hlen or off % 8 or end > len(body):
                raise BinFormatError(f"array {name!r}: out of range")
            # a copy of the array's bytes: views of `data` would keep the whole file alive,
            # its JSON header (a row per tensor, megabytes at 100k) included
            view = memoryview(bytes(body[off:end]))
            self.raw[name] = view
            if code != "B":
                if _LITTLE:
                    self.arrays[name] = view.cast(code)  # cut per tensor on demand (index/columns.py)
                else:  # pragma: no cover (big-endian hosts)
                    import array
                    a = array.array(code, bytes(view))
                    a.byteswap()
                    self.arrays[name] = a.tolist()

    def array(self, name: str, n: int) -> list:
        a = self.arrays.get(name)
        if a is None or len(a) != n:
            raise BinFormatError(f"array {name!r}: expected {n} items")
        return a

    def bytes_of(self, name: str, n: int) -> memoryview:
        v = self.raw.get(name)
        if v is None or len(v) != n:
            raise BinFormatError(f"array {name!r}: expected {n} bytes")
        return v


def _emb_meta(index) -> dict:
    """`embedding_block_bytes` only when set, so plain-layout files keep their bytes."""
    emb = index.embedding_block_bytes
    return {} if emb is None else {"embedding_block_bytes": emb}


def _emb_of(meta: dict) -> int | None:
    emb = meta.get("embedding_block_bytes")
    if emb is not None and (not isinstance(emb, int) or isinstance(emb, bool) or emb <= 0):
        raise BinFormatError("meta")
    return emb


def encode_model(index: ModelIndex) -> bytes:
    tensors, ranges, hashes = [], [], bytearray()
    for t in index.tensors.values():
        tensors.append([t.name, t.dtype, list(t.shape), len(t.ranges)])
        for a, b in t.ranges:
            ranges += (a, b)
        for h in t.hashes:
            hashes += bytes.fromhex(h)
    meta = {"content_hash": index.content_hash, "block_bytes": index.block_bytes, **_emb_meta(index)}
    return _encode(KIND_MODEL, meta, tensors, {"ranges": ("q", ranges), "hashes": ("B", hashes)})


def decode_model(data: bytes) -> ModelIndex:
    with paused_gc():  # a row and a column item per tensor, no cycles (util/gcpause.py)
        return _decode_model(data)


def _decode_model(data: bytes) -> ModelIndex:
    f = _File(data, KIND_MODEL)
    try:
        content, bb = f.meta["content_hash"], f.meta["block_bytes"]
        emb = _emb_of(f.meta)
        if not isinstance(content, str) or not isinstance(bb, int):
            raise BinFormatError("meta")
        names, dtypes, shapes, counts = _columns(f.tensors, 4)
        # whole columns checked at once (C-speed passes; one Python step per tensor was most of a load)
        if not (_all_type(names, str) and _all_type(dtypes, str) and _all_type(shapes, list)
                and _all_type(counts, int) and min(counts, default=0) >= 0):
            raise BinFormatError("tensor entry")
        dims = list(chain.from_iterable(shapes))
        if not (_all_type(dims, int) and min(dims, default=0) >= 0):
            raise BinFormatError("tensor entry")
        total = sum(counts)
        ranges = f.array("ranges", 2 * total)
        digests = f.bytes_of("hashes", _DIGEST * total)
        # one object per distinct dtype and shape (a checkpoint of 100k tensors has a few dozen)
        dtype_of, shape_of = {d: d for d in set(dtypes)}, {}
        shapes = [shape_of.setdefault(sh, sh) for sh in map(tuple, shapes)]
        tensors = ModelColumns(names, list(map(dtype_of.__getitem__, dtypes)), shapes, counts, ranges, digests)
    except (KeyError, TypeError, ValueError) as e:
        raise BinFormatError(f"fields: {e}") from None
    return ModelIndex(content, bb, tensors, emb)


def _columns(rows: object, width: int) -> list[list]:
    """The header's tensor rows (lists of `width` items) as `width` columns."""
    if not (isinstance(rows, list) and _all_type(rows, list) and set(map(len, rows)) <= {width}):
        raise BinFormatError("tensor entry")
    return [list(c) for c in zip(*rows)] if rows else [[] for _ in range(width)]


def _all_type(items: list, kind: type) -> bool:
    """Every item is exactly of type `kind` (so no bool for int)."""
    return set(map(type, items)) <= {kind}


def encode_delta(delta: DeltaIndex) -> bytes:
    tensors = []
    arr: dict[str, list] = {k: [] for k in ("scalars", "block_l2", "block_max", "block_nnz", "identical", "ranks",
                                            "values", "count_gt", "count_eq", "block_eq_keys", "block_eq")}
    for t in delta.tensors.values():
        nb, nr = len(t.block_l2), len(t.ranks)
        keys = sorted(t.block_eq)
        tensors.append([t.name, t.numel, t.nonfinite, nb, nr, len(keys)])
        arr["scalars"] += (t.l1, t.l2, t.base_sq, t.expert_sq, t.dot)
        arr["block_l2"] += t.block_l2
        arr["block_max"] += t.block_max
        arr["block_nnz"] += t.block_nnz
        arr["identical"] += (1 if x else 0 for x in t.identical)
        arr["ranks"] += t.ranks
        arr["values"] += t.values
        arr["count_gt"] += t.count_gt
        arr["count_eq"] += t.count_eq
        for k in keys:
            arr["block_eq_keys"].append(k)
            arr["block_eq"] += t.block_eq[k]
    codes = {"scalars": "d", "block_l2": "d", "block_max": "d", "values": "d", "identical": "B"}
    meta = {"expert_hash": delta.expert_hash, "base_hash": delta.base_hash, "block_bytes": delta.block_bytes,
            **_emb_meta(delta)}
    return _encode(KIND_DELTA, meta, tensors, {k: (codes.get(k, "q"), v) for k, v in arr.items()})


def decode_delta(data: bytes) -> DeltaIndex:
    with paused_gc():
        return _decode_delta(data)


def _decode_delta(data: bytes) -> DeltaIndex:
    f = _File(data, KIND_DELTA)
    try:
        meta = f.meta
        eh, bh, bb = meta["expert_hash"], meta["base_hash"], meta["block_bytes"]
        emb = _emb_of(meta)
        if not (isinstance(eh, str) and isinstance(bh, str) and isinstance(bb, int)):
            raise BinFormatError("meta")
        names, *sizes = _columns(f.tensors, 6)
        if not (_all_type(names, str) and all(_all_type(c, int) and min(c, default=0) >= 0 for c in sizes)):
            raise BinFormatError("tensor entry")
        arrays = {k: f.arrays.get(k) for k in ("scalars", "block_l2", "block_max", "block_nnz", "ranks", "values",
                                               "count_gt", "count_eq")}
        arrays["eq_keys"], arrays["eq"] = f.arrays.get("block_eq_keys"), f.arrays.get("block_eq")
        arrays["identical"] = f.raw.get("identical")
        if any(v is None for v in arrays.values()):
            raise BinFormatError("missing array")
        tensors = DeltaColumns(names, *sizes, arrays)
    except (KeyError, TypeError, ValueError) as e:
        raise BinFormatError(f"fields: {e}") from None
    return DeltaIndex(eh, bh, bb, tensors, emb)
