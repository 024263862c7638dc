"""The merge engine: a plain loop that streams the plan.

For each tensor in the base's order, for each block: where no expert block is
planned and the output dtype is the base's, the output is the base's bytes: runs of
such blocks are copied file to file in the kernel (util.fs.copy_range:
copy_file_range, else pread/pwrite) on a thread of their own (engine/copies.py), or,
where the output is written around the page cache (checkpoint/direct_io.py: file systems
without reflinks), read and appended in file order; either way they take their block
hashes from the base index
(trusted through the stat cache, like every cached index; `verify --deep` rereads).
Elsewhere: read the base rows and only the planned expert rows (engine/prefetch.py:
coalesced preads, blake3-checked against the index), merge in fp32 (the method's
`fn`, or its compiled kernel for bf16), cast, and pwrite at the block's offset in the
output, hashing it on the way into the output's hash tree (engine/hashing.py). Rank cuts
come from the delta index (engine/cuts.py); the file layout from engine/layout.py. The engine
knows no method by name: what a method needs is in its registry entry.
"""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import accumulate, repeat
from operator import contains, itemgetter, or_
from pathlib import Path

from mergepipe.util.lazy import torch

from mergepipe.checkpoint import safetensors as st
from mergepipe.checkpoint.safetensors import (FLOAT_DTYPES, INDEX_JSON, Checkpoint, CheckpointReader, OutTensor,
                                              SafetensorsWriter, TensorInfo, as_tensor, tensor_bytes)
from mergepipe.engine.cuts import CutTable
from mergepipe.engine.hashing import OutputHasher
from mergepipe.engine.copies import BackgroundCopies
from mergepipe.engine.layout import plan_layout, shard_index_json
from mergepipe.engine.packs import (Pack, PackBuilder, PackRead, block_digests, pack_runs, packable, read_pack,
                                   slice_digests)
from mergepipe.engine.tensor_variants import TensorVariants
from mergepipe.plan.tensor_params import group_index, view
from mergepipe.engine.prefetch import UNIT_BYTES, Got, UnitReader, prefetched
from mergepipe.engine.sketched import Represented
from mergepipe.engine.stats import JointStatistics, joint_statistics
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.errors import MethodError
from mergepipe.methods import Method, get_method
from mergepipe.methods.base import BlockInputs, ExpertBlock, RawBlock, expert_knobs
from mergepipe.methods.slerp import cosine_from_sums
from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.treehash import hash_weight_file
from mergepipe.checkpoint.vocab import VocabCheckpoint
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


MERGE, COPY, PACK = "merge", "copy", "pack"
COPY_BYTES = 64 << 20  # base bytes per in-kernel copy (runs are cut so that the pool shares them)


def segments(t: TensorInfo, ranges: tuple[tuple[int, int], ...], planned: set[int], *,
             copy_ok: bool, copy_bytes: int = COPY_BYTES) -> list[tuple[str, list[int]]]:
    """A tensor's blocks in order, grouped into (MERGE, unit) runs of planned blocks (read
    with one pread, about UNIT_BYTES) and (COPY, run) runs of blocks no expert is planned
    for (the base's bytes, copied file to file, about COPY_BYTES). Without `copy_ok` (the
    output dtype differs) every block is merged (cast)."""
    out: list[tuple[str, list[int]]] = []
    row_bytes = t.row_bytes()
    size = 0
    for b, (r0, r1) in enumerate(ranges):
        kind = MERGE if (b in planned or not copy_ok) else COPY
        nbytes = (r1 - r0) * row_bytes
        limit = UNIT_BYTES if kind == MERGE else copy_bytes
        if out and out[-1][0] == kind and size + nbytes <= limit:
            out[-1][1].append(b)
            size += nbytes
        else:
            out.append((kind, [b]))
            size = nbytes
    return out


@dataclass(frozen=True, slots=True)
class _Expert:
    """A plan expert as every block of the merge sees it."""

    name: str
    content_hash: str
    weight: float
    knobs: dict[str, float]  # density / gamma (methods.base.expert_knobs)


