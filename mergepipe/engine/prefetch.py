"""The reader window: base rows and the planned expert blocks, read by a thread pool a
bounded number of units ahead of the merging thread, integrity-checked as they arrive.

Memory stays O(window x (K+1) x unit bytes), never O(model). A unit is a run of
adjacent blocks of one tensor (about UNIT_BYTES of base rows) read with one pread.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from mergepipe.checkpoint.safetensors import Checkpoint, CheckpointReader, ReadCounter, TensorInfo
from mergepipe.engine.hashing import check_base_unit, check_expert_blocks
from mergepipe.index.records import ModelIndex

UNIT_BYTES = 4 << 20  # base bytes per prefetch unit: adjacent blocks read with one pread

Got = dict[str, dict[int, memoryview]]  # expert -> block -> bytes read
R = TypeVar("R")


def units(t: TensorInfo, ranges: tuple[tuple[int, int], ...]) -> list[list[int]]:
    """Group a tensor's blocks into prefetch units of about UNIT_BYTES."""
    out, cur, size = [], [], 0
    row_bytes = t.row_bytes()
    for b, (r0, r1) in enumerate(ranges):
        nbytes = (r1 - r0) * row_bytes
        if cur and size + nbytes > UNIT_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += nbytes
    if cur:
        out.append(cur)
    return out


class UnitReader:
    """Reads one unit: the base rows (always) and the blocks the plan reads of each expert.

    Owns the readers and their byte counters; `load` is called from pool threads.
    """

    def __init__(self, base: Checkpoint, base_index: ModelIndex, experts: dict[str, Checkpoint],
                 expert_indexes: dict[str, ModelIndex], reads: dict[str, dict[str, set[int]]]) -> None:
        self.base, self.base_index = base, base_index
        self.experts, self.expert_indexes, self.reads = experts, expert_indexes, reads
        self.base_counter = ReadCounter()
        self.counters = {name: ReadCounter() for name in reads}
        self.base_reader = CheckpointReader(base, counter=self.base_counter, random_access=False)
        self.readers = {name: CheckpointReader(experts[name], counter=self.counters[name]) for name in reads}
        # tensors whose units are merged here from LoRA adapters' factors (engine/adapter_sums.py)
        self.sums = None

    def load(self, name: str, unit: list[int]) -> tuple[memoryview, Got]:
        if self.sums is not None and self.sums.covers(name):  # the unit's output bytes, no expert blocks
            return self.sums.load(name, unit)
        t = self.base.tensors[name]
        entry = self.base_index.tensors[name]
        ranges = entry.ranges
        r0, r1 = ranges[unit[0]][0], ranges[unit[-1]][1]
        base_buf = memoryview(self.base_reader.read_rows(name, r0, r1))
        check_base_unit(base_buf, t, ranges, unit, entry.hashes, str(self.base.root))
        got: Got = {}
        for expert, reads in self.reads.items():
            wanted = [b for b in unit if b in reads.get(name, ())]
            if not wanted:
                continue
            bufs = self.readers[expert].read_blocks(name, [ranges[b] for b in wanted])
            check_expert_blocks(bufs, wanted, ranges, self.expert_indexes[expert].tensors[name].hashes,
                                self.experts[expert].tensors[name])
            got[expert] = dict(zip(wanted, bufs))
        return base_buf, got

    def close(self) -> None:
        self.base_reader.close()
        for r in self.readers.values():
            r.close()


def prefetched(pool: ThreadPoolExecutor, load: Callable[..., R], work: list[tuple],
               depth: int) -> Iterator[tuple[tuple, R]]:
    """Yield (item, load(*item)) in order, keeping `depth` loads in flight ahead."""
    window: deque[Future] = deque()
    ahead = iter(work)
    for _ in range(depth):
        nxt = next(ahead, None)
        if nxt is not None:
            window.append(pool.submit(load, *nxt))
    for item in work:
        result = window.popleft().result()
        nxt = next(ahead, None)
        if nxt is not None:
            window.append(pool.submit(load, *nxt))
        yield item, result
