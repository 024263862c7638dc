"""Row-range block layout and the block size. A block is a range of whole rows of one
tensor, so its bytes are one contiguous range in the file. Owns the block-size default,
range and parser (params.yaml, `mergepipe index --block-bytes`, the Snakemake rules), the
row-bytes arithmetic and the per-tensor layout (`BlockLayout`: vocabulary tensors may get
smaller blocks). Pure arithmetic, no I/O."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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


# A vocabulary tensor's module name (the part before `.weight`): Llama/Mistral/Qwen/SmolLM
# (embed_tokens, lm_head), GPT-2 (wte), BERT (word_embeddings), GPT-NeoX (embed_in,
# embed_out), original Llama (tok_embeddings). Position embeddings (wpe) are not.
VOCAB_MODULES = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out",
                           "tok_embeddings"})


def is_vocabulary_tensor(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """`<...>.<module>.weight` with `<module>` in VOCAB_MODULES and shape [vocab, hidden] with
    vocab > hidden: one row per token, so single rows can matter (docs/design.md, "Words")."""
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in VOCAB_MODULES
            and len(shape) == 2 and int(shape[0]) > int(shape[1]) > 0)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The block size of every tensor: `block_bytes`, or `embedding_block_bytes` for
    vocabulary tensors when set. None, or a value equal to `block_bytes`, is the plain
    layout, whose cache keys, plans and hashes are those of an int block size."""

    block_bytes: int = DEFAULT_BLOCK_BYTES
    embedding_block_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.embedding_block_bytes == self.block_bytes:
            object.__setattr__(self, "embedding_block_bytes", None)

    @staticmethod
    def of(value: int | BlockLayout) -> BlockLayout:
        """An int block size is the plain layout."""
        return value if isinstance(value, BlockLayout) else BlockLayout(int(value))

    @staticmethod
    def of_plan(plan: Mapping) -> BlockLayout:
        """A plan's (or its manifest copy's) layout: `block_bytes` and, when present,
        `embedding_block_bytes`."""
        return BlockLayout(plan["block_bytes"], plan.get("embedding_block_bytes"))

    @property
    def key(self) -> int | str:
        """What cache keys and statistics keys hold: the int block size for the plain
        layout (so its keys are unchanged), else "<block_bytes>/emb<embedding_block_bytes>"."""
        if self.embedding_block_bytes is None:
            return self.block_bytes
        return f"{self.block_bytes}/emb{self.embedding_block_bytes}"

    def bytes_for(self, name: str, shape: tuple[int, ...] | list[int]) -> int:
        if self.embedding_block_bytes is not None and is_vocabulary_tensor(name, shape):
            return self.embedding_block_bytes
        return self.block_bytes

    def ranges(self, name: str, shape: tuple[int, ...] | list[int], itemsize: int) -> list[tuple[int, int]]:
        """`block_ranges` of tensor `name` at its block size."""
        return block_ranges(shape, itemsize, self.bytes_for(name, shape))
