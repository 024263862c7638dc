"""The layout of the cache's trailed files (sketches, group-quantized deltas):

    payloads | header (canonical JSON) | u64 little-endian header length | 8-byte magic

A reader finds the header from the file's end, so payloads are written as they are made and the
header (their offsets and hashes) last. Trailed files are untrusted cache input: a file without
this trailer, or whose header length runs past the file or MAX_HEADER, has no header.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

from blake3 import blake3

from mergepipe.errors import IntegrityError

MAX_HEADER = 1 << 31
_TAIL = 16  # u64 length + magic


def trailer(header: bytes, magic: bytes) -> bytes:
    """What follows the payloads: the header, its length, the magic."""
    return header + struct.pack("<Q", len(header)) + magic


def find(f: BinaryIO, size: int, magic: bytes) -> tuple[int, int] | None:
    """(header offset, header length) from an open file's trailer, or None if it has none."""
    if size < _TAIL:
        return None
    f.seek(size - _TAIL)
    (hlen,), found = struct.unpack("<Q", f.read(8)), f.read(8)
    if found != magic or hlen > min(MAX_HEADER, size - _TAIL):
        return None
    return size - _TAIL - hlen, hlen


def read_header(path: Path, magic: bytes, what: str, missing: str) -> tuple[int, bytes, object]:
    """(header offset, header bytes, the header parsed) of a trailed file; a one-line
    IntegrityError naming `path` as not a valid `what` file (`missing`: the reason when it has no
    trailer) when it has no trailer or its header is not JSON. The parsed header is unchecked."""
    try:
        with open(path, "rb") as f:
            found = find(f, os.fstat(f.fileno()).st_size, magic)
            if found is None:
                raise ValueError(missing)
            f.seek(found[0])
            raw = f.read(found[1])
        return found[0], raw, json.loads(raw)
    except (OSError, ValueError, struct.error) as e:
        raise IntegrityError(f"{path}: not a valid {what} file ({e}); delete it") from None


def header_digest(path: Path, magic: bytes) -> str | None:
    """The blake3 of a trailed file's header, or None for any other file."""
    try:
        with open(path, "rb") as f:
            found = find(f, os.fstat(f.fileno()).st_size, magic)
            if found is None:
                return None
            f.seek(found[0])
            return blake3(f.read(found[1])).hexdigest()
    except OSError:
        return None
