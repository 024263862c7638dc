#!/usr/bin/env python3
"""Check a mergepipe output folder against its manifest.json without mergepipe.

Written from docs/design.md ("Checking a manifest without mergepipe") alone, with the Python
standard library and the `blake3` package, so an auditor need not trust mergepipe's code: it
recomputes manifest_hash and plan_hash, checks that the folder holds exactly the recorded files,
and rehashes every file (weight files as block hash trees, each tensor named when it differs).
It proves the folder is the one its manifest describes, as `mergepipe verify --deep` does; not
that the manifest is true (that takes a replay from the inputs, or a signature you trust).

Without blake3 it can check only the structure: the file list, sizes, safetensors headers and
that each tensor's blocks add up to its bytes; no hash. It then says so and exits 3.

Usage: python scripts/check_manifest.py OUT
Exit: 0 the folder matches its manifest; 1 it does not (the first difference is named); 3 no blake3.
"""
from __future__ import annotations

import json
import struct
import sys
from math import prod
from pathlib import Path

try:
    from blake3 import blake3
except ImportError:
    blake3 = None

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
VOCAB_MODULES = {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out",
                 "tok_embeddings"}
MANIFEST, SIGNATURE = "manifest.json", "model.sig"
ADAPTER_KIND = "peft-lora-adapter"  # an adapter output's manifest: no plan, tensors hashed whole
CHUNK = 8 << 20


class Mismatch(Exception):
    """The folder is not the one its manifest describes."""


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def hash_without(doc: dict, key: str) -> str:
    """blake3 hex of the canonical JSON of `doc` without `key`: how manifest_hash and plan_hash are made."""
    return blake3(canonical({k: v for k, v in doc.items() if k != key})).hexdigest()


def digest(data: bytes) -> bytes:
    return blake3(data).digest()


def block_size(name: str, shape: list[int], plan: dict) -> int:
    """The plan's embedding_block_bytes for a vocabulary tensor when the plan has one, else block_bytes."""
    parts = name.split(".")
    vocab = (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in VOCAB_MODULES
             and len(shape) == 2 and shape[0] > shape[1] > 0)
    emb = plan.get("embedding_block_bytes")
    return emb if vocab and emb else plan["block_bytes"]


def block_lengths(shape: list[int], itemsize: int, block: int) -> list[int]:
    """Byte length of each block: whole rows (first dimension), as many as fit in `block` (at least one)."""
    rows = shape[0] if shape else 1
    row = prod(shape[1:]) * itemsize
    if len(shape) <= 1 or row == 0:
        return [rows * row] if rows > 0 else []
    per = max(1, block // row)
    return [(min(rows, start + per) - start) * row for start in range(0, rows, per)]


def hash_run(f, length: int) -> bytes:
    h = blake3()
    while length > 0:
        data = f.read(min(CHUNK, length))
        if not data:
            raise Mismatch(f"{f.name}: shorter than its header says")
        h.update(data)
        length -= len(data)
    return h.digest()


def check_weight_file(path: Path, rec: dict, plan: dict, tensors: dict[str, str]) -> list[str]:
    """Rehash a safetensors file as its block tree; the names of its tensors."""
    size = path.stat().st_size
    if "size" in rec and size != rec["size"]:
        raise Mismatch(f"{path}: size {size} is not the manifest's {rec['size']}")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))[0]
        if n > 100_000_000 or 8 + n > size:
            raise Mismatch(f"{path}: header length {n} does not fit the file")
        head = f.read(n)
        entries = sorted((v["data_offsets"][0], v["data_offsets"][1], k, v)
                         for k, v in json.loads(head).items() if k != "__metadata__")
        digests = []
        for begin, end, name, v in entries:
            lengths = block_lengths(v["shape"], ITEMSIZE[v["dtype"]], block_size(name, v["shape"], plan))
            if sum(lengths) != end - begin or 8 + n + end > size:
                raise Mismatch(f"{path}: tensor {name!r}: its offsets do not hold its dtype and shape")
            if blake3 is None:
                continue
            f.seek(8 + n + begin)
            tensor = digest(b"".join(hash_run(f, length) for length in lengths))
            if tensors.get(name) != tensor.hex():
                raise Mismatch(f"{path}: tensor {name!r} does not match the manifest")
            digests.append(tensor)
    tree = None if blake3 is None else digest(digest(struct.pack("<Q", n) + head) + b"".join(digests)).hex()
    if tree is not None and tree != rec["tree"]:
        raise Mismatch(f"{path}: header or padding does not match the manifest")
    return [name for _, _, name, _ in entries]