@dataclass
class _Merge:
    """What stays the same for every block of one merge."""

    method: Method
    params: object  # the method's typed parameters
    seed: int
    experts: list[_Expert]  # canonical order (content hash)
    inputs: Inputs
    cuts: CutTable
    hasher: OutputHasher
    kernel: object | None  # the method's compiled kernel (RawBlock -> bytes), or None
    # tensor -> expert -> factor on its read delta (plan `strategy.scales`, only != 1);
    # a tensor listed here always takes the torch path (the kernels have no scale)
    scales: dict[str, dict[str, float]] = field(default_factory=dict)
    torch_threads: list[int] = field(default_factory=list)  # torch's thread count before, once set (_torch_path)
    joint: JointStatistics | None = None  # a joint method's per-tensor statistics (engine/stats.py)
    # the method's output differs from the base where no expert is read (Method.rewrites_base):
    # no float block is copied or passed through, every one goes through `fn`
    rewrites: bool = False
    # per-tensor parameters (plan `tensor_parameters`): the state for each tensor's group
    variants: TensorVariants | None = None
    # blocks read as sketches (plan `strategy.sketch`; engine/sketched.py), shared by variants'
    # copies: bf16 task arithmetic and TIES merge them in C, other methods on the torch path
    sketched: Represented = field(default_factory=lambda: Represented({}, {}))


def run_merge(plan: dict, inputs: Inputs, out_dir: Path, *, threads: int = 2, progress: bool = False,
              compiled: bool = True) -> Realized:
    """Execute `plan` into `out_dir` (an empty folder, normally a publisher's temp).

    `compiled=False` merges every block through the methods' torch code (the
    reference the compiled kernels are tested against); the bytes are the same."""
    # The inputs (checkpoints, indexes, plan: an object or more per tensor) live through the
    # merge: frozen, the cyclic collector does not walk them at every collection the
    # merge's own allocations trigger (at 100k tensors that was a quarter of the merge)
    gc.freeze()
    try:
        return _run_merge(plan, inputs, out_dir, threads=threads, progress=progress, compiled=compiled)
    finally:
        gc.unfreeze()


