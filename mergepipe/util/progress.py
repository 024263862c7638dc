"""Progress bars for the long steps (indexing, sketch scans, calibration, merging) where a
person watches, and at most one end line in a log.

Where a step's bar goes is decided once, when the step starts (`_targets`):
- stderr is a terminal: the bar on stderr, redrawn in place and left there at the end;
- stderr is not one but MERGEPIPE_PROGRESS=1 (the Snakemake rules pipe the CLI's stderr
  through `tee` into the job's log; rules/common.smk sets it when Snakemake's stdout is a
  terminal): the bar on the controlling terminal (/dev/tty), erased at the end, and one
  end line on stderr, so the log gets that line and never a carriage return;
- otherwise (a pipe or a file, `-q`, MERGEPIPE_PROGRESS=0): nothing at all.

Worker threads only queue their counts (`step`: one deque append, atomic, no lock); each
step's reporting thread sums them and draws at most 1 / REDRAW_S times a second, in tqdm's
format (bytes done/total, rate, ETA). A bar reads nothing and writes nothing a step
computes: outputs are the same with or without it.
"""
from __future__ import annotations

import locale
import os
import sys
import threading
import time
from collections import deque
from typing import TextIO

ENV = "MERGEPIPE_PROGRESS"  # "1": bars on /dev/tty when stderr is not a terminal; "0": never a bar
REDRAW_S = 0.1
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a stream without a file, or a closed one
        return False


def _targets(enabled: bool) -> tuple[TextIO | None, TextIO | None]:
    """(the stream the bar is drawn on, the stream that gets the end line), either None."""
    request = os.environ.get(ENV, "")
    if not enabled or request == "0":
        return None, None
    if _isatty(sys.stderr):
        return sys.stderr, None
    if request != "1":
        return None, None
    try:
        tty = open("/dev/tty", "w", encoding=locale.getpreferredencoding(False), errors="replace")
    except OSError:  # no controlling terminal (a cluster job): the end line only
        return None, sys.stderr
    return tty, sys.stderr


def size_text(n: float) -> str:
    """A byte count in binary units: 512 B, 1.5 MiB, 12.0 GiB."""
    for unit in _UNITS[:-1]:
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} {_UNITS[-1]}"


class Progress:
    """Counts `unit`s done out of `total` (bytes by default; thread-safe) for one step named
    `label`, shown as set out in the module docstring when `enabled` (the CLI: not `-q`).
    A context manager: `close` (or leaving the `with`) stops the bar and writes the end."""

    def __init__(self, total: int, label: str, enabled: bool, *, unit: str = "B") -> None:
        self.total, self.label, self.unit = total, label, unit
        self._bar, self._log = _targets(enabled)
        self._tty = self._bar if self._log is not None else None  # /dev/tty, opened for this step
        self.enabled = self._bar is not None or self._log is not None
        self.t0 = time.monotonic()
        self._steps: deque[int] = deque()  # counts not yet summed into _done (bounded: drained 10x/s)
        self._done = 0
        self._lock = threading.Lock()  # one drainer at a time
        self._stop = threading.Event()
        self._drawn = 0  # characters of the last bar drawn (to erase it)
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._report, name="mergepipe-progress", daemon=True)
            self._thread.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, n: int) -> None:
        if self.enabled:
            self._steps.append(n)

    @property
    def done(self) -> int:
        return self._sum()

    def _sum(self) -> int:
        """Adds the queued counts into the total, and returns it."""
        with self._lock:
            while self._steps:
                self._done += self._steps.popleft()
            return self._done

    def close(self) -> None:
        """Stop the reporting thread; on stderr leave the last bar (at 100% when the step
        finished), on /dev/tty erase it; a finished step's end line goes to the log."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            if self._log is None:
                self._draw(end="\n")
            else:
                self._write(self._bar, "\r" + " " * self._drawn + "\r")
        if self._tty is not None:
            try:
                self._tty.close()
            except OSError:
                pass  # a terminal gone: nothing left to draw on
        if self._log is not None and self.done >= self.total:
            self._write(self._log, self.summary() + "\n")

    def summary(self) -> str:
        """The end line: `label: 2.9 GiB in 8.2 s (357.0 MiB/s)`."""
        seconds = time.monotonic() - self.t0
        if self.unit == "B":
            return (f"{self.label}: {size_text(self.done)} in {seconds:.1f} s "
                    f"({size_text(self.done / max(seconds, 1e-9))}/s)")
        return f"{self.label}: {self.done} {self.unit} in {seconds:.1f} s"

    def _report(self) -> None:
        while not self._stop.wait(REDRAW_S):
            if self._bar is not None:
                self._draw(end="")
            else:
                self._sum()

    def _draw(self, *, end: str) -> None:
        from tqdm import tqdm  # only where a bar is drawn: the CLI's quick paths never import it
        bar = self._bar
        try:
            width = os.get_terminal_size(bar.fileno()).columns or 80  # 0: a terminal that did not say
        except (OSError, ValueError, AttributeError):
            width = 80
        line = tqdm.format_meter(self.done, self.total, time.monotonic() - self.t0, ncols=max(20, width - 1),
                                 prefix=self.label, unit=self.unit, unit_scale=self.unit == "B", unit_divisor=1024,
                                 ascii="utf" not in (getattr(bar, "encoding", None) or "").lower())
        if self._write(bar, "\r" + line.ljust(self._drawn) + end):
            self._drawn = len(line)

    def _write(self, stream: TextIO, text: str) -> bool:
        """Whether `text` reached `stream`; a terminal gone (EIO) or a closed pipe ends this
        step's drawing, never the step."""
        try:
            stream.write(text)
            stream.flush()
            return True
        except (OSError, ValueError):
            if stream is self._bar:
                self._bar = None
            return False
