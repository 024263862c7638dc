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

from mergepipe.checkpoint.blocks import block_ranges
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, CheckpointReader, ReadCounter, TensorInfo
from mergepipe.errors import CheckpointError
from mergepipe.index.records import DeltaIndex, ModelIndex, TensorDelta, TensorEntry, content_hash
from mergepipe.index.scan import DeltaTensorScan
from mergepipe.util.memory import keep_freed_memory
from mergepipe.util.progress import Progress


def _blocks(t: TensorInfo, block_bytes: int) -> list[tuple[int, int]]:
    return block_ranges(t.shape, t.itemsize, block_bytes)


def _hash_tensor(reader: CheckpointReader, t: TensorInfo, block_bytes: int,
                 progress: Progress | None = None) -> TensorEntry:
    ranges = _blocks(t, block_bytes)
    hashes = []
    for a, b in ranges:
        buf = reader.read_rows(t.name, a, b)
        hashes.append(blake3(buf).hexdigest())
        if progress:
            progress.step(len(buf))
    return TensorEntry(t.name, t.dtype, t.shape, tuple(ranges), tuple(hashes))


def build_model_index(ckpt: Checkpoint, *, block_bytes: int, threads: int = 2,
                      counter: ReadCounter | None = None, progress: bool = False) -> ModelIndex:
    """Hash every block of a checkpoint (one read of every byte)."""
    prog = Progress(ckpt.total_bytes, f"hashing {ckpt.root.name}", progress)
    with CheckpointReader(ckpt, counter=counter, random_access=False) as reader:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            entries = list(pool.map(lambda t: _hash_tensor(reader, t, block_bytes, prog), ckpt.tensors.values()))
    tensors = {e.name: e for e in entries}
    return ModelIndex(content_hash(tensors), block_bytes, tensors)


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
    _, delta = _scan(base, expert, base_index, ranges, expert_index.block_bytes, threads, cache_bytes, counter,
                     {name: e.hashes for name, e in expert_index.tensors.items()}, progress)
    return DeltaIndex(expert_index.content_hash, base_index.content_hash, expert_index.block_bytes, delta)


def build_expert_index(base: Checkpoint, expert: Checkpoint, base_index: ModelIndex, *, block_bytes: int,
                       threads: int = 2, cache_bytes: int = 256 << 20,
                       counter: ReadCounter | None = None, progress: bool = False) -> tuple[ModelIndex, DeltaIndex]:
    """The expert's ModelIndex and its DeltaIndex against `base` in one scan: the block
    hashes come from the same reads as the statistics (one read of the expert, not two)."""
    ranges = {name: tuple(_blocks(t, block_bytes)) for name, t in expert.tensors.items()}
    hashes, delta = _scan(base, expert, base_index, ranges, block_bytes, threads, cache_bytes, counter, None,
                          progress)
    tensors = {name: TensorEntry(name, t.dtype, t.shape, ranges[name], hashes[name])
               for name, t in expert.tensors.items()}
    index = ModelIndex(content_hash(tensors), block_bytes, tensors)
    return index, DeltaIndex(index.content_hash, base_index.content_hash, block_bytes, delta)


def _scan(base: Checkpoint, expert: Checkpoint, base_index: ModelIndex, ranges: dict, block_bytes: int,
          threads: int, cache_bytes: int, counter: ReadCounter | None,
          expected: dict[str, tuple[str, ...]] | None, progress: bool) -> tuple[dict, dict[str, TensorDelta]]:
    """Scan every tensor of `expert` against `base`: (block hashes, TensorDelta) by name."""
    check_compatible(base, expert)
    prog = Progress(expert.total_bytes, f"indexing {expert.root.name} against {base.root.name}", progress)
    keep_freed_memory()
    if base_index.block_bytes != block_bytes:
        raise ValueError(f"base index has block_bytes {base_index.block_bytes}, expert {block_bytes}")
    with CheckpointReader(base, counter=counter, random_access=False) as base_r, \
            CheckpointReader(expert, counter=counter, random_access=False) as exp_r:
        def scan(name: str) -> tuple[tuple[str, ...], TensorDelta]:
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
                                    cache_bytes)
            scan.progress = prog
            delta = scan.run()
            return tuple(scan.hashes), delta
        # parallel across tensors (the kernels, numpy and blake3 release the GIL), largest
        # first, so that the big embedding does not start last and run alone
        order = sorted(base.tensors, key=lambda n: -base.tensors[n].numel)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            done = dict(zip(order, pool.map(scan, order)))
    return ({name: done[name][0] for name in base.tensors},
            {name: done[name][1] for name in base.tensors})
