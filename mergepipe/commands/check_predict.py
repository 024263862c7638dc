"""`mergepipe check`'s prediction (commands/check.py): what a merge will read, write, keep in
the cache, hold in memory and take, from the base's safetensors header, the budget and the
cache's stat entries. Every number is an estimate, mostly an upper bound: blocks identical
to the base, which the index finds by reading, cost nothing in the merge.

The one read of tensor bytes is `probe_bandwidth`: a few MiB of one base shard, once, timed.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.checkpoint.blocks import BlockLayout, num_rows, row_bytes
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, FS_BLOCK, ITEMSIZE, Checkpoint
from mergepipe.engine.layout import OUT_DTYPES, mirror_layout
from mergepipe.engine.prefetch import UNIT_BYTES
from mergepipe.index.ranks import requested_ranks
from mergepipe.index.sketch import sketch_cost
from mergepipe.index.store import Store
from mergepipe.units import format_bytes

PROBE_BYTES = 8 << 20  # what the bandwidth probe reads, at most
STARTUP_SECONDS = 1.0  # a `mergepipe run` process importing torch, before it reads anything
# the lowest share of the read bandwidth full merges reached (cold runs, docs/history/benchmarks-rounds.md)
MERGE_SHARE = 0.25
PROCESS_BYTES = 300 << 20  # Python, torch and numpy imported (ru_maxrss of the imports, measured)
# index entry sizes (index/binfmt.py): a model index holds per block its row range and blake3, per
# tensor its name, dtype and shape; a delta index per block l2, max, nnz and identical, per tensor
# five sums and per rank cut (index/ranks.requested_ranks) a rank, value and two counts, and
# where a cut splits a run of equal values a count per block (counted for every cut: at most)
MODEL_BLOCK_BYTES, MODEL_TENSOR_BYTES = 48, 64
DELTA_BLOCK_BYTES, DELTA_TENSOR_BYTES, CUT_BYTES, CUT_BLOCK_BYTES = 25, 40, 32, 8


@dataclass(slots=True)
class Sizes:
    """The base's tensors as the merge sees them, from its header (in a layout)."""

    base_bytes: int = 0
    float_bytes: int = 0  # what one expert can be read for at most (float tensors only are merged)
    float_elements: int = 0
    tensors: int = 0
    name_bytes: int = 0
    blocks: int = 0
    cuts: int = 0  # rank cuts of every float tensor (index/ranks.requested_ranks)
    cut_blocks: int = 0  # sum over float tensors of cuts x blocks
    largest_unit: int = 0  # base bytes of the largest prefetch unit (engine/prefetch.py)
    largest_block_elements: int = 0
    # (bytes, elements) of each float tensor's smallest block, each pair once: the cheapest reads
    smallest_blocks: set[tuple[int, int]] = field(default_factory=set)


