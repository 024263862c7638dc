"""The joint-statistics artifact: a family's per-tensor fp64 statistics for one method
(methods/joint.py declares them, engine/stats.py computes them), content-addressed in
the store as `joint/<key>.stats`.

    offset 0   8 bytes   magic b"MPJOINT\\0"
           8   4 bytes   u32 format version (VERSION)
          12   4 bytes   u32 reserved (0)
          16   8 bytes   u64 header length H
          24   H bytes   JSON header {"key": hex, "method": str,
                         "tensors": [[name, offset, count], ...]}, then spaces to an
                         8-aligned data start; offsets are bytes from the data start
               ...       fp64 little-endian arrays, back to back
         end  32 bytes   blake3 of every byte before it

`decode` checks the magic, version, checksum and that the arrays tile the data; the
caller then checks the key, the tensor names and every count against what it expects
(untrusted input: anything off is a cache miss and the statistics are recomputed).
No numpy here: arrays come back as `memoryview.cast("d")`.
"""
from __future__ import annotations

import json
import struct
import sys

from blake3 import blake3

MAGIC = b"MPJOINT\0"
VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")
_DIGEST = 32


class JointFormatError(ValueError):
    """Not a well-formed joint-statistics file of this version."""


def encode(key: str, method: str, tensors: dict[str, bytes]) -> bytes:
    """`tensors`: name -> fp64 values as little-endian bytes, in the order to store."""
    entries, offset = [], 0
    for name, data in tensors.items():
        if len(data) % 8:
            raise ValueError(f"tensor {name!r}: {len(data)} bytes is not a whole number of fp64 values")
        entries.append([name, offset, len(data) // 8])
        offset += len(data)
    header = json.dumps({"key": key, "method": method, "tensors": entries},
                        sort_keys=True, separators=(",", ":")).encode()
    pad = (-(_PREFIX.size + len(header))) % 8
    body = bytearray(_PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header + b" " * pad)
    for data in tensors.values():
        body += data if sys.byteorder == "little" else _swap(data)
    return bytes(body + blake3(bytes(body)).digest())


def _swap(data: bytes) -> bytes:
    b = bytearray(data)
    for i in range(0, len(b), 8):
        b[i:i + 8] = b[i:i + 8][::-1]
    return bytes(b)


def decode(data: bytes) -> tuple[str, str, dict[str, memoryview]]:
    """(key, method, name -> fp64 values) of a joint-statistics file, or JointFormatError."""
    if len(data) < _PREFIX.size + _DIGEST:
        raise JointFormatError("too short")
    magic, version, _, hlen = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise JointFormatError("not a joint-statistics file of this version")
    if blake3(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise JointFormatError("checksum mismatch")
    end = len(data) - _DIGEST
    if _PREFIX.size + hlen > end:
        raise JointFormatError("header outside the file")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
        key, method, entries = header["key"], header["method"], header["tensors"]
    except (ValueError, KeyError, TypeError) as e:
        raise JointFormatError(f"bad header: {e}") from None
    if not isinstance(key, str) or not isinstance(method, str) or not isinstance(entries, list):
        raise JointFormatError("bad header types")
    view = memoryview(data)
    out: dict[str, memoryview] = {}
    data_start = _PREFIX.size + hlen
    data_start += (-data_start) % 8
    pos = data_start
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in entry[1:])):
            raise JointFormatError("bad tensor entry")
        name, offset, count = entry
        offset += data_start
        if name in out or offset != pos or count < 0 or offset + 8 * count > end:
            raise JointFormatError(f"tensor {name!r}: arrays do not tile the data")
        raw = view[offset:offset + 8 * count]
        out[name] = raw.cast("d") if sys.byteorder == "little" else memoryview(_swap(bytes(raw))).cast("d")
        pos = offset + 8 * count
    if pos != end:
        raise JointFormatError("trailing bytes before the checksum")
    return key, method, out
