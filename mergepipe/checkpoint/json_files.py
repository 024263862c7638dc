"""Small JSON files of a model or adapter folder (tokenizer and config files, adapter_config.json)
read as untrusted input: regular files only, a size limit checked before reading, duplicate
keys refused, one JSON object. The one owner of those rules."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from mergepipe.errors import ConfigError
from mergepipe.units import short_repr


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of regular file `path`, refused over `limit` bytes.

    Raises:
        ConfigError: not a regular file, unreadable, or too large.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO must not hang the open
    except OSError as e:
        raise ConfigError(f"{path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise ConfigError(f"{path}: {st.st_size} bytes, over the {limit}-byte limit for this file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(f"{path}: over the {limit}-byte limit for this file")
    return data


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {short_repr(key)}")
            seen.add(key)
    return out


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


def strict_loads(text: str) -> object:
    """JSON as RFC 8259 has it, for records a hash must cover exactly as read: duplicate keys
    (which parsers resolve differently) and NaN/Infinity (which no canonical form holds) raise
    ValueError."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_not_json)


def parse_json(data: bytes, path: Path) -> dict:
    """A JSON object from untrusted bytes (duplicate keys refused)."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: must be a JSON object, got {type(value).__name__}")
    return value
