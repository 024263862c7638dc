"""Writing one output file in order, around the page cache (O_DIRECT).

A buffered write copies every output byte into a fresh page-cache page, then the kernel
writes the page back: on a VM whose free memory the host takes back, each fresh page is a
fault in the host, and writing a 942 MiB output cost 0.4-6.3 CPU-s where O_DIRECT from a
reused buffer cost 0.05 CPU-s and 0.35-0.55 s of device time (BENCHMARKS.md "Direct
writes"). At 70B the output also no longer evicts the inputs from the page cache.

`DirectAppender` takes the file's bytes in order (`append`): they fill page-aligned chunk
buffers, and a thread of its own writes each full chunk with one pwrite from the buffer
to the device, while the caller fills the next. `close` writes the last chunk padded to
the alignment; the caller truncates the file to its size. Where the kernel refuses an
O_DIRECT write (EINVAL: a device with larger sectors, a file system without it), the fd
drops O_DIRECT (fcntl) and the rest is written buffered: the bytes are the same.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import threading

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses in multiples of the sector
CHUNK = 8 << 20  # bytes per write
BUFFERS = 3  # one being filled, one being written, one spare


def direct_open(path, flags: int, mode: int = 0o644) -> int:
    """os.open with O_DIRECT where the file system takes it, else without."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode)


class DirectAppender:
    """Appends bytes to fd from byte 0 on, in ALIGN-aligned chunk writes on a writer thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        for _ in range(BUFFERS):
            self._free.put(mmap.mmap(-1, CHUNK))  # anonymous maps are page-aligned
        self._todo: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, name="mergepipe-direct", daemon=True)
        self._thread.start()
        self._buf = self._free.get()
        self._fill = 0  # bytes of _buf filled
        self._at = 0  # file offset of _buf's first byte
        self.position = 0  # bytes appended

    def append(self, data) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, CHUNK - self._fill)
            self._buf[self._fill:self._fill + n] = view[done:done + n]
            self._fill += n
            done += n
            if self._fill == CHUNK:
                self._hand_over(CHUNK)
        self.position += len(view)

    def close(self) -> None:
        """Write what is left (padded with zeros to ALIGN) and wait for every write; raises
        the first write's error. The file is then ALIGN-padded: the caller truncates it."""
        try:
            if self._fill:
                pad = -self._fill % ALIGN
                self._buf[self._fill:self._fill + pad] = bytes(pad)
                self._hand_over(self._fill + pad)
        finally:  # the thread ends and the buffers go even when an earlier write failed
            self._todo.put(None)
            self._thread.join()
            self._release()
        self._raise()

    def abort(self) -> None:
        """Stop the writer thread without writing more (the caller removes the file)."""
        self._error = self._error or OSError(errno.ECANCELED, "aborted")
        self._todo.put(None)
        self._thread.join()
        self._release()

    def _release(self) -> None:
        """Unmap the buffers (the writer thread has ended, so every one is back)."""
        bufs = [self._buf]
        while not self._free.empty():
            bufs.append(self._free.get_nowait())
        for buf in bufs:
            try:
                buf.close()
            except BufferError:  # a view still held (by an error's frames): freed with it
                pass

    def _hand_over(self, nbytes: int) -> None:
        self._raise()
        self._todo.put((self._buf, self._at, nbytes))
        self._at += nbytes
        self._buf = self._free.get()  # waits while every buffer is being written
        self._fill = 0

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        while (item := self._todo.get()) is not None:
            buf, at, nbytes = item
            try:
                if self._error is None:
                    self._write(memoryview(buf)[:nbytes], at)
            except BaseException as e:  # raised in the appending thread (without this thread's frames,
                self._error = e.with_traceback(None)  # which hold views of the buffer)
            finally:
                self._free.put(buf)

    def _write(self, view: memoryview, at: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self._fd, view[done:], at + done)
            except OSError as e:
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                if e.errno != errno.EINVAL or not flags & getattr(os, "O_DIRECT", 0):
                    raise
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)  # refused: buffered from here
