"""Base bytes the output keeps unmerged: how they get from the base to the output.

The merge loop hands every copied span (rows of one tensor) and copied pack to one copier
(engine/work.py) and does not know which of the two it is (engine/merge.py picks it):

`KernelCopies` (buffered writes): a copied run needs nothing from the merging thread: its
bytes go from the base file to the output in the kernel (util.fs.copy_range) and its block
hashes come from the base index. So the merge loop hands each run to this copier and goes
on. The kernel copy then overlaps the merge math and the pwrites, instead of taking a reader thread that the
merging thread waits for in order (at a 10% budget of a K=4 merge, ~70% of the output
is copied: BENCHMARKS.md). Copies hold no memory in the process, so the queue is not
bounded; one thread, because every copy takes the output file's inode lock anyway.

`AppendedCopies` (direct writes): where the output is written around the page cache
(checkpoint/direct_io.py), the runs are instead read by the reader threads (`reads`; not
hashed: their hashes are the index's, as for a kernel copy) and appended in file order like
merged blocks.

Either way, `bytes` is the base bytes the output keeps and `kernel_bytes` those the kernel
copied (copy_file_range, not the fallback).
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from mergepipe.checkpoint.safetensors import Checkpoint, CheckpointReader, SafetensorsWriter
from mergepipe.engine.packs import Pack
from mergepipe.util.progress import Progress


class BackgroundCopies:
    """Runs copy tasks (each returns (bytes copied, bytes the kernel copied)) in order on
    one thread; totals them; re-raises the first failure at the next `submit` or at `finish`."""

    def __init__(self, progress: Progress) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mergepipe-copy")
        self._pending: deque[Future] = deque()
        self._progress = progress
        self.bytes = 0
        self.kernel_bytes = 0

    def submit(self, copy: Callable[..., tuple[int, int]], *args) -> None:
        def task() -> tuple[int, int]:
            done = copy(*args)
            self._progress.step(done[0])
            return done
        self._pending.append(self._pool.submit(task))
        self._reap(wait=False)

    def finish(self) -> None:
        """Wait for every copy; raises the first one's error."""
        self._reap(wait=True)
        self._pool.shutdown()

    def cancel(self) -> None:
        """Drop the copies not started and wait for the one running (before the files it
        copies between are closed: a closed fd's number can be reused by another open)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

    def _reap(self, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0].done()):
            nbytes, kernel = self._pending.popleft().result()
            self.bytes += nbytes
            self.kernel_bytes += kernel


class KernelCopies:
    """Copied spans and packs go file to file on the copier's thread (BackgroundCopies); a
    virtual base's tensors in no file of its own (checkpoint/vocab.py) through `virtual`,
    a reader of it. Nothing is read on the reader threads."""

    reads = False

    def __init__(self, base: Checkpoint, writers: dict[str, SafetensorsWriter], progress: Progress,
                 virtual: CheckpointReader | None) -> None:
        self._base, self._writers, self._virtual = base, writers, virtual
        self._fds: dict[Path, int] = {}
        self._copies = BackgroundCopies(progress)
        try:
            for h in base.files:
                self._fds[h.path] = os.open(h.path, os.O_RDONLY)
        except BaseException:
            self.close()
            raise

    @property
    def bytes(self) -> int:
        return self._copies.bytes

    @property
    def kernel_bytes(self) -> int:
        return self._copies.kernel_bytes

    def span(self, out_file: str, name: str, r0: int, r1: int, data: None = None) -> None:
        """Rows r0:r1 of base tensor `name` into the output file `out_file`."""
        self._copies.submit(self._copy_span, out_file, name, r0, r1)

    def pack(self, pack: Pack, data: None = None) -> None:
        self._copies.submit(self._copy_range, pack.out_file, pack.names[0], 0, pack.first, pack.begin, pack.end)

    def _copy_span(self, out_file: str, name: str, r0: int, r1: int) -> tuple[int, int]:
        t = self._base.tensors[name]
        begin = t.begin + r0 * t.row_bytes()
        return self._copy_range(out_file, name, r0, t, begin, begin + (r1 - r0) * t.row_bytes())

    def _copy_range(self, out_file: str, name: str, r0: int, t, begin: int, end: int) -> tuple[int, int]:
        """On the copier's thread: base bytes [begin, end) of t's file to output rows from r0
        of `name`; (bytes, bytes the kernel copied)."""
        writer = self._writers[out_file]
        if t.file not in self._fds:
            writer.write_rows(name, r0, self._virtual.read_range(t, begin, end))
            return end - begin, 0
        return end - begin, writer.copy_rows(name, r0, self._fds[t.file], begin, end - begin)

    def finish(self) -> None:
        """Wait for every copy; raises the first one's error."""
        self._copies.finish()

    def cancel(self) -> None:
        """Drop the copies not started and wait for the one running (before the files it
        copies between are closed: a closed fd's number can be reused by another open)."""
        self._copies.cancel()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._virtual is not None:
            self._virtual.close()


class AppendedCopies:
    """Copied spans and packs read by the reader threads through `reader` (a sequential
    reader of the base, whose counter is the bytes the output keeps) and appended in order."""

    reads = True
    kernel_bytes = 0

    def __init__(self, reader: CheckpointReader, writers: dict[str, SafetensorsWriter], progress: Progress) -> None:
        self._reader, self._writers, self._progress = reader, writers, progress

    @property
    def bytes(self) -> int:
        return self._reader.counter.total

    def read_span(self, name: str, r0: int, r1: int):
        """On a reader thread: the base rows r0:r1 of `name`."""
        return self._reader.read_rows(name, r0, r1)

    def read_pack(self, pack: Pack):
        return self._reader.read_range(pack.first, pack.begin, pack.end)

    def span(self, out_file: str, name: str, r0: int, r1: int, data) -> None:
        self._writers[out_file].write_rows(name, r0, data)
        self._progress.step(len(data))

    def pack(self, pack: Pack, data) -> None:
        self._writers[pack.out_file].write_rows(pack.names[0], 0, data)
        self._progress.step(pack.end - pack.begin)

    def finish(self) -> None:
        pass

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        self._reader.close()


Copier = KernelCopies | AppendedCopies