# Long: to read top to bottom with typed work items: issue 23 item 5.
def _run_merge(plan: dict, inputs: Inputs, out_dir: Path, *, threads: int, progress: bool,  # noqa: C901, PLR0915
               compiled: bool) -> Realized:
    t_start = time.monotonic()
    keep_freed_memory()  # every block allocates and frees MiB-sized temporaries
    method = get_method(plan["method"])
    params = method.params.model_validate(plan["parameters"])
    plan_experts = plan["experts"]  # canonical order (content hash)
    experts = [_Expert(e["name"], e["content_hash"], float(e["weight"]), expert_knobs(params, e))
               for e in plan_experts]
    reads = {e["name"]: _read_sets(plan["reads"][e["name"]]) for e in plan_experts}
    base = inputs.base
    # the plan's layout, not the base's files: the same plan gives the same files (engine/layout.py)
    layout, align = plan_layout(plan, base.tensors)
    realized = Realized()
    direct = _direct_writes(out_dir, base, layout)
    writers = {fname: SafetensorsWriter(out_dir / fname, ts, metadata={"format": "pt"}, align_like=align.get(fname),
                                        direct=direct) for fname, ts in layout.items()}
    out_of = _OutOf(layout, writers)
    reader = UnitReader(base, inputs.base_index, inputs.experts, inputs.expert_indexes, reads)
    kernel = method.compiled(params, plan_experts) if method.compiled is not None and compiled else None
    joint = joint_statistics(plan, inputs, method, params, threads=threads)  # None unless method.joint
    if joint is not None:
        realized.joint_statistics = {"key": joint.key, "blake3": joint.digest}
        realized.joint_bytes_read = joint.bytes_read
    rewrites = method.rewrites_base is not None and method.rewrites_base(params)
    rewrites_at = _group_rewrites(plan, method, rewrites)
    per_expert = list(reads.values())
    sketched = Represented(plan, inputs.sketches)
    work = _work_list(plan, base, inputs.base_index, layout, writers, out_of, per_expert, sketched.by_tensor,
                      rewrites, rewrites_at, copy_bytes=UNIT_BYTES if direct else COPY_BYTES)
    hasher: OutputHasher | None = None
    copies: BackgroundCopies | None = None
    base_fds: dict[Path, int] = {}
    # direct writes: the copied runs' reads (their counter is the bytes the output keeps unmerged)
    copy_reader = CheckpointReader(base, random_access=False) if direct else None
    # a virtual base's tensors in no file of its own (checkpoint/vocab.py) are copied through it
    virtual_reader = CheckpointReader(base, random_access=False) if isinstance(base, VocabCheckpoint) else None
    prog = Progress(base.total_bytes, "merging", progress)
    try:
        for h in base.files:
            base_fds[h.path] = os.open(h.path, os.O_RDONLY)
        hasher = OutputHasher(layout, writers, BlockLayout.of_plan(plan))
        m = _Merge(method, params, plan["seed"], experts, inputs, CutTable(inputs.deltas), hasher, kernel,
                   _scales_by_tensor(plan), rewrites=rewrites, joint=joint, sketched=sketched)
        if "tensor_parameters" in plan:
            m.variants = TensorVariants(plan, lambda state, p, es: _for_group(state, p, es, compiled))

        def rows(name: str, blocks: list[int]) -> tuple[int, int]:
            ranges = inputs.base_index.tensors[name].ranges
            return ranges[blocks[0]][0], ranges[blocks[-1]][1]

        def load(name: str | Pack, kind: str, blocks: list[int]):
            if kind == PACK:
                if name.kind == COPY:  # direct writes only: the bytes the output keeps
                    return copy_reader.read_range(name.first, name.begin, name.end)
                return read_pack(name, reader.base, reader.base_index, reader.base_reader, reader.experts,
                                 reader.expert_indexes, reader.readers, reader.reads)
            if kind == COPY:  # direct writes only
                return copy_reader.read_rows(name, *rows(name, blocks))
            base_buf, got = reader.load(name, blocks)
            return base_buf, got, sketched.read_unit(base.tensors[name], inputs.base_index.tensors[name].ranges, blocks)

        def copy_run(name: str, blocks: list[int]) -> tuple[int, int]:
            t, (r0, r1) = base.tensors[name], rows(name, blocks)
            nbytes = (r1 - r0) * t.row_bytes()
            if t.file not in base_fds:
                begin = t.begin + r0 * t.row_bytes()
                writers[out_of[name][0]].write_rows(name, r0, virtual_reader.read_range(t, begin, begin + nbytes))
                return nbytes, 0
            return nbytes, writers[out_of[name][0]].copy_rows(name, r0, base_fds[t.file],
                                                               t.begin + r0 * t.row_bytes(), nbytes)

        # Buffered writes: the reader window holds only what the merging thread waits for, and
        # copied runs go to the copier as the loop passes them. Direct writes take every byte
        # in file order: copied runs are read by the reader threads (not hashed: their hashes
        # are the index's) and appended like merged blocks (engine/copies.py)
        to_read = work if direct else [w for w in work if not _is_copy(w)]
        copies = BackgroundCopies(prog)
        with ThreadPoolExecutor(max(1, threads)) as pool, _torch_threads(m):
            loaded = prefetched(pool, load, to_read, 2 * max(1, threads))
            for name, kind, blocks in work:
                if kind == PACK:
                    if name.kind == COPY:
                        if direct:
                            writers[name.out_file].write_rows(name.names[0], 0, next(loaded)[1])
                            prog.step(name.end - name.begin)
                        else:
                            copies.submit(_copy_pack, name, writers, base_fds, virtual_reader)
                        m.hasher.add_whole(name.names, block_digests(inputs.base_index, name.names), digests=True)
                    else:
                        _finish_pack(m, name, next(loaded)[1], out_of, writers)
                        prog.step(name.end - name.begin)
                    continue
                entry = inputs.base_index.tensors[name]
                if kind == MERGE:
                    base_buf, got, payloads = next(loaded)[1]
                    sketched.arrived(payloads)
                    fname, out_t = out_of[name]
                    _merge_unit(m, base.tensors[name], out_t, blocks, base_buf, got, writers[fname])
                    prog.step(len(base_buf))
                else:
                    if direct:
                        buf = next(loaded)[1]
                        writers[out_of[name][0]].write_rows(name, entry.ranges[blocks[0]][0], buf)
                        prog.step(len(buf))
                    else:
                        copies.submit(copy_run, name, blocks)
                    hasher.add_digests(name, [bytes.fromhex(entry.hashes[b]) for b in blocks])
                if blocks[-1] == len(entry.ranges) - 1:
                    hasher.end_tensor(name)
                    m.cuts.drop(name)
            copies.finish()
        realized.base_bytes_copied = copies.bytes + (copy_reader.counter.total if copy_reader else 0)
        realized.kernel_bytes_copied = copies.kernel_bytes
        file_hashes = hasher.finish()
        realized.tensors = hasher.tensors  # the hasher is done with it: no second 100k-entry dict
        for w in writers.values():
            w.close()
    except BaseException:
        if copies is not None:
            copies.cancel()  # before the writers' and the base's fds close
        if hasher is not None:
            try:
                hasher.finish()
            except BaseException:
                pass  # the first error is the one to report
        for w in writers.values():
            w.abort()
        raise
    finally:
        prog.close()
        reader.close()
        if copy_reader is not None:
            copy_reader.close()
        if virtual_reader is not None:
            virtual_reader.close()
        for sk in inputs.sketches.values():
            sk.close()
        for fd in base_fds.values():
            os.close(fd)
    record_outputs(out_dir, layout, writers, realized, block_bytes=BlockLayout.of_plan(plan), file_hashes=file_hashes)
    realized.base_bytes_read = reader.base_counter.total
    realized.expert_bytes_read = {name: c.total for name, c in sorted(reader.counters.items())}
    realized.sketch_bytes_read = sketched.bytes_read
    realized.seconds = time.monotonic() - t_start
    return realized


