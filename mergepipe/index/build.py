"""Content index of checkpoints, built once and cached by content.

ModelIndex (one checkpoint): per-block blake3 of whole-row blocks, and a content
hash over (name, dtype, shape, block hashes) in name order, so it does not depend
on sharding. DeltaIndex (an expert against a base): per block ||delta||_2, max
|delta|, nonzeros and an identical-to-base flag; per tensor ||delta||_1,
||delta||_2 and exact |delta| rank cuts on the 0.00..1.00 density grid, so TIES
and Breadcrumbs thresholds are known without rereading the expert.

Exact rank cuts without holding a tensor: pass 1 histograms |delta| over the upper
16 bits of its fp32 pattern (monotone for non-negative floats), which locates the
bin of every target rank; pass 2 counts the lower 16 bits of just the elements in
those bins, block by block in a sparse table, which gives exact values and, per
block, the count of each value, so a cut that splits a run of equal values knows
how many of them each block holds (a third pass only where that table grows past
a cap, as fp32 deltas can make it). The counting loops are compiled
(index/kernels.py; the scan itself is index/scan.py). Tensors up to `cache_bytes` of fp32 keep |delta| in memory
between passes; larger ones are reread (counted as index reads). A new expert is
hashed in the same scan (build_expert_index): it is read once, not twice.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from blake3 import blake3

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, CheckpointReader, ReadCounter, TensorInfo
from mergepipe.errors import CheckpointError
from mergepipe.index.records import DeltaIndex, ModelIndex, TensorDelta, TensorEntry, content_hash
from mergepipe.index.scan import DeltaTensorScan
from mergepipe.util.memory import keep_freed_memory
from mergepipe.util.progress import Progress


def _blocks(t: TensorInfo, layout: BlockLayout) -> list[tuple[int, int]]:
    return layout.ranges(t.name, t.shape, t.itemsize)


def _hash_tensor(reader: CheckpointReader, t: TensorInfo, block_bytes: BlockLayout,
                 progress: Progress | None = None) -> TensorEntry:
    ranges = _blocks(t, block_bytes)
    hashes = []
    for a, b in ranges:
        buf = reader.read_rows(t.name, a, b)
        hashes.append(blake3(buf).hexdigest())
        if progress:
            progress.step(len(buf))
    return TensorEntry(t.name, t.dtype, t.shape, tuple(ranges), tuple(hashes))


def build_model_index(ckpt: Checkpoint, *, block_bytes: int | BlockLayout, threads: int = 2,
                      counter: ReadCounter | None = None, progress: bool = False) -> ModelIndex:
    """Hash every block of a checkpoint (one read of every byte)."""
    block_bytes = BlockLayout.of(block_bytes)
    ranges = {name: _blocks(t, block_bytes) for name, t in ckpt.tensors.items()}
    with Progress(ckpt.total_bytes, f"hashing {ckpt.root.name}", progress) as prog, \
            CheckpointReader(ckpt, counter=counter, random_access=False) as reader:
        def task(names: list[str]) -> list[TensorEntry]:
            with _readers(names, ranges, reader) as r:
                return [_hash_tensor(r, ckpt.tensors[n], block_bytes, prog) for n in names]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            done = [e for es in pool.map(task, _tasks(ckpt, list(ckpt.tensors), ranges)) for e in es]
    entries = {e.name: e for e in done}
    tensors = {name: entries[name] for name in ckpt.tensors}
    return ModelIndex(content_hash(tensors), block_bytes.block_bytes, tensors, block_bytes.embedding_block_bytes)


def check_compatible(base: Checkpoint, expert: Checkpoint) -> None:
    """Same names, shapes and dtypes, else a CheckpointError listing the first mismatches."""
    problems = []
    for name in base.tensors.keys() - expert.tensors.keys():
        problems.append(f"missing tensor {name!r}")
    for name in expert.tensors.keys() - base.tensors.keys():
        problems.append(f"extra tensor {name!r} not in base")
    for name in base.tensors.keys() & expert.tensors.keys():
        b, e = base.tensors[name], expert.tensors[name]
        if (b.shape, b.dtype) != (e.shape, e.dtype):
            problems.append(f"tensor {name!r} is {e.dtype}{list(e.shape)}, base has {b.dtype}{list(b.shape)}")
    if problems:
        problems.sort()
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{expert.root}: does not match base {base.root}: {'; '.join(problems[:3])}{more}")


def build_delta_index(base: Checkpoint, expert: Checkpoint, base_index: ModelIndex, expert_index: ModelIndex,
                      *, threads: int = 2, cache_bytes: int = 256 << 20,
                      counter: ReadCounter | None = None, progress: bool = False) -> DeltaIndex:
    """Delta statistics of `expert` against `base` (reads both once, big tensors more);
    every expert block read is checked against `expert_index`."""
    ranges = {name: e.ranges for name, e in expert_index.tensors.items()}
    _, delta = _scan(base, expert, base_index, ranges, expert_index.layout, threads, cache_bytes, counter,
                     {name: e.hashes for name, e in expert_index.tensors.items()}, progress)
    return DeltaIndex(expert_index.content_hash, base_index.content_hash, expert_index.block_bytes, delta,
                      expert_index.embedding_block_bytes)


def build_expert_index(base: Checkpoint, expert: Checkpoint, base_index: ModelIndex, *,
                       block_bytes: int | BlockLayout,
                       threads: int = 2, cache_bytes: int = 256 << 20,
                       counter: ReadCounter | None = None, progress: bool = False) -> tuple[ModelIndex, DeltaIndex]:
    """The expert's ModelIndex and its DeltaIndex against `base` in one scan: the block
    hashes come from the same reads as the statistics (one read of the expert, not two)."""
    block_bytes = BlockLayout.of(block_bytes)
    ranges = {name: tuple(_blocks(t, block_bytes)) for name, t in expert.tensors.items()}
    hashes, delta = _scan(base, expert, base_index, ranges, block_bytes, threads, cache_bytes, counter, None,
                          progress)
    tensors = {name: TensorEntry(name, t.dtype, t.shape, ranges[name], hashes[name])
               for name, t in expert.tensors.items()}
    index = ModelIndex(content_hash(tensors), block_bytes.block_bytes, tensors, block_bytes.embedding_block_bytes)
    return index, DeltaIndex(index.content_hash, base_index.content_hash, index.block_bytes, delta,
                             index.embedding_block_bytes)


def build_extra_cuts(base: Checkpoint, expert: Checkpoint, base_index: ModelIndex, expert_index: ModelIndex,
                     wanted: dict[str, tuple[int, ...]], *, threads: int = 2, cache_bytes: int = 256 << 20,
                     counter: ReadCounter | None = None, progress: bool = False) -> dict[str, TensorDelta]:
    """The exact rank cuts of `wanted` (tensor -> ascending ranks 0 < r < numel) of `expert`
    against `base`, in one scan of those tensors only (the index's passes at these ranks: the
    same values the index would hold for them); every expert block read is checked against
    `expert_index`. Each TensorDelta's ranks are (0, *wanted[name])."""
    ranges = {name: e.ranges for name, e in expert_index.tensors.items()}
    _, delta = _scan(base, expert, base_index, ranges, expert_index.layout, threads, cache_bytes, counter,
                     {name: e.hashes for name, e in expert_index.tensors.items()}, progress, wanted=wanted)
    return delta


