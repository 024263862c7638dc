"""Row-range block layout. A block is a range of whole rows of one tensor, so its
bytes are one contiguous range in the file. Pure arithmetic, no I/O."""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

DEFAULT_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Block:
    tensor: str
    row_start: int
    row_end: int


def num_rows(shape: tuple[int, ...] | list[int]) -> int:
    """Rows of a tensor: its first dimension; a 0-d tensor has one row."""
    return int(shape[0]) if len(shape) >= 1 else 1


def row_numel(shape: tuple[int, ...] | list[int]) -> int:
    """Elements per row (1 for 0-d and 1-d tensors' rows)."""
    return prod(shape[1:]) if len(shape) >= 1 else 1


def block_ranges(shape: tuple[int, ...] | list[int], itemsize: int,
                 block_bytes: int) -> list[tuple[int, int]]:
    """Split a tensor into whole-row ranges of about `block_bytes` each.

    0-d and 1-d tensors are one block. A row larger than `block_bytes` is a block
    on its own. A tensor with zero rows has no blocks.
    """
    rows = num_rows(shape)
    if len(shape) <= 1:
        return [(0, rows)] if rows > 0 else []
    row_bytes = row_numel(shape) * itemsize
    per_block = max(1, block_bytes // max(1, row_bytes))
    return [(start, min(rows, start + per_block)) for start in range(0, rows, per_block)]
