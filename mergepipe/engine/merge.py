"""The merge engine: a plain loop that streams the plan.

`work_list` (engine/work.py) turns the plan into typed work items in the base's tensor order:
spans of one tensor's blocks to merge or to keep, and packs of small tensors. The loop runs
each item's `load` on the reader threads, a bounded window ahead (engine/prefetch.py:
coalesced preads, blake3-checked against the index), and its `apply` on the merging thread in
order. A merged block is the base rows and only the planned expert rows, merged in fp32 (the
method's `fn`, or its compiled kernel for bf16; engine/blocks.py), cast, and pwritten at the
block's offset in the output, hashed on the way into the output's hash tree
(engine/hashing.py). Blocks no expert is planned for, where the output dtype is the base's,
keep the base's bytes: the copier (engine/copies.py) copies them file to file in the kernel on
a thread of its own, or, where the output is written around the page cache
(checkpoint/direct_io.py: file systems without reflinks), has the reader threads read them to
be appended in file order; either way they take their block hashes from the base index
(trusted through the stat cache, like every cached index; `verify --deep` rereads). Rank
cuts come from the delta index (engine/cuts.py); the file layout from engine/layout.py. The
engine knows no method by name: what a method needs is in its registry entry.
"""
from __future__ import annotations

import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from pathlib import Path

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.safetensors import INDEX_JSON, Checkpoint, CheckpointReader, OutTensor, SafetensorsWriter
from mergepipe.checkpoint.treehash import hash_weight_file
from mergepipe.checkpoint.vocab import VocabCheckpoint
from mergepipe.engine.adapter_sums import AdapterSums, summed_kernel
from mergepipe.engine.blocks import MergeState, TorchThreads, method_group
from mergepipe.engine.copies import AppendedCopies, Copier, KernelCopies
from mergepipe.engine.cuts import CutTable
from mergepipe.engine.hashing import OutputHasher
from mergepipe.engine.layout import plan_layout, shard_index_json
from mergepipe.engine.prefetch import UNIT_BYTES, UnitReader, prefetched
from mergepipe.engine.sketched import Represented
from mergepipe.engine.stats import joint_statistics
from mergepipe.engine.tensor_variants import TensorGroups
from mergepipe.engine.work import COPY_BYTES, MergeRun, OutOf, WorkItem, work_list
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.methods import get_method
from mergepipe.plan.record import PlanRecord, validate_plan
from mergepipe.util.fs import hash_file, shares_extents
from mergepipe.util.memory import keep_freed_memory
from mergepipe.util.progress import Progress


@dataclass
class Inputs:
    """Opened checkpoints with their indexes, keyed by plan expert name."""

    base: Checkpoint
    base_index: ModelIndex
    experts: dict[str, Checkpoint]
    expert_indexes: dict[str, ModelIndex]
    deltas: dict[str, DeltaIndex]
    cache_dir: Path | None = None  # the store, where joint statistics are kept (engine/stats.py)
    tokenizer_dir: Path | None = None  # output.tokenizer_source's folder (commands/tokenizer_source.py)
    sketches: dict = field(default_factory=dict)  # expert -> index.sketch.Sketch (strategy `sketch` only)


@dataclass
class Realized:
    base_bytes_read: int = 0
    base_bytes_copied: int = 0  # base bytes the output keeps unmerged: copied file to file, or appended
    kernel_bytes_copied: int = 0  # of those, copied by the kernel (copy_file_range), not the fallback
    expert_bytes_read: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    files: dict[str, dict] = field(default_factory=dict)  # name -> {tree, size} (weights) or {blake3, size}
    tensors: dict[str, str] = field(default_factory=dict)  # name -> tensor hash (checkpoint/treehash.py)
    joint_statistics: dict = field(default_factory=dict)  # {key, blake3} of a joint method's statistics
    joint_bytes_read: int = 0  # bytes the joint scan read (0: loaded from the store)
    sketch_bytes_read: int = 0  # sketch codes and scales read in place of expert blocks (strategy `sketch`)
    seconds: float = 0.0


def record_outputs(out_dir: Path, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter],
                   realized: Realized, *, block_bytes, file_hashes: dict[str, str] | None = None) -> None:
    """Record the closed weight files in `realized` (tree hashes from `file_hashes`, composed
    while writing, else by rereading the file); write the shard index json if sharded."""
    for fname, w in writers.items():
        realized.bytes_written += w.size
        digest = (file_hashes or {}).get(fname) or hash_weight_file(out_dir / fname, block_bytes)[0]
        realized.files[fname] = {"tree": digest, "size": w.size}
    if len(layout) > 1:  # sharded output: the index json that transformers follows
        index_path = out_dir / INDEX_JSON
        index_path.write_bytes(shard_index_json(layout))
        size = index_path.stat().st_size
        realized.bytes_written += size
        realized.files[INDEX_JSON] = {"blake3": hash_file(index_path), "size": size}