def _direct_writes(out_dir: Path, base: Checkpoint, layout: dict[str, list[OutTensor]]) -> bool:
    """Whether the output files are written in order around the page cache
    (checkpoint/direct_io.py): where the output is laid out in the base's tensor order (the
    loop then writes each file front to back) on a file system whose copy_file_range copies
    (ext4; not btrfs/XFS, whose reflinks share the copied runs' extents instead), unless
    MERGEPIPE_DIRECT_WRITES=0."""
    if os.environ.get("MERGEPIPE_DIRECT_WRITES", "1") == "0" or shares_extents(out_dir):
        return False
    return [n for ts in layout.values() for n in map(itemgetter(0), ts)] == list(base.tensors.names)


def _work_list(plan: dict, base: Checkpoint, base_index: ModelIndex, layout: dict[str, list[OutTensor]],
               writers: dict[str, SafetensorsWriter], out_of: _OutOf, per_expert: list[dict], sketched: dict,
               rewrites: bool, rewrites_at, *, copy_bytes: int = COPY_BYTES) -> list[tuple]:
    """(tensor, MERGE | COPY, blocks) or (Pack, PACK, ()) for every tensor, in base order:
    small single-block tensors in packs (engine/packs.py), the others in segments."""
    table = base.tensors
    names = table.names
    grouped = "tensor_parameters" in plan  # else every tensor has the top-level parameters
    # per tensor, whether some expert's plan reads its block 0 (or sketches it): a few C-speed
    # passes over the names, not a generator per tensor
    first_planned = [False] * len(names)
    for r in per_expert:
        first_planned = list(map(or_, first_planned, map(contains, map(r.get, names, repeat(())), repeat(0))))
    if sketched:
        first_planned = list(map(or_, first_planned, map(sketched.__contains__, names)))
    counts = block_counts(base_index, names)
    work: list[tuple] = []

    def copy_ok(i: int) -> bool:  # the output keeps tensor i's dtype and the method its unread blocks
        name, dtype = names[i], table.dtypes[i]
        return out_of[name][1].dtype == dtype and not ((rewrites_at(name) if grouped else rewrites)
                                                       and dtype in FLOAT_DTYPES)

    def add_tensor(i: int) -> None:
        name = names[i]
        planned = set().union(*(r.get(name, ()) for r in per_expert), *sketched.get(name, {}).values())
        ranges = base_index.tensors[name].ranges
        work.extend((name, kind, blocks) for kind, blocks in segments(table.info(i), ranges, planned,
                                                                         copy_ok=copy_ok(i), copy_bytes=copy_bytes))

    kinds = _pack_kinds(plan, table, layout, grouped, rewrites, first_planned)
    if kinds is not None:  # a run of packs at a time (packs.pack_runs)
        starts = list(accumulate(map(len, layout.values()), initial=0))
        for what, x in pack_runs(table, counts, kinds, list(zip(layout, starts))):
            if what == "pack":
                work.append((x, PACK, ()))
            else:
                add_tensor(x)
        return work
    packs = PackBuilder(table)
    for i, (name, n_blocks, planned) in enumerate(zip(names, counts, first_planned)):
        # small tensors: one unit per run of them (engine/packs.py)
        if packable(table.ends[i] - table.begins[i], n_blocks) and copy_ok(i) \
                and (not grouped or group_index(plan, name) is None):
            fname = out_of[name][0]
            done = packs.add(i, MERGE if planned else COPY, fname, writers[fname].offset_of(name, 0))
            if done is not None:
                work.append((done, PACK, ()))
            continue
        if (done := packs.flush()) is not None:
            work.append((done, PACK, ()))
        add_tensor(i)
    if (done := packs.flush()) is not None:
        work.append((done, PACK, ()))
    return work


