"""One progress line on stderr for long steps (indexing, merging), only on a terminal."""
from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Counts bytes done out of `total` (thread-safe) and redraws `label pct MiB MiB/s` at most 5x/s."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()
        self._lock = threading.Lock()

    def step(self, n: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self.last > 0.2 or self.done >= self.total:
                self.last = now
                mib = self.done / 2**20
                pct = 100 * self.done / max(1, self.total)
                sys.stderr.write(f"\r{self.label} {pct:5.1f}%  {mib:,.0f} MiB  "
                                 f"{mib / max(1e-9, now - self.t0):,.0f} MiB/s")
                if self.done >= self.total:
                    sys.stderr.write("\n")
                sys.stderr.flush()
