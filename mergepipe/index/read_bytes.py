"""Bytes of block reads summed over an index's columns (index/columns.py) in whole-array
steps: what plan/record.py checks a plan's reads and budget against, without a Python
step per tensor or block (a checkpoint may have 100,000 tensors).

Each function answers None when its inputs are not columnar or a read is not plainly
valid (an unknown tensor, a block outside its tensor, a block identical to the base);
the caller then takes its tensor-by-tensor path, which gives the same sums for valid
reads and names what is wrong in the others. numpy is imported only here, when called.
"""
from __future__ import annotations

from itertools import chain

from mergepipe.checkpoint.blocks import row_bytes
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE
from mergepipe.index.columns import ModelColumns


def _row_bytes(cols: ModelColumns):
    """Bytes per row of every tensor of cols (an int64 array; one computation per shape and
    dtype), made once per index: the plan's checks ask twice per expert."""
    import numpy as np
    if cols.row_bytes is None:
        keys = list(zip(cols.shapes, cols.dtypes))
        memo = {key: row_bytes(key[0], ITEMSIZE[key[1]]) for key in set(keys)}
        cols.row_bytes = np.fromiter(map(memo.__getitem__, keys), dtype=np.int64, count=len(keys))
    return cols.row_bytes


def planned_bytes(reads: dict[str, list[int]], index, base_index, delta) -> int | None:
    """Bytes of the blocks `reads` (tensor -> block numbers) names in `index`, when every
    read is of a float tensor of both models, inside it, and (with `delta`) of a block that
    differs from the base; else None."""
    import numpy as np
    cols, base = index.tensors, base_index.tensors
    names, lists = list(reads), list(reads.values())
    if not names:
        return 0
    try:
        ti = cols.rows_of(names)
        if delta is not None:
            di = delta.tensors.rows_of(names)
    except KeyError:
        return None
    if not (base.has_all(names) and set(map(cols.dtypes.__getitem__, ti)) <= FLOAT_DTYPES):
        return None
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    blocks = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(lens.sum()))
    starts = np.asarray(cols.starts, dtype=np.int64)
    t = np.asarray(ti, dtype=np.int64)
    first = np.repeat(starts[t], lens)
    if blocks.size and ((blocks < 0).any() or (blocks >= np.repeat(starts[t + 1], lens) - first).any()):
        return None
    if delta is not None and blocks.size:
        d = delta.tensors
        dstarts = np.asarray(d.bstarts, dtype=np.int64)
        dt = np.asarray(di, dtype=np.int64)
        dfirst = np.repeat(dstarts[dt], lens)
        if (blocks >= np.repeat(dstarts[dt + 1], lens) - dfirst).any():
            return None
        if np.frombuffer(d.identical, dtype=np.uint8)[dfirst + blocks].any():
            return None
    g = first + blocks
    ranges = np.asarray(cols.ranges, dtype=np.int64)
    rows = ranges[2 * g + 1] - ranges[2 * g]
    rb = _row_bytes(cols)[t]
    return int((rows * np.repeat(rb, lens)).sum())


def full_read_bytes(index, delta) -> int | None:
    """Bytes of every block of a float tensor that differs from the base: what a full merge
    reads of this expert; None unless both are in the same tensor order."""
    import numpy as np
    cols, d = index.tensors, delta.tensors
    if d.names != cols.names or d.bstarts != cols.starts:
        return None
    n = len(cols.names)
    counts = np.diff(np.asarray(cols.starts, dtype=np.int64))
    rb = _row_bytes(cols)
    is_float = np.fromiter(map(FLOAT_DTYPES.__contains__, cols.dtypes), dtype=bool, count=n)
    ranges = np.asarray(cols.ranges, dtype=np.int64)
    per_block = (ranges[1::2] - ranges[0::2]) * np.repeat(rb, counts)
    keep = np.repeat(is_float, counts) & (np.frombuffer(d.identical, dtype=np.uint8) == 0)
    return int(per_block[keep].sum())