def _pack_kinds(plan: dict, table, layout: dict[str, list[OutTensor]], grouped: bool, rewrites: bool,
                first_planned: list[bool]) -> list[str | None] | None:
    """Per tensor, MERGE or COPY where it may join a pack as far as its dtype goes (None: its
    output dtype differs, or the method rewrites its float blocks); None when the tensors
    must be taken one by one (per-tensor parameters, or an output laid out in another order)."""
    if grouped or [n for ts in layout.values() for n in map(itemgetter(0), ts)] != table.names:
        return None
    out_dtypes = [t[1] for ts in layout.values() for t in ts] if plan["output"].get("dtype") else table.dtypes
    keep = {d: not (rewrites and d in FLOAT_DTYPES) for d in set(table.dtypes)}
    ok = list(map(keep.__getitem__, table.dtypes)) if out_dtypes is table.dtypes else \
        [keep[d] and d == o for d, o in zip(table.dtypes, out_dtypes)]
    return [(MERGE if p else COPY) if k else None for k, p in zip(ok, first_planned)]


class _OutOf:
    """tensor -> (output file, OutTensor), without a tuple or dict entry per tensor: the
    OutTensor from its file's writer; with several output files, a name -> file map."""

    def __init__(self, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter]) -> None:
        self._writers = writers
        self._file = None if len(layout) != 1 else next(iter(layout))
        self._file_of = {} if self._file is not None else {t.name: fname for fname, ts in layout.items() for t in ts}

    def __getitem__(self, name: str) -> tuple[str, OutTensor]:
        fname = self._file if self._file is not None else self._file_of[name]
        return fname, self._writers[fname].tensor(name)


