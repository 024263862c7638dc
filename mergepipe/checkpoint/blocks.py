"""Row-range block layout and the block size. A block is a range of whole rows of one
tensor, so its bytes are one contiguous range in the file. Owns the block-size default,
range and parser (params.yaml, `mergepipe index --block-bytes`, the Snakemake rules) and
the row-bytes arithmetic. Pure arithmetic, no I/O."""
from __future__ import annotations

from math import prod
from typing import Any

from mergepipe.units import UnitError, parse_bytes, short_repr

DEFAULT_BLOCK_BYTES = 1 << 20
MIN_BLOCK_BYTES = 4 << 10
MAX_BLOCK_BYTES = 1 << 30


def parse_block_bytes(value: Any, *, what: str = "block_bytes") -> int:
    """A block size as written ("1MiB", 65536), within [4KiB, 1GiB].

    Raises:
        UnitError: not a size, or out of range (`detail` reads well after a key path).
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UnitError(what, f"must be a byte count or size like '1MiB', got {short_repr(value)}")
    size = parse_bytes(value, what=what)
    if not MIN_BLOCK_BYTES <= size <= MAX_BLOCK_BYTES:
        raise UnitError(what, f"must be between 4KiB and 1GiB, got {short_repr(value)} ({size} bytes)")
    return size


def num_rows(shape: tuple[int, ...] | list[int]) -> int:
    """Rows of a tensor: its first dimension; a 0-d tensor has one row."""
    return int(shape[0]) if len(shape) >= 1 else 1


def row_numel(shape: tuple[int, ...] | list[int]) -> int:
    """Elements per row (1 for 0-d and 1-d tensors' rows)."""
    return prod(shape[1:]) if len(shape) >= 1 else 1


def row_bytes(shape: tuple[int, ...] | list[int], itemsize: int) -> int:
    """Bytes per row: `row_numel(shape) * itemsize`."""
    return row_numel(shape) * itemsize


def block_ranges(shape: tuple[int, ...] | list[int], itemsize: int,
                 block_bytes: int) -> list[tuple[int, int]]:
    """Split a tensor into whole-row ranges of about `block_bytes` each.

    0-d and 1-d tensors are one block. A row larger than `block_bytes` is a block
    on its own. A tensor with zero rows has no blocks.
    """
    rows = num_rows(shape)
    if len(shape) <= 1 or row_numel(shape) == 0:  # [2**50, 0] is one (empty) block, never 2**38 of them
        return [(0, rows)] if rows > 0 else []
    per_block = max(1, block_bytes // max(1, row_bytes(shape, itemsize)))
    return [(start, min(rows, start + per_block)) for start in range(0, rows, per_block)]
