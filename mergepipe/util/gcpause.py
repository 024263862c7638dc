"""Pause Python's cyclic garbage collector while many container objects without cycles
are made at once (a safetensors header of 100k tensors, an index's columns, a plan).

Every collection walks the live containers of its generations, and a full one all of
them: parsing the headers of three 100k-tensor checkpoints triggered enough collections
to cost more than the parsing (100,000 tensors). Reference counting still frees everything;
the collector only looks for cycles, and JSON values and index columns have none.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic collection inside the block (nested or already disabled: left as it is)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


RARE_THRESHOLD = (100_000, 20, 10)  # collections of the youngest generation: every 100k allocations, not 700


@contextmanager
def rare_gc() -> Iterator[None]:
    """Cyclic collection still on, but rare: for a whole command. With the default thresholds a
    100k-tensor merge ran ~20 full collections, each walking every live object (2.5 s of an
    8 s merge); cyclic garbage now waits at most 100k allocations longer."""
    before = gc.get_threshold()
    gc.set_threshold(*RARE_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