def _merge_unit(m: _Merge, t: TensorInfo, out_t: OutTensor, unit: list[int], base_buf: memoryview,
                got: Got, writer: SafetensorsWriter) -> None:
    """Merge, write and hash the blocks of one unit (rows read together)."""
    ranges = m.inputs.base_index.tensors[t.name].ranges
    row_bytes = t.row_bytes()
    pos = 0
    for b in unit:
        r0, r1 = ranges[b]
        n = (r1 - r0) * row_bytes
        out = _block_bytes(m, t, out_t, b, r0, r1, base_buf[pos:pos + n], got)
        pos += n
        writer.write_rows(t.name, r0, out)
        m.hasher.add(t.name, out)


def _block_bytes(m: _Merge, t: TensorInfo, out_t: OutTensor, b: int, r0: int, r1: int, raw: memoryview,
                 got: Got) -> memoryview:
    """The output bytes of block b (rows r0:r1, base bytes `raw`): the base's, cast, or merged
    by the method's kernel or its torch code."""
    shape = (r1 - r0, *t.shape[1:]) if t.shape else ()
    if m.variants is not None:
        m = m.variants.get(m, t.name)
    sketched = m.sketched.of(t.name)
    if t.dtype not in FLOAT_DTYPES or (not m.rewrites and not any(b in got.get(e.name, {}) for e in m.experts)
                                       and not m.sketched.touches(t.name, b)):
        # nothing to merge here: the base rows, cast if the output dtype differs
        return raw if out_t.dtype == t.dtype else _cast(m, raw, t.dtype, shape, out_t.dtype, t.name)
    if m.kernel is not None and t.dtype == "BF16" and out_t.dtype == "BF16" and t.name not in m.scales:
        if not sketched:
            return m.kernel(_raw_block(m, t, b, raw, got))
        if getattr(m.kernel, "sketches", False):  # task arithmetic's C loop reads the codes itself
            return m.kernel(_raw_block(m, t, b, raw, got, sketches=True))
    return _merge_block(m, t, out_t, b, r0, r1, shape, raw, got)


def _for_group(m: _Merge, parameters: dict, plan_experts: list[dict], compiled: bool) -> _Merge:
    """The merge state for one group of per-tensor parameters (engine/tensor_variants.py)."""
    params = m.method.params.model_validate(parameters)
    experts = [_Expert(e["name"], e["content_hash"], float(e["weight"]), expert_knobs(params, e))
               for e in plan_experts]
    kernel = m.method.compiled(params, plan_experts) if m.method.compiled is not None and compiled else None
    return replace(m, params=params, experts=experts, kernel=kernel, variants=None,
                   rewrites=m.method.rewrites_base is not None and m.method.rewrites_base(params))


def _group_rewrites(plan: dict, method: Method, rewrites: bool):
    """tensor -> whether the method rewrites its unread blocks, with that tensor's per-tensor
    parameters (a group's scale can, where the top-level one does not)."""
    cache: dict[int, bool] = {}

    def at(name: str) -> bool:
        g = group_index(plan, name)
        if g is None or method.rewrites_base is None:
            return rewrites
        if g not in cache:
            cache[g] = bool(method.rewrites_base(method.params.model_validate(view(plan, g)[0])))
        return cache[g]
    return at


def _is_copy(item: tuple) -> bool:
    """A work item the copier takes: a COPY run, or a COPY pack."""
    name, kind, _ = item
    return kind == COPY or (kind == PACK and name.kind == COPY)


def _copy_pack(pack: Pack, writers: dict[str, SafetensorsWriter], base_fds: dict[Path, int],
               virtual_reader: CheckpointReader | None = None) -> tuple[int, int]:
    """On the copier's thread: copy a COPY pack file to file (a virtual file's through its
    reader); (bytes, bytes the kernel copied)."""
    nbytes = pack.end - pack.begin
    if pack.file not in base_fds:
        writers[pack.out_file].write_rows(pack.names[0], 0, virtual_reader.read_range(pack.first, pack.begin, pack.end))
        return nbytes, 0
    return nbytes, writers[pack.out_file].copy_rows(pack.names[0], 0, base_fds[pack.file], pack.begin, nbytes)


