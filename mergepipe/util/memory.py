"""Keep freed MiB-sized buffers in the heap (glibc), for loops that allocate them per block.

The merge and the index allocate and free MiB-sized buffers for every block. glibc
hands chunks that size back to the kernel (mmap / heap trim) and the next block
faults them in again: a quarter of the merge's wall and a fifth of the index's
went to page faults. The working set is bounded by the blocks in flight anyway.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> None:
    """Raise glibc's mmap and trim thresholds for this process (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
    except (OSError, AttributeError):
        pass
