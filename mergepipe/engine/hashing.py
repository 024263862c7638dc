"""Integrity hashing around the merge: every block read is checked against its index
hash (base units, expert blocks), and the output is hashed, per tensor and per file,
as a hash tree over its blocks (checkpoint/treehash.py) in a thread of its own as it is written."""
from __future__ import annotations

import queue
import threading


from itertools import filterfalse
from operator import itemgetter

from blake3 import blake3

from mergepipe.checkpoint.safetensors import OutTensor, SafetensorsWriter, TensorInfo
from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.treehash import TensorHasher, block_sizes, file_digest
from mergepipe.errors import IntegrityError


def check_base_unit(buf: memoryview, t: TensorInfo, ranges, unit: list[int], hashes, where: str) -> None:
    """The base rows of a unit (adjacent blocks, one read) must hash, block by block, to the index."""
    row_bytes = t.row_bytes()
    pos = 0
    for b in unit:
        n = (ranges[b][1] - ranges[b][0]) * row_bytes
        if blake3(buf[pos:pos + n]).hexdigest() != hashes[b]:
            raise IntegrityError(f"{t.file}: tensor {t.name!r} rows {ranges[b][0]}:{ranges[b][1]} do not match "
                                 f"the index of {where} (corrupted or modified since indexing)")
        pos += n


def check_expert_blocks(bufs, blocks: list[int], ranges, hashes, t: TensorInfo) -> None:
    """Each expert block read must hash to its index entry."""
    for b, buf in zip(blocks, bufs):
        if blake3(buf).hexdigest() != hashes[b]:
            raise IntegrityError(f"{t.file}: tensor {t.name!r} rows "
                                 f"{ranges[b][0]}:{ranges[b][1]} do not match the index (corrupted or "
                                 "modified since indexing); re-index with `mergepipe index`")


def _block_sizes(layout: dict[str, list[OutTensor]], blocks: BlockLayout) -> dict[str, list[int]]:
    """Tensor -> its blocks' byte lengths; tensors of one shape, dtype and block size share
    one (read-only) list: a checkpoint of 100k tensors has a few dozen shapes."""
    out = {}
    for ts in layout.values():
        if blocks.embedding_block_bytes is None:  # the block size is the shape's and dtype's: C-speed passes
            keys = list(map(itemgetter(2, 1), ts))
            memo = {k: block_sizes(k[0], k[1], blocks) for k in set(keys)}
            out.update(zip(map(itemgetter(0), ts), map(memo.__getitem__, keys)))
            continue
        memo = {}
        for t in ts:
            key = (t.shape, t.dtype, blocks.bytes_for(t.name, t.shape))
            sizes = memo.get(key)
            if sizes is None:
                sizes = memo[key] = block_sizes(t.shape, t.dtype, blocks, t.name)
            out[t.name] = sizes
    return out


class OutputHasher:
    """The output's hash tree (checkpoint/treehash.py), in a thread of its own, as it is written.

    Per tensor, blocks arrive in order: written bytes (`add`, hashed here, cut at the
    tensor's block boundaries whatever the chunking) or, for runs copied from the base,
    the base index's block digests (`add_digests`: nothing is read or rehashed). A file's
    hash is composed at `finish` from its header and its tensors' hashes, so the order in
    which tensors are written does not matter. A bounded queue keeps at most `depth`
    blocks alive.
    """

    def __init__(self, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter], block_bytes,
                 *, depth: int = 16) -> None:
        self.headers = {fname: w.header for fname, w in writers.items()}
        self.order = {fname: w.file_order() for fname, w in writers.items()}
        self.sizes = _block_sizes(layout, BlockLayout.of(block_bytes))
        self.tensors: dict[str, str] = {}  # tensor -> hex digest (the manifest's; one form kept, not two)
        self._open: dict[str, TensorHasher] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mergepipe-hash", daemon=True)
        self._thread.start()

    def add(self, name: str, data) -> None:
        self._queue.put((name, data, None))

    def add_digests(self, name: str, digests: list[bytes]) -> None:
        self._queue.put((name, None, digests))

    def end_tensor(self, name: str) -> None:
        self._queue.put((name, None, None))

    def add_whole(self, names: list[str], items: list, *, digests: bool = False) -> None:
        """Whole single-block tensors in one message (engine/packs.py): `names` and their
        bytes, or with `digests` their block digests; each tensor is complete."""
        self._queue.put((None, (names, items), digests))

    def finish(self) -> dict[str, str]:
        """Wait for the queue; returns file -> hash (tensors that got no block: their empty tree)."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        for name in list(filterfalse(self.tensors.__contains__, self.sizes)):  # no blocks, or only empty ones
            self.tensors[name] = TensorHasher(self.sizes[name]).digest().hex()
        # the tensor digests in file order, as one bytes: one fromhex of their joined hex
        files = {f: file_digest(self.headers[f], [bytes.fromhex("".join(map(self.tensors.__getitem__, names)))]).hex()
                 for f, names in self.order.items()}
        self.sizes, self.order = {}, {}  # 100k entries each, not needed after this
        return files

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep draining so that the producer never blocks
            try:
                self._hash(*item)
            except BaseException as e:  # re-raised in the merging thread by finish()
                self._error = e

    def _hash(self, name: str | None, data, digests) -> None:
        if name is None:  # a pack of whole single-block tensors: hash tree = blake3(block digest)
            names, blocks = data
            if set(map(len, map(self.sizes.__getitem__, names))) != {1}:
                bad = next(t for t in names if len(self.sizes[t]) != 1)
                raise ValueError(f"tensor {bad!r} is not one block")
            if not digests:
                blocks = map(blake3.digest, map(blake3, blocks))
            # tensor_digest([b]): one block's digest, hashed; kept as hex only (the manifest's)
            self.tensors.update(zip(names, map(blake3.hexdigest, map(blake3, blocks))))
            return
        if data is None and digests is None:
            h = self._open.pop(name, None) or TensorHasher(self.sizes[name])
            self.tensors[name] = h.digest().hex()
            return
        h = self._open.get(name)
        if h is None:
            h = self._open[name] = TensorHasher(self.sizes[name])
        if digests is not None:
            h.add_digests(digests)
        else:
            h.update(data)