def check_adapter_tensors(path: Path, tensors: dict[str, str]) -> list[str]:
    """An adapter output's safetensors file: each tensor's bytes, whole, against its blake3; the names."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))[0]
        if n > 100_000_000 or 8 + n > size:
            raise Mismatch(f"{path}: header length {n} does not fit the file")
        entries = sorted((v["data_offsets"][0], v["data_offsets"][1], k, v)
                         for k, v in json.loads(f.read(n)).items() if k != "__metadata__")
        for begin, end, name, v in entries:
            if prod(v["shape"]) * ITEMSIZE[v["dtype"]] != end - begin or 8 + n + end > size:
                raise Mismatch(f"{path}: tensor {name!r}: its offsets do not hold its dtype and shape")
            if blake3 is None:
                continue
            f.seek(8 + n + begin)
            if tensors.get(name) != blake3(f.read(end - begin)).hexdigest():
                raise Mismatch(f"{path}: tensor {name!r} does not match the manifest")
    return [name for _, _, name, _ in entries]


def check_file(path: Path, rec: dict) -> None:
    if "size" in rec and path.stat().st_size != rec["size"]:
        raise Mismatch(f"{path}: size {path.stat().st_size} is not the manifest's {rec['size']}")
    if blake3 is not None:
        h = blake3()
        with open(path, "rb") as f:
            while data := f.read(CHUNK):
                h.update(data)
        if h.hexdigest() != rec["blake3"]:
            raise Mismatch(f"{path}: its blake3 is not the manifest's (edited?)")


def _one_value_per_key(pairs: list) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key[:60]!r}{'...' if len(key) > 60 else ''}")
        seen.add(key)
    return dict(pairs)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


def load_manifest(out: Path) -> dict:
    """manifest.json, read one way only: a duplicate key (which JSON parsers resolve differently)
    or NaN/Infinity (which the canonical form refuses) is a Mismatch, as is JSON nested past
    Python's recursion limit."""
    path = out / MANIFEST
    try:
        man = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_one_value_per_key,
                         parse_constant=_not_json)
    except (ValueError, RecursionError) as e:
        raise Mismatch(f"{path}: not valid JSON: {e}") from None
    if not isinstance(man, dict):
        raise Mismatch(f"{path}: not a JSON object")
    return man


def check(out: Path) -> str:
    man = load_manifest(out)
    adapter = man.get("kind") == ADAPTER_KIND
    plan = None if adapter else man["plan"]
    files, tensors = man["outputs"]["files"], man["outputs"]["tensors"]
    if blake3 is not None:
        if hash_without(man, "manifest_hash") != man["manifest_hash"]:
            raise Mismatch(f"{out / MANIFEST}: manifest_hash does not match its content")
        if not adapter and (hash_without(plan, "plan_hash") != plan["plan_hash"]
                            or plan["plan_hash"] != man["plan_hash"]):
            raise Mismatch(f"{out / MANIFEST}: plan_hash does not match the recorded plan")
    present = {p.name for p in out.iterdir() if p.is_file()} - {MANIFEST, SIGNATURE}
    odd = sorted(present ^ set(files))
    if odd:
        what = "not recorded in the manifest" if odd[0] in present else "missing"
        raise Mismatch(f"{out / odd[0]}: {what}")
    found: list[str] = []
    for name, rec in sorted(files.items()):
        if "tree" in rec:
            found += check_weight_file(out / name, rec, plan, tensors)
        else:
            if adapter and name.endswith(".safetensors"):  # first, to name a changed tensor
                found += check_adapter_tensors(out / name, tensors)
            check_file(out / name, rec)
    if sorted(found) != sorted(tensors):
        odd = sorted(set(found) ^ set(tensors)) or ["(a tensor in two files)"]
        raise Mismatch(f"{out}: tensor {odd[0]!r} is not in exactly one weight file and the manifest")
    return f"{out}: OK ({len(files)} files, {len(tensors)} tensors; manifest {man['manifest_hash'][:16]})"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/check_manifest.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    try:
        line = check(out)
    except Mismatch as e:
        print(f"MISMATCH: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        print(f"MISMATCH: {out}: not a readable mergepipe output ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    if blake3 is None:
        print(f"{line.replace(': OK', ': structure OK')}; no hash checked: pip install blake3",
              file=sys.stderr)
        return 3
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