def _scan(base: Checkpoint, expert: Checkpoint, base_index: ModelIndex, ranges: dict, block_bytes: BlockLayout,
          threads: int, cache_bytes: int, counter: ReadCounter | None,
          expected: dict[str, tuple[str, ...]] | None, progress: bool,
          wanted: dict[str, tuple[int, ...]] | None = None) -> tuple[dict, dict[str, TensorDelta]]:
    """Scan every tensor of `expert` against `base`: (block hashes, TensorDelta) by name;
    with `wanted`, only its tensors, each cut at its ranks instead of the index's."""
    check_compatible(base, expert)
    keep_freed_memory()
    if base_index.layout != block_bytes:
        raise ValueError(f"base index has blocks {base_index.layout.key}, expert {block_bytes.key}")
    names = list(base.tensors) if wanted is None else [n for n in base.tensors if n in wanted]
    total = expert.total_bytes if wanted is None else sum(expert.tensors[n].nbytes for n in names)
    what = "indexing" if wanted is None else "exact cuts of"
    with Progress(total, f"{what} {expert.root.name} against {base.root.name}", progress) as prog, \
            CheckpointReader(base, counter=counter, random_access=False) as base_all, \
            CheckpointReader(expert, counter=counter, random_access=False) as exp_all:
        def scan(name: str, base_r, exp_r) -> tuple[tuple[str, ...], TensorDelta]:
            t = expert.tensors[name]
            if t.dtype not in FLOAT_DTYPES:
                # integer buffers (position ids) are copied from the base, never merged
                hashes = expected[name] if expected else _hash_tensor(exp_r, t, block_bytes).hashes
                prog.step(t.nbytes)
                n = len(ranges[name])
                same = base_index.tensors[name].hashes == hashes
                return hashes, TensorDelta(name, t.numel, 0.0, 0.0, 0, (0.0,) * n, (0.0,) * n, (0,) * n,
                                           (True,) * n if same else (False,) * n, (), (), (), (), {})
            scan = DeltaTensorScan(base_r, exp_r, t, list(ranges[name]), expected[name] if expected else None,
                                    cache_bytes, None if wanted is None else wanted[name])
            scan.progress = prog
            delta = scan.run()
            return tuple(scan.hashes), delta
        def task(names: list[str]) -> list[tuple[tuple[str, ...], TensorDelta]]:
            with _readers(names, ranges, base_all) as base_r, _readers(names, ranges, exp_all) as exp_r:
                return [scan(n, base_r, exp_r) for n in names]
        # parallel across tensors (the kernels, numpy and blake3 release the GIL), largest
        # first, so that the big embedding does not start last and run alone
        order = sorted(names, key=lambda n: -base.tensors[n].numel)
        tasks = _tasks(expert, order, ranges)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            done = {n: r for batch, rs in zip(tasks, pool.map(task, tasks)) for n, r in zip(batch, rs)}
    return ({name: done[name][0] for name in names},
            {name: done[name][1] for name in names})


