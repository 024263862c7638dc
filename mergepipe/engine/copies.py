"""Base runs the output keeps, copied file to file on a thread of their own.

A copied run needs nothing from the merging thread: its bytes go from the base file to
the output in the kernel (util.fs.copy_range) and its block hashes come from the base
index. So the merge loop hands each run to this copier and goes on. The kernel copy
then overlaps the merge math and the pwrites, instead of taking a reader thread that the
merging thread waits for in order (at a 10% budget of a K=4 merge, ~70% of the output
is copied: BENCHMARKS.md). Copies hold no memory in the process, so the queue is not
bounded; one thread, because every copy takes the output file's inode lock anyway.

Where the output is written around the page cache (checkpoint/direct_io.py), the runs
are instead read by the reader threads (not hashed: their hashes are the index's, as for
a kernel copy) and appended in order like merged blocks (engine/merge.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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
