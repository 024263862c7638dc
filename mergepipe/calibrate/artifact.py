"""The importance artifact: a factored diagonal Fisher of the base, F_ij ~ rows_i * cols_j.

File format: a safetensors file (written by our writer) with two F32 vectors per covered
tensor, `<tensor>::rows` (length shape[0]) and `<tensor>::cols` (length prod(shape[1:]),
1 for 1-D tensors), and metadata {format, base, text, recipe, key, sequences, tokens, vectors}
(`key`: the file's own store key, so a copy under another key is refused on load).
`vectors` is the blake3 of every vector's name and bytes (`vectors_hash`), so an edit that
keeps the file well-formed (a changed value, a swapped vector) is caught on load. Stored
under `<cache>/calibration/<key>.safetensors`, key = blake3(base content hash, text blake3,
recipe JSON, format); its own blake3 (`artifact_hash`) goes into the plan, so a plan names
exactly the importance it was made with.

Loading treats the file as untrusted: its vectors must hash to `vectors`, and every one
must name a float tensor of the base, have its length, and hold only finite, non-negative
values.
"""
from __future__ import annotations

import math
import uuid
from pathlib import Path

import numpy as np
from blake3 import blake3

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, OutTensor, SafetensorsWriter, parse_header
from mergepipe.errors import IntegrityError
from mergepipe.index.cache import CacheLayout
from mergepipe.util.fs import canonical_json, fsync_dir, hash_file

ARTIFACT_FORMAT = "mergepipe-importance-2"  # 2: the `vectors` checksum
Importance = dict[str, tuple[np.ndarray, np.ndarray]]


def artifact_path(cache: Path, base_hash: str, text_hash: str, recipe: dict) -> Path:
    key = blake3(canonical_json([ARTIFACT_FORMAT, base_hash, text_hash, recipe])).hexdigest()[:40]
    return CacheLayout(cache).calibration(key)


def vector_lengths(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a tensor as the artifact factors it; 0-d tensors are 1 x 1."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1


def vectors_hash(vectors: dict[str, np.ndarray]) -> str:
    """blake3 over (name, length, little-endian F32 bytes) of every vector, in name order."""
    h = blake3()
    for name in sorted(vectors):
        v = np.ascontiguousarray(vectors[name], dtype="<f4")
        h.update(canonical_json([name, int(v.size)]))
        h.update(memoryview(v).cast("B"))
    return h.hexdigest()


def save(path: Path, importance: Importance, metadata: dict[str, str]) -> None:
    """Write the artifact atomically (temp name, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, data = [], []
    for name in sorted(importance):
        rows, cols = importance[name]
        for suffix, v in (("rows", rows), ("cols", cols)):
            tensors.append(OutTensor(f"{name}::{suffix}", "F32", (v.size,)))
            data.append(np.ascontiguousarray(v, dtype=np.float32))
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # unique: concurrent writers never share it
    digest = vectors_hash({t.name: v for t, v in zip(tensors, data)})
    writer = SafetensorsWriter(tmp, tensors, metadata={"format": ARTIFACT_FORMAT, **metadata, "vectors": digest})
    try:
        for t, v in zip(tensors, data):
            writer.write_rows(t.name, 0, memoryview(v).cast("B"))
        writer.close()
        tmp.replace(path)
        fsync_dir(path.parent)
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise


def artifact_hash(path: Path) -> str:
    return hash_file(path)


def load(path: Path, base: Checkpoint, expect: dict[str, str] | None = None) -> Importance:
    """The artifact's vectors, checked against the base and, when given, `expect`: metadata
    values it must carry (the base's and text's hashes a file at this key was made from;
    IntegrityError names what is wrong)."""
    header = _checked_header(path, expect)
    raw = _vectors(path, header)
    if vectors_hash(raw) != header.metadata.get("vectors"):  # edited or damaged in place: never used
        raise IntegrityError(f"{path}: its vectors do not match their recorded blake3 (metadata vectors); "
                             "damaged or edited; delete it")
    return _pair_with_base(path, raw, base)


def _checked_header(path: Path, expect: dict[str, str] | None):
    """The artifact's header, its format and the metadata `expect` names checked."""
    try:
        header = parse_header(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is the same verdict
        raise IntegrityError(f"{path}: not a readable importance artifact ({e}); delete it") from None
    if header.metadata.get("format") != ARTIFACT_FORMAT:
        raise IntegrityError(f"{path}: not a mergepipe importance artifact (format "
                             f"{header.metadata.get('format')!r}); delete it")
    for key, want in (expect or {}).items():
        if header.metadata.get(key) != want:
            raise IntegrityError(f"{path}: metadata {key} is {header.metadata.get(key)!r}, not {want!r}; "
                                 "made from other inputs; delete it")
    return header


def _vectors(path: Path, header) -> dict[str, np.ndarray]:
    """Every entry as a finite, non-negative F32 vector."""
    raw: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        for t in header.tensors:
            if t.dtype != "F32" or len(t.shape) != 1:
                raise IntegrityError(f"{path}: {t.name!r} is not an F32 vector")
            f.seek(t.begin)
            v = np.frombuffer(f.read(t.nbytes), dtype="<f4")
            if v.size != t.shape[0] or not np.all(np.isfinite(v)) or np.any(v < 0):
                raise IntegrityError(f"{path}: {t.name!r} has non-finite or negative values")
            raw[t.name] = v
    return raw


def _pair_with_base(path: Path, raw: dict[str, np.ndarray], base: Checkpoint) -> Importance:
    """`name::rows` and `name::cols` paired per float tensor of the base, their lengths its shape's."""
    out: Importance = {}
    for key in raw:
        name, _, suffix = key.rpartition("::")
        if suffix not in ("rows", "cols"):
            raise IntegrityError(f"{path}: unexpected entry {key!r}")
        if suffix == "cols":
            continue
        t = base.tensors.get(name)
        cols = raw.get(f"{name}::cols")
        if t is None or t.dtype not in FLOAT_DTYPES or cols is None:
            raise IntegrityError(f"{path}: {name!r} is not a float tensor of base {base.root}")
        if (raw[key].size, cols.size) != vector_lengths(t.shape):
            raise IntegrityError(f"{path}: {name!r}: vectors of {raw[key].size} x {cols.size} for shape "
                                 f"{list(t.shape)}")
        out[name] = (raw[key], cols)
    for key in raw:
        if key.endswith("::cols") and key[:-6] not in out:
            raise IntegrityError(f"{path}: {key!r} has no rows vector")
    return out