def run_merge(plan: PlanRecord | dict, inputs: Inputs, out_dir: Path, *, threads: int = 2, progress: bool = False,
              compiled: bool = True) -> Realized:
    """Execute `plan` into `out_dir` (an empty folder, normally a publisher's temp).

    `plan` is the typed plan record; a plan in its JSON form (a dict) is validated into one
    first (plan/record.py: a ConfigError naming the first bad key). `compiled=False` merges
    every block through the methods' torch code (the reference the compiled kernels are
    tested against); the bytes are the same."""
    rec = plan if isinstance(plan, PlanRecord) else validate_plan(plan, "plan")
    # The inputs (checkpoints, indexes, plan: an object or more per tensor) live through the
    # merge: frozen, the cyclic collector does not walk them at every collection the
    # merge's own allocations trigger (at 100k tensors that was a quarter of the merge)
    gc.freeze()
    try:
        return _run_merge(rec, inputs, out_dir, threads=threads, progress=progress, compiled=compiled)
    finally:
        gc.unfreeze()


def _run_merge(plan: PlanRecord, inputs: Inputs, out_dir: Path, *, threads: int, progress: bool,
               compiled: bool) -> Realized:
    t_start = time.monotonic()
    keep_freed_memory()  # every block allocates and frees MiB-sized temporaries
    state = merge_state(plan, inputs, compiled=compiled, threads=threads)
    base = inputs.base
    # the plan's layout, not the base's files: the same plan gives the same files (engine/layout.py)
    layout, align = plan_layout(plan, base.tensors)
    direct = _direct_writes(out_dir, base, layout)
    reads = {e.name: _read_sets(plan.reads[e.name]) for e in plan.experts}
    writers = {fname: SafetensorsWriter(out_dir / fname, ts, metadata={"format": "pt"}, align_like=align.get(fname),
                                        direct=direct) for fname, ts in layout.items()}
    out = OutOf(layout, writers)
    # direct writes take every byte in file order: copied runs go through the reader window
    work = work_list(base, inputs.base_index, out, list(reads.values()), state, output_dtype=plan.output.dtype,
                     copy_bytes=UNIT_BYTES if direct else COPY_BYTES)
    with ExitStack() as stack:  # on an error, undone last to first: nothing half-written stays
        stack.push(_on_error(_abort, writers))
        stack.callback(_close_all, inputs.sketches.values())
        reader = stack.enter_context(closing(UnitReader(base, inputs.base_index, inputs.experts,
                                                         inputs.expert_indexes, reads)))
        reader.sums = AdapterSums.of(reader, out, partial(summed_kernel, state))  # LoRA adapters: one pass
        prog = stack.enter_context(closing(Progress(base.total_bytes, "merging", progress)))
        hasher = OutputHasher(layout, writers, _block_layout(plan))
        stack.push(_on_error(_drain, hasher))
        copier = stack.enter_context(closing(_copier(direct, base, writers, prog)))
        stack.push(_on_error(copier.cancel))  # before the writers' and the base's fds close
        _loop(MergeRun(state, base, reader, out, hasher, copier, prog), work, threads)
        file_hashes = hasher.finish()
        for w in writers.values():
            w.close()
    realized = _realized(state, reader, copier, hasher.tensors)
    record_outputs(out_dir, layout, writers, realized, block_bytes=_block_layout(plan), file_hashes=file_hashes)
    realized.seconds = time.monotonic() - t_start
    return realized


def _loop(run: MergeRun, work: list[WorkItem], threads: int) -> None:
    """Every work item's load on the pool, `2 x threads` items ahead, and its apply here, in order."""
    with ThreadPoolExecutor(max(1, threads)) as pool, run.state.torch.restored():
        for item, loaded in _stream(pool, run, work, 2 * max(1, threads)):
            item.apply(run, loaded)
        run.copier.finish()


def _stream(pool: ThreadPoolExecutor, run: MergeRun, work: list[WorkItem], depth: int):
    """(item, what its load read) for each work item in order; an item that reads nothing (a
    kernel copy: engine/copies.py) gets None and takes no place in the reader window, which
    then holds only what the merging thread waits for."""
    reading = [item.reads(run) for item in work]
    loads = prefetched(pool, _load, [(item, run) for item, r in zip(work, reading) if r], depth)
    for item, r in zip(work, reading):
        yield item, (next(loads)[1] if r else None)


def _load(item: WorkItem, run: MergeRun):
    return item.load(run)