def header_sizes(base: Checkpoint, layout: BlockLayout) -> Sizes:
    """The base's sizes, block counts and smallest blocks in `layout` (arithmetic on the header:
    checkpoint/blocks.block_ranges' rule without listing every range)."""
    s = Sizes()
    seen: dict[tuple, tuple[int, int, int, int, int, int]] = {}  # tensors of one dtype, shape and block size
    table = base.tensors
    columns = zip(table.names, table.dtypes, table.shapes, table.begins, table.ends)
    for name, dtype, shape, begin, end in columns:
        nbytes = end - begin
        s.base_bytes += nbytes
        s.tensors += 1
        s.name_bytes += len(name)
        if dtype not in FLOAT_DTYPES or nbytes == 0:
            s.blocks += 1
            continue
        key = (dtype, shape, layout.bytes_for(name, shape) if layout.embedding_block_bytes else 0)
        if key not in seen:
            seen[key] = _tensor_sizes(nbytes, ITEMSIZE[dtype], shape, layout.bytes_for(name, shape))
        numel, n_blocks, cuts, block, last, unit = seen[key]
        s.float_bytes += nbytes
        s.float_elements += numel
        s.blocks += n_blocks
        s.cuts += cuts
        s.cut_blocks += cuts * n_blocks
        s.largest_block_elements = max(s.largest_block_elements, block // ITEMSIZE[dtype])
        s.largest_unit = max(s.largest_unit, unit)
        s.smallest_blocks.add((last, last // ITEMSIZE[dtype]))
    return s


def index_bytes(s: Sizes) -> tuple[int, int]:
    """(bytes of a model index, bytes of an expert's delta index) in the cache, and about as much
    in memory once read (decoded as columns)."""
    model = s.blocks * MODEL_BLOCK_BYTES + s.tensors * MODEL_TENSOR_BYTES + s.name_bytes
    delta = s.blocks * DELTA_BLOCK_BYTES + s.tensors * DELTA_TENSOR_BYTES + s.name_bytes \
        + s.cuts * CUT_BYTES + s.cut_blocks * CUT_BLOCK_BYTES
    return model, delta


def _tensor_sizes(nbytes: int, itemsize: int, shape: tuple[int, ...], block_bytes: int
                  ) -> tuple[int, int, int, int, int, int]:
    """(elements, blocks, rank cuts, bytes of a full block, of the last block, of its largest
    prefetch unit) of a float tensor of `nbytes` > 0 with blocks of about `block_bytes`."""
    rows = num_rows(shape)
    per_block = rows if len(shape) <= 1 else max(1, block_bytes // max(1, row_bytes(shape, itemsize)))
    n_blocks = math.ceil(rows / per_block)
    row = nbytes // rows
    block = min(rows, per_block) * row
    last = (rows - (n_blocks - 1) * per_block) * row
    numel = nbytes // itemsize
    return numel, n_blocks, len(requested_ranks(numel)), block, last, min(nbytes, max(UNIT_BYTES, block))


def output_files(base: Checkpoint, dtype: str | None, shard_bytes: int | None) -> tuple[int, int]:
    """(bytes, files) of the output's weight files, at most: the base's tensors in the output
    dtype, in the layout the merge writes (engine/layout.py mirror_layout), the base's header
    sizes, and per file the padding that aligns its data like the base's (up to FS_BLOCK)."""
    layout = mirror_layout(base, dtype=dtype, shard_bytes=shard_bytes)
    data = sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for ts in layout.values() for t in ts)
    return data + sum(len(h.header_bytes) for h in base.files) + FS_BLOCK * len(layout), len(layout)


def indexed(store: Store, ckpt: Checkpoint, layout: BlockLayout) -> bool:
    """Whether every file of `ckpt` has a stat entry in the cache that its stat still matches
    (then its index is read from the cache, not rebuilt: index/store.py)."""
    for h in ckpt.files:
        try:
            entry = json.loads(store._stat_path(h.path, layout).read_text())  # the store's own key
        except (OSError, ValueError):
            return False
        if not isinstance(entry, dict) or entry.get("stat") != store._stat(h.path):
            return False
    return True


def probe_bandwidth(base: Checkpoint) -> tuple[float, Path, int] | None:
    """(bytes/s, file, bytes read) reading up to PROBE_BYTES of the base's largest weight file
    once, past its header, after asking the kernel to drop those pages (a cold read where it
    can); None when there is nothing to read."""
    h = max(base.files, key=lambda f: f.size - f.data_start)
    n = min(PROBE_BYTES, h.size - h.data_start)
    if n <= 0:
        return None
    fd = os.open(h.path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, h.data_start, n, os.POSIX_FADV_DONTNEED)
        start, got = time.perf_counter(), 0
        while got < n:
            chunk = os.pread(fd, min(1 << 20, n - got), h.data_start + got)
            if not chunk:
                break
            got += len(chunk)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return (got / max(seconds, 1e-6), h.path, got) if got else None


@dataclass(frozen=True, slots=True)
class Prediction:
    lines: list[str]
    disk_short: str | None  # a warning when a file system has less free space than needed


def predict(*, sizes: Sizes, out_bytes: int, out_files: int, out_dtype: str | None, budget_bytes: int,
            full_read: int, experts: int, new_models: int, new_experts: int, base_indexed: bool,
            sketches: bool, threads: int, out_dir: Path, cache_dir: Path,
            bandwidth: tuple[float, Path, int] | None, cut_scans: bool = False) -> Prediction:
    """The prediction lines. `budget_bytes`: the budget resolved against `full_read` (every
    float block of every expert, the most a full merge reads); `new_models`/`new_experts`:
    the models (base included) and experts not indexed yet; `sketches`: the sketch strategy;
    `cut_scans`: a density or gamma off the index's grid (commands/cuts.py: one more scan)."""
    read_experts = min(budget_bytes, full_read)
    # base rows are read where a block is merged (all of them when the output is cast)
    base_read = sizes.base_bytes if out_dtype else sizes.float_bytes
    # indexing reads a new base once and each new expert with the base beside it (one scan)
    index_reads = (0 if base_indexed else sizes.base_bytes) + new_experts * 2 * sizes.base_bytes
    # a sketch per float block of each expert: 2 bits an element and a 4-byte scale (index/sketch.py)
    per_expert = sketch_cost(sizes.float_elements) + max(0, sizes.blocks - 1) * sketch_cost(0)
    sketch_bytes = experts * per_expert if sketches else 0
    sketch_reads = experts * 2 * sizes.base_bytes if sketches else 0  # upper bound: sketches may be cached
    cut_reads = experts * 2 * sizes.base_bytes if cut_scans else 0  # upper bound: the cuts may be cached
    model_index, delta_index = index_bytes(sizes)
    cache_indexes = new_models * model_index + new_experts * delta_index
    lines = [f"read: at most {format_bytes(read_experts)} of {format_bytes(full_read)} expert bytes"
             + (" (sketches included)" if sketches else "") + f" and {format_bytes(base_read)} of the base; "
             + (f"indexing first reads {format_bytes(index_reads)} ({new_models} model(s) not in the cache)"
                if index_reads else "every model is indexed in the cache")
             + (f"; sketching reads at most {format_bytes(sketch_reads)}" if sketches else "")
             + (f"; exact cuts off the grid read at most {format_bytes(cut_reads)}" if cut_scans else "")]
    lines.append(f"write: at most {format_bytes(out_bytes)} in {out_files} weight file(s)"
                 + (f" ({OUT_DTYPES[out_dtype]})" if out_dtype else " (the base's dtypes)"))
    cache_new = cache_indexes + sketch_bytes
    sketch_text = f" + at most {format_bytes(sketch_bytes)} of sketches" if sketches else ""
    lines.append(f"disk: {format_bytes(out_bytes + cache_new)}: the output {format_bytes(out_bytes)}, "
                 f"the cache {format_bytes(cache_indexes)} of indexes{sketch_text}")
    window = (2 * max(1, threads) + 1) * (experts + 1) * sizes.largest_unit
    math_bytes = (experts + 2) * sizes.largest_block_elements * 4
    index_memory = (experts + 1) * model_index + experts * delta_index
    peak = PROCESS_BYTES + window + math_bytes + index_memory
    lines.append(f"memory: about {format_bytes(peak)} at peak: the process {format_bytes(PROCESS_BYTES)}"
                 f" + the reader window (2 x {max(1, threads)} threads + 1) x {experts + 1} models x "
                 f"{format_bytes(sizes.largest_unit)} = {format_bytes(window)} + fp32 block math "
                 f"{format_bytes(math_bytes)} + indexes {format_bytes(index_memory)}")
    moved = index_reads + sketch_reads + cut_reads + read_experts + base_read + out_bytes
    if bandwidth is None:
        lines.append("time: unknown (no bandwidth measured); it reads and writes about "
                     f"{format_bytes(moved)}")
    else:
        rate, path, probed = bandwidth
        io = moved / rate
        low, high = _seconds(STARTUP_SECONDS + io), _seconds(STARTUP_SECONDS + io / MERGE_SHARE)
        lines.append(f"time: roughly {low if low == high else f'{low} to {high}'}:"
                     f" about {format_bytes(moved)} read and written at {format_bytes(int(rate))}/s "
                     f"(measured reading {format_bytes(probed)} of {path.name}); index builds and merges ran at "
                     f"{MERGE_SHARE:.0%} to 100% of the read bandwidth (BENCHMARKS.md)")
    return Prediction(lines, _disk_short([(out_dir, out_bytes), (cache_dir, cache_new)]))


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 \
        else f"{s / 3600:.1f} h"


def _disk_short(needs: list[tuple[Path, int]]) -> str | None:
    """A warning when the free space where a folder goes is less than what goes there (per file
    system: the output and the cache may share one)."""
    by_device: dict[int, tuple[Path, int]] = {}
    for folder, nbytes in needs:
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is None:
            continue
        dev = existing.stat().st_dev
        where, total = by_device.get(dev, (existing, 0))
        by_device[dev] = (where, total + nbytes)
    for where, total in by_device.values():
        free = shutil.disk_usage(where).free
        if free < total:
            return (f"disk: {format_bytes(free)} free at {where}, the merge needs about "
                    f"{format_bytes(total)} there")
    return None