SMALL_TENSOR_BYTES = 64 << 10  # one-block tensors up to this size are indexed in batches
BATCH_BYTES = 4 << 20  # bytes of small tensors per batch (and per read)
BATCH_TENSORS = 2048


def _tasks(ckpt: Checkpoint, order: list[str], ranges: dict) -> list[list[str]]:
    """Units of work for the pool: each large tensor alone (in `order`), then the small
    one-block tensors in batches, in file order (so that a batch's bytes are few ranges).
    A future per tiny tensor cost more than indexing it (checkpoints of 100k tensors)."""
    is_small = {n: _small(ckpt.tensors[n], ranges[n]) for n in order}
    tasks = [[n] for n in order if not is_small[n]]
    file_no = {h.path: i for i, h in enumerate(ckpt.files)}  # a virtual file (checkpoint/vocab.py): last
    batch, size = [], 0
    in_file_order = sorted((n for n in order if is_small[n]),
                           key=lambda n: (file_no.get(ckpt.tensors[n].file, len(file_no)), ckpt.tensors[n].begin))
    for n in in_file_order:
        if batch and (size + ckpt.tensors[n].nbytes > BATCH_BYTES or len(batch) >= BATCH_TENSORS):
            tasks.append(batch)
            batch, size = [], 0
        batch.append(n)
        size += ckpt.tensors[n].nbytes
    if batch:
        tasks.append(batch)
    return tasks


def _small(t: TensorInfo, ranges) -> bool:
    return len(ranges) == 1 and t.nbytes <= SMALL_TENSOR_BYTES


def _readers(names: list[str], ranges: dict, reader: CheckpointReader) -> BatchReader | _Shared:
    """A reader for one task: a BatchReader over a batch of small tensors, else the shared one."""
    if all(_small(reader.ckpt.tensors[n], ranges[n]) for n in names):
        return BatchReader(reader, names)
    return _Shared(reader)


class _Shared:
    """The shared reader, as a context manager that does not close it."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader

    def __enter__(self) -> CheckpointReader:
        return self.reader

    def __exit__(self, *exc: object) -> None:
        pass


class BatchReader:
    """`read_rows` over a batch of small tensors, served from their bytes read in few preads
    (one per run adjacent in the file) and counted exactly as the tensor-by-tensor reads
    (`reader`'s counter, bytes per call), so index read accounting does not change.
    Where a run cannot be read whole (a truncated file), its tensors are read one by one,
    so that the error names the tensor."""

    def __init__(self, reader: CheckpointReader, names: list[str]) -> None:
        self.reader, self.ckpt = reader, reader.ckpt
        self.where: dict[str, tuple[memoryview, int]] = {}
        ts = sorted((self.ckpt.tensors[n] for n in names), key=lambda t: (str(t.file), t.begin))
        with CheckpointReader(self.ckpt, counter=ReadCounter(), random_access=False) as scratch:  # uncounted
            self._read(scratch, ts)

    def _read(self, scratch: CheckpointReader, ts: list[TensorInfo]) -> None:
        i = 0
        while i < len(ts):
            j = i
            while j + 1 < len(ts) and ts[j + 1].file == ts[i].file and ts[j + 1].begin == ts[j].end:
                j += 1
            try:
                buf = memoryview(scratch.read_range(ts[i], ts[i].begin, ts[j].end)).cast("B")
            except CheckpointError:
                buf = None  # left to read_rows, tensor by tensor
            if buf is not None:
                for t in ts[i:j + 1]:
                    self.where[t.name] = (buf, t.begin - ts[i].begin)
            i = j + 1

    def read_rows(self, name: str, row_start: int, row_end: int):
        if name not in self.where:
            return self.reader.read_rows(name, row_start, row_end)
        t = self.ckpt.tensors[name]
        rb = t.row_bytes()
        buf, off = self.where[name]
        n = (row_end - row_start) * rb
        self.reader.counter.add(t.file, n)
        return buf[off + row_start * rb:off + row_start * rb + n]

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.where.clear()
