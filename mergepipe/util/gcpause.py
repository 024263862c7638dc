"""Pause Python's cyclic garbage collector while many container objects without cycles
are made at once (a safetensors header of 100k tensors, an index's columns, a plan).

Every collection walks the live containers of its generations, and a full one all of
them: parsing the headers of three 100k-tensor checkpoints triggered enough collections
to cost more than the parsing (issue 15). Reference counting still frees everything;
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
