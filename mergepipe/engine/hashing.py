"""Integrity hashing around the merge: every block read is checked against its index
hash (base units, expert blocks), and the output is hashed, per tensor and per file,
in a thread of its own as it is written."""
from __future__ import annotations

import queue
import threading

from blake3 import blake3

from mergepipe.checkpoint.safetensors import OutTensor, SafetensorsWriter, TensorInfo
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


class OutputHasher:
    """blake3 of the output bytes, in a thread of its own, as they are written.

    Per tensor, and per file: a file's hash is fed its header and then every block
    in file order, which is the order the engine writes them in; if a block ever
    arrives out of order the file is left to `record_outputs` to reread. Hashing the
    bytes handed to pwrite instead of rereading the file saved a full pass over the
    output (`mergepipe run` still rereads the published files in its verify).
    A bounded queue keeps at most `depth` blocks alive.
    """

    def __init__(self, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter], *,
                 depth: int = 16) -> None:
        self.writers = writers
        self.file_of = {t.name: fname for fname, ts in layout.items() for t in ts}
        self.files: dict[str, blake3 | None] = {fname: blake3(w.header) for fname, w in writers.items()}
        self.next = {fname: w.data_start for fname, w in writers.items()}
        self.size = {fname: w.size for fname, w in writers.items()}
        self.tensors: dict[str, str] = {}
        self._open: dict[str, blake3] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mergepipe-hash", daemon=True)
        self._thread.start()

    def add(self, name: str, row_start: int, data) -> None:
        self._queue.put((name, row_start, data))

    def end_tensor(self, name: str) -> None:
        self._queue.put((name, -1, None))

    def finish(self) -> dict[str, str]:
        """Wait for the queue; returns file -> blake3 for the files hashed in order."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return {f: h.hexdigest() for f, h in self.files.items() if h is not None and self.next[f] == self.size[f]}

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep draining so that the producer never blocks
            try:
                self._hash(*item)
            except BaseException as e:  # re-raised in the merging thread by finish()
                self._error = e

    def _hash(self, name: str, row_start: int, data) -> None:
        if data is None:
            self.tensors[name] = self._open.pop(name, blake3()).hexdigest()
            return
        self._open.setdefault(name, blake3()).update(data)
        fname = self.file_of[name]
        h = self.files[fname]
        if h is not None:
            if self.writers[fname].offset_of(name, row_start) == self.next[fname]:
                h.update(data)
                self.next[fname] += memoryview(data).nbytes
            else:
                self.files[fname] = None