def _finish_pack(m: _Merge, pack: Pack, result: PackRead, out_of: dict,
                 writers: dict[str, SafetensorsWriter]) -> None:
    """Merge, write and hash a MERGE pack (engine/packs.py). Each tensor of a pack is one
    whole block."""
    tensors = m.inputs.base.tensors
    if _elementwise(m, pack, result):
        # one kernel call for the pack: its tensors are adjacent in every buffer, and an
        # elementwise kernel's output element depends only on the same element of its inputs
        present = tuple((e.name, result.whole[e.name]) for e in m.experts if e.name in result.whole)
        first = pack.first
        out = m.kernel(RawBlock(first.name, first.numel, result.base, present, _no_cut))
    else:
        buf = bytearray(len(result.base))
        for name in pack.names:
            t = tensors[name]
            a, z = t.begin - pack.begin, t.end - pack.begin
            got = {e: {0: views[name]} for e, views in result.got.items() if name in views}
            r1 = m.inputs.base_index.tensors[name].ranges[0][1]
            buf[a:z] = _block_bytes(m, t, out_of[name][1], 0, 0, r1, result.base[a:z], got)
        out = memoryview(buf)
    writers[pack.out_file].write_rows(pack.names[0], 0, out)
    m.hasher.add_whole(pack.names, slice_digests(out, *pack.offsets()), digests=True)
    m.cuts.drop_all(pack.names)


def _elementwise(m: _Merge, pack: Pack, result: PackRead) -> bool:
    """Whether a MERGE pack can be merged by one call of the method's kernel: the kernel is
    elementwise, every tensor bf16 with no strategy scale, and each expert read either for
    every tensor of the pack (one buffer) or for none."""
    if m.kernel is None or not getattr(m.kernel, "elementwise", False) or result.got.keys() != result.whole.keys():
        return False
    return set(pack.dtypes()) == {"BF16"} and not any(map(m.scales.__contains__, pack.names)) \
        and not any(map(m.sketched.by_tensor.__contains__, pack.names))


def _no_cut(expert: str, rank: int):
    raise MethodError(f"expert {expert!r}: a rank cut was asked of an elementwise kernel merging a pack")


def _raw_block(m: _Merge, t: TensorInfo, b: int, raw: memoryview, got: Got, *, sketches: bool = False) -> RawBlock:
    n = len(raw) // t.itemsize
    entries = m.sketched.kernel_entries(t.name, b, n, m.experts, got) if sketches else ()

    def cut(expert: str, rank: int):
        return m.cuts.get(expert, t.name).for_block(b, n)(rank)

    present = tuple((e.name, got[e.name][b]) for e in m.experts if b in got.get(e.name, {}))
    return RawBlock(t.name, t.numel, raw, present, cut, entries)


def _merge_block(m: _Merge, t: TensorInfo, out_t: OutTensor, b: int, r0: int, r1: int,
                 shape: tuple[int, ...], raw: memoryview, got: Got) -> memoryview:
    """One block through the method's torch code: fp32 deltas, `fn`, cast to the output dtype."""
    _torch_path(m)
    base_block = as_tensor(raw, t.dtype, shape).float()
    blocks = []
    for e in m.experts:
        buf = got.get(e.name, {}).get(b)
        delta, sketched = None, False
        if buf is not None:
            delta = as_tensor(buf, t.dtype, shape).float() - base_block
        elif (rep := m.sketched.delta(e.name, t.name, b, base_block.numel())) is not None:  # alpha * code
            delta, sketched = torch.from_numpy(rep).reshape(shape), True
        cut = m.cuts.get(e.name, t.name).for_block(b, base_block.numel()) if m.method.magnitude else None
        cosine = None
        if m.method.cosine:
            td = m.inputs.deltas[e.name].tensors[t.name]
            cosine = cosine_from_sums(td.base_sq, td.expert_sq, td.dot)
        scale = m.scales.get(t.name, {}).get(e.name, 1.0)
        blocks.append(ExpertBlock(e.name, e.content_hash, e.weight, delta, **e.knobs, cut=cut, cosine=cosine,
                                  scale=scale, sketched=sketched))
    joint = m.joint.tensors.get(t.name) if m.joint is not None else None
    merged = m.method.fn(BlockInputs(t.name, r0, r1, t.shape, base_block, tuple(blocks), m.seed, joint=joint),
                         m.params)
    return tensor_bytes(_to_output(merged, t.name, out_t.dtype))


