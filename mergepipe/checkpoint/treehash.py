"""The output hash tree: how a weight file's and its tensors' hashes are composed from the
blake3 of their blocks (docs/design.md, "Outputs and manifest", manifest schema 2).

    block digest  = blake3(the block's bytes)                     (32 bytes)
    tensor hash   = blake3(block digests of the tensor, in order)
    file hash     = blake3(blake3(header) || tensor digests in file order)

A tensor's blocks are `checkpoint.blocks.block_ranges(shape, itemsize, block_bytes)` of its
own dtype and the plan's block size for that tensor (`BlockLayout`): the index's blocks, so
where the output is the base's bytes a block's digest is the one the base index already
holds and nothing is reread or rehashed. `header` is the file's first 8 + N bytes (length
and JSON, padding included); file order is (data begin, data end, name). A zero-size
tensor is one empty block; a tensor with no blocks hashes the empty string of digests.
"""
from __future__ import annotations

import os
from pathlib import Path

from blake3 import blake3

from mergepipe.checkpoint.blocks import BlockLayout, row_bytes
from mergepipe.checkpoint.safetensors import ITEMSIZE, FileHeader, parse_header

READ_BYTES = 8 << 20  # verify reads blocks in chunks of at most this many bytes


def block_sizes(shape: tuple[int, ...], dtype: str, block_bytes: int | BlockLayout, name: str = "") -> list[int]:
    """Byte length of each block of tensor `name` (its name decides its block size only under
    a layout with embedding blocks)."""
    rb = row_bytes(shape, ITEMSIZE[dtype])
    return [(r1 - r0) * rb for r0, r1 in BlockLayout.of(block_bytes).ranges(name, shape, ITEMSIZE[dtype])]


def tensor_digest(block_digests: list[bytes]) -> bytes:
    return blake3(b"".join(block_digests)).digest()


def file_digest(header: bytes, tensor_digests: list[bytes]) -> bytes:
    """`tensor_digests` in file order (data begin, data end, name)."""
    return blake3(blake3(header).digest() + b"".join(tensor_digests)).digest()


class TensorHasher:
    """A tensor's hash from its bytes in order, cut at its block boundaries (any chunking),
    or from block digests already known (`add_digests`, at block boundaries only)."""

    __slots__ = ("sizes", "i", "left", "h", "digests")

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.i = 0
        self.left = sizes[0] if sizes else 0
        self.h = blake3()
        self.digests: list[bytes] = []

    def _close_full(self, empty_too: bool = True) -> None:
        """Close the blocks that are complete; a zero-size block only with `empty_too`
        (`add_digests` may be given its digest instead)."""
        while self.i < len(self.sizes) and self.left == 0 and (empty_too or self.sizes[self.i] > 0):
            self.digests.append(self.h.digest())
            self.h = blake3()
            self.i += 1
            self.left = self.sizes[self.i] if self.i < len(self.sizes) else 0

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        pos = 0
        while True:
            self._close_full()
            if pos >= len(mv):
                return
            if self.i >= len(self.sizes):
                raise ValueError("more bytes than the tensor holds")
            take = min(self.left, len(mv) - pos)
            self.h.update(mv[pos:pos + take])
            pos += take
            self.left -= take

    def add_digests(self, digests: list[bytes]) -> None:
        self._close_full(empty_too=False)
        if self.i + len(digests) > len(self.sizes) or (digests and self.left != self.sizes[self.i]):
            raise ValueError("block digests not at a block boundary")
        self.digests.extend(digests)
        self.i += len(digests)
        self.left = self.sizes[self.i] if self.i < len(self.sizes) else 0

    def digest(self) -> bytes:
        self._close_full()
        if self.i != len(self.sizes):
            raise ValueError("fewer bytes than the tensor holds")
        return tensor_digest(self.digests)


def file_order(names_offsets: list[tuple[str, int, int]]) -> list[str]:
    """Tensor names in file order from (name, begin, end)."""
    if not names_offsets:
        return []
    names, begins, ends = zip(*names_offsets)
    return [n for _, _, n in sorted(zip(begins, ends, names))]  # tuples made and compared in C


def hash_weight_file(path: str | Path, block_bytes: int | BlockLayout) -> tuple[str, dict[str, str]]:
    """(file hash, tensor name -> tensor hash) of a safetensors file, reading every byte.

    Raises:
        CheckpointError: the header is not a valid safetensors header.
        OSError: the file cannot be read.
    """
    head: FileHeader = parse_header(path)
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    tensors: dict[str, bytes] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for t in head.tensors:
            h = TensorHasher(block_sizes(t.shape, t.dtype, block_bytes, t.name))
            pos = t.begin
            while pos < t.end:
                n = os.preadv(fd, [view[:min(READ_BYTES, t.end - pos)]], pos)
                if n <= 0:
                    raise OSError(f"{path}: short read")
                h.update(view[:n])
                pos += n
            tensors[t.name] = h.digest()
    finally:
        os.close(fd)
    order = file_order([(t.name, t.begin, t.end) for t in head.tensors])
    return (file_digest(head.header_bytes, [tensors[n] for n in order]).hex(),
            {n: d.hex() for n, d in tensors.items()})