def merge_state(plan: PlanRecord, inputs: Inputs, *, compiled: bool, threads: int) -> MergeState:
    """What every block of the merge of `plan` reads; a joint method's statistics loaded or
    scanned (engine/stats.py)."""
    method = get_method(plan.method)
    experts = [e.model_dump() for e in plan.experts]  # the plan's expert entries, as the method's kernels read them
    build = partial(method_group, method, compiled=compiled)
    top = build(plan.parameters, experts)
    # the mapping plan/tensor_params reads a tensor's group from
    groups = TensorGroups(top, {"parameters": plan.parameters, "experts": experts,
                                "tensor_parameters": plan.tensor_parameters}, build)
    strategy = plan.strategy
    scales = strategy.scales if strategy is not None else {}
    sketch = strategy.sketch.blocks if strategy is not None and strategy.sketch is not None else {}
    return MergeState(method, plan.seed, groups, _scales_by_tensor(scales),
                      joint_statistics(plan, inputs, method, top.params, threads=threads),
                      Represented(sketch, inputs.sketches), inputs.base_index, inputs.deltas,
                      CutTable(inputs.deltas), TorchThreads())


def _copier(direct: bool, base: Checkpoint, writers: dict[str, SafetensorsWriter], prog: Progress) -> Copier:
    """Direct writes: the copied runs read by a sequential reader of their own (its counter is
    the bytes the output keeps) and appended. Else copied in the kernel, a virtual base's
    tensors in no file of its own (checkpoint/vocab.py) through a reader of it."""
    if direct:
        return AppendedCopies(CheckpointReader(base, random_access=False), writers, prog)
    virtual = CheckpointReader(base, random_access=False) if isinstance(base, VocabCheckpoint) else None
    return KernelCopies(base, writers, prog, virtual)


def _realized(state: MergeState, reader: UnitReader, copier: Copier, tensors: dict[str, str]) -> Realized:
    """The merge's counters, and the tensor hashes (the hasher's own dict: no second copy)."""
    joint = state.joint
    return Realized(base_bytes_read=reader.base_counter.total, base_bytes_copied=copier.bytes,
                    kernel_bytes_copied=copier.kernel_bytes,
                    expert_bytes_read={name: c.total for name, c in sorted(reader.counters.items())},
                    tensors=tensors, sketch_bytes_read=state.sketched.bytes_read,
                    joint_statistics={"key": joint.key, "blake3": joint.digest} if joint is not None else {},
                    joint_bytes_read=joint.bytes_read if joint is not None else 0)


def _block_layout(plan: PlanRecord) -> BlockLayout:
    return BlockLayout(plan.block_bytes, plan.embedding_block_bytes)


def _on_error(fn, *args):
    """An ExitStack exit callback: fn(*args) where the block raised; the error goes on."""
    def exit_(exc_type, exc, tb) -> bool:
        if exc_type is not None:
            fn(*args)
        return False
    return exit_


def _abort(writers: dict[str, SafetensorsWriter]) -> None:
    for w in writers.values():
        w.abort()


def _drain(hasher: OutputHasher) -> None:
    """Stop the hasher's thread after an error; the first error is the one to report."""
    try:
        hasher.finish()
    except BaseException:
        pass


def _close_all(things) -> None:
    for thing in things:
        thing.close()


def _direct_writes(out_dir: Path, base: Checkpoint, layout: dict[str, list[OutTensor]]) -> bool:
    """Whether the output files are written in order around the page cache
    (checkpoint/direct_io.py): where the output is laid out in the base's tensor order (the
    loop then writes each file front to back) on a file system whose copy_file_range copies
    (ext4; not btrfs/XFS, whose reflinks share the copied runs' extents instead), unless
    MERGEPIPE_DIRECT_WRITES=0."""
    if os.environ.get("MERGEPIPE_DIRECT_WRITES", "1") == "0" or shares_extents(out_dir):
        return False
    return [n for ts in layout.values() for n in map(itemgetter(0), ts)] == list(base.tensors.names)


def _read_sets(reads: dict[str, list[int]]) -> dict[str, list[int] | frozenset[int]]:
    """An expert's planned blocks per tensor for `in` tests: the plan's own short lists
    (one or a few blocks: a set per tensor was 10% of a 100k-tensor merge's memory), sets
    for long ones. Read only: where every list is short, the plan's own dict."""
    if max(map(len, reads.values()), default=0) <= 8:
        return reads
    return {t: bs if len(bs) <= 8 else frozenset(bs) for t, bs in reads.items()}


def _scales_by_tensor(scales: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The plan strategy's rescale factors (`strategy.scales`: expert -> tensor -> c != 1),
    by tensor; empty for plans without a rescaling strategy."""
    out: dict[str, dict[str, float]] = {}
    for expert, per in scales.items():
        for tensor, c in per.items():
            if c != 1.0:
                out.setdefault(tensor, {})[expert] = float(c)
    return out