def _read_sets(reads: dict[str, list[int]]) -> dict[str, list[int] | frozenset[int]]:
    """An expert's planned blocks per tensor for `in` tests: the plan's own short lists
    (one or a few blocks: a set per tensor was 10% of a 100k-tensor merge's memory), sets
    for long ones. Read only: where every list is short, the plan's own dict."""
    if max(map(len, reads.values()), default=0) <= 8:
        return reads
    return {t: bs if len(bs) <= 8 else frozenset(bs) for t, bs in reads.items()}


def block_counts(index: ModelIndex, names) -> list[int]:
    """Blocks of each tensor `names` lists (a split merge's base is a part of the index's
    model), from the index's columns without making entries."""
    cols = index.tensors
    s = cols.starts
    return [s[i + 1] - s[i] for i in cols.rows_of(names)]


def _scales_by_tensor(plan: dict) -> dict[str, dict[str, float]]:
    """The plan strategy's rescale factors (`strategy.scales`: expert -> tensor -> c != 1),
    by tensor; empty for plans without a rescaling strategy."""
    out: dict[str, dict[str, float]] = {}
    for expert, per in (plan.get("strategy") or {}).get("scales", {}).items():
        for tensor, c in per.items():
            if c != 1.0:
                out.setdefault(tensor, {})[expert] = float(c)
    return out


def _cast(m: _Merge, raw: memoryview, dtype: str, shape: tuple[int, ...], out_dtype: str, name: str) -> memoryview:
    """Base rows cast to the output dtype (the torch path)."""
    _torch_path(m)
    return tensor_bytes(_to_output(as_tensor(raw, dtype, shape), name, out_dtype))


def _to_output(x, name: str, out_dtype: str):
    """`x` cast to the output dtype. float16's range is float32's and bfloat16's up to 65504
    only: a finite value past it would be published as inf (verify checks bytes, not values)."""
    y = x.to(st.DTYPES[out_dtype][1])
    if out_dtype == "F16" and bool((torch.isinf(y) & torch.isfinite(x)).any()):
        raise MethodError(f"tensor {name!r}: values past float16's range (65504) would be published as inf; "
                          "set output.dtype to bfloat16 or float32, or scale the weights or parameters down")
    return y


def _torch_path(m: _Merge) -> None:
    """Before a block takes the torch path: torch imported (util.lazy) and, the first time
    in this merge, set to one intra-op thread. Per-block ops are ~0.5M elements: too small
    for intra-op threads to pay, and with reader threads (or other processes) on the cores,
    OpenMP's spinning threads slowed the merge 3-5x (BENCHMARKS.md). One thread also makes
    any reduction's order independent of the machine's core count. Merges whose blocks all
    take the compiled kernels (or are copied) never import torch."""
    if not m.torch_threads:
        import torch as real_torch
        m.torch_threads.append(real_torch.get_num_threads())
        real_torch.set_num_threads(1)


@contextmanager
def _torch_threads(m: _Merge) -> Iterator[None]:
    """Restore torch's thread count if the merge set it."""
    try:
        yield
    finally:
        if m.torch_threads:
            torch.set_num_threads(m.torch_threads[0])
