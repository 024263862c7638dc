"""The merge's work list: what the loop does, in the base's tensor order, as small typed items.

`work_list` makes it from the plan, once; the loop (engine/merge.py) consumes it in order.
Each item says what it reads (`load`, on a reader thread, ahead of the loop) and what it does
with what was read (`apply`, on the merging thread, in order):

- `MergeSpan`: adjacent blocks of one tensor some expert is planned for (or that are cast or
  rewritten), read with one pread of the base (about UNIT_BYTES) and the planned expert
  blocks, merged block by block (engine/blocks.py).
- `CopySpan`: adjacent blocks of one tensor no expert is planned for, which the output keeps
  from the base (about COPY_BYTES): handed to the copier (engine/copies.py), hashed from the
  base index.
- `MergePack` / `CopyPack`: a run of small single-block tensors (engine/packs.py) merged or
  kept as one unit.

Whether a copied item is read by the reader threads or copied in the kernel is the copier's
(`reads`); neither the items nor the loop branch on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import contains, itemgetter, or_

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, OutTensor, SafetensorsWriter, TensorInfo
from mergepipe.checkpoint.tensor_table import TensorTable
from mergepipe.engine.blocks import MergeState, merge_pack, merge_unit
from mergepipe.engine.copies import Copier
from mergepipe.engine.hashing import OutputHasher
from mergepipe.engine.packs import Pack, PackBuilder, block_digests, pack_runs, packable, read_pack
from mergepipe.engine.prefetch import UNIT_BYTES, UnitReader
from mergepipe.index.records import ModelIndex
from mergepipe.util.progress import Progress

MERGE, COPY = "merge", "copy"  # a Pack's kind
COPY_BYTES = 64 << 20  # base bytes per in-kernel copy (runs are cut so that the pool shares them)


class OutOf:
    """tensor -> (output file, OutTensor), without a tuple or dict entry per tensor: the
    OutTensor from its file's writer; with several output files, a name -> file map."""

    def __init__(self, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter]) -> None:
        self.layout, self.writers = layout, writers
        self._file = None if len(layout) != 1 else next(iter(layout))
        self._file_of = {} if self._file is not None else {t.name: fname for fname, ts in layout.items() for t in ts}

    def __getitem__(self, name: str) -> tuple[str, OutTensor]:
        fname = self._file if self._file is not None else self._file_of[name]
        return fname, self.writers[fname].tensor(name)

    def tensor(self, name: str) -> OutTensor:
        return self[name][1]


@dataclass(frozen=True, slots=True)
class MergeRun:
    """What the work items act on during one merge."""

    state: MergeState
    base: Checkpoint
    reader: UnitReader  # the base rows and planned expert blocks (engine/prefetch.py)
    out: OutOf  # the output files' writers, by tensor
    hasher: OutputHasher
    copier: Copier  # the base bytes the output keeps (engine/copies.py)
    progress: Progress

    def end_tensor(self, name: str) -> None:
        self.hasher.end_tensor(name)
        self.state.cuts.drop(name)


@dataclass(frozen=True, slots=True)
class MergeSpan:
    tensor: str
    blocks: list[int]
    last: bool  # ends its tensor

    def reads(self, run: MergeRun) -> bool:
        return True

    def load(self, run: MergeRun):
        base_buf, got = run.reader.load(self.tensor, self.blocks)
        ranges = run.state.base_index.tensors[self.tensor].ranges
        return base_buf, got, run.state.sketched.read_unit(run.base.tensors[self.tensor], ranges, self.blocks)

    def apply(self, run: MergeRun, loaded) -> None:
        base_buf, got, payloads = loaded
        run.state.sketched.arrived(payloads)
        fname, out_t = run.out[self.tensor]
        merge_unit(run.state, run.base.tensors[self.tensor], out_t, self.blocks, base_buf, got,
                   run.out.writers[fname], run.hasher)
        run.progress.step(len(base_buf))
        if self.last:
            run.end_tensor(self.tensor)


@dataclass(frozen=True, slots=True)
class CopySpan:
    tensor: str
    blocks: list[int]
    last: bool  # ends its tensor

    def reads(self, run: MergeRun) -> bool:
        return run.copier.reads

    def _rows(self, run: MergeRun) -> tuple[int, int]:
        ranges = run.state.base_index.tensors[self.tensor].ranges
        return ranges[self.blocks[0]][0], ranges[self.blocks[-1]][1]

    def load(self, run: MergeRun):
        return run.copier.read_span(self.tensor, *self._rows(run))

    def apply(self, run: MergeRun, loaded) -> None:
        entry = run.state.base_index.tensors[self.tensor]
        run.copier.span(run.out[self.tensor][0], self.tensor, *self._rows(run), loaded)
        run.hasher.add_digests(self.tensor, [bytes.fromhex(entry.hashes[b]) for b in self.blocks])
        if self.last:
            run.end_tensor(self.tensor)


@dataclass(frozen=True, slots=True)
class MergePack:
    pack: Pack

    def reads(self, run: MergeRun) -> bool:
        return True

    def load(self, run: MergeRun):
        r = run.reader
        return read_pack(self.pack, r.base, r.base_index, r.base_reader, r.experts, r.expert_indexes, r.readers,
                         r.reads)

    def apply(self, run: MergeRun, loaded) -> None:
        merge_pack(run.state, self.pack, loaded, run.out.tensor, run.out.writers[self.pack.out_file], run.hasher)
        run.progress.step(self.pack.end - self.pack.begin)


@dataclass(frozen=True, slots=True)
class CopyPack:
    pack: Pack

    def reads(self, run: MergeRun) -> bool:
        return run.copier.reads

    def load(self, run: MergeRun):
        return run.copier.read_pack(self.pack)

    def apply(self, run: MergeRun, loaded) -> None:
        run.copier.pack(self.pack, loaded)
        run.hasher.add_whole(self.pack.names, block_digests(run.state.base_index, self.pack.names), digests=True)


WorkItem = MergeSpan | CopySpan | MergePack | CopyPack


def pack_item(pack: Pack) -> MergePack | CopyPack:
    return MergePack(pack) if pack.kind == MERGE else CopyPack(pack)


def segments(t: TensorInfo, ranges: tuple[tuple[int, int], ...], planned: set[int], *,
             copy_ok: bool, copy_bytes: int = COPY_BYTES) -> list[MergeSpan | CopySpan]:
    """A tensor's blocks in order, grouped into MergeSpans of planned blocks (read with one
    pread, about UNIT_BYTES) and CopySpans of blocks no expert is planned for (the base's
    bytes, about copy_bytes). Without `copy_ok` (the output dtype differs, or the method
    rewrites unread blocks) every block is merged (cast)."""
    runs: list[tuple[str, list[int]]] = []
    row_bytes = t.row_bytes()
    size = 0
    for b, (r0, r1) in enumerate(ranges):
        kind = MERGE if (b in planned or not copy_ok) else COPY
        nbytes = (r1 - r0) * row_bytes
        limit = UNIT_BYTES if kind == MERGE else copy_bytes
        if runs and runs[-1][0] == kind and size + nbytes <= limit:
            runs[-1][1].append(b)
            size += nbytes
        else:
            runs.append((kind, [b]))
            size = nbytes
    last = len(runs) - 1
    return [(MergeSpan if kind == MERGE else CopySpan)(t.name, blocks, j == last)
            for j, (kind, blocks) in enumerate(runs)]


class _Tensors:
    """The spans of each tensor of the base's table (by row), as `segments` cuts them."""

    def __init__(self, table: TensorTable, base_index: ModelIndex, out: OutOf, reads: list[dict],
                 state: MergeState, copy_bytes: int) -> None:
        self.table, self.base_index, self.out, self.reads = table, base_index, out, reads
        self.state, self.copy_bytes = state, copy_bytes

    def copy_ok(self, i: int) -> bool:
        """The output keeps tensor i's dtype and the method its unread blocks."""
        name, dtype = self.table.names[i], self.table.dtypes[i]
        return self.out[name][1].dtype == dtype and not (self.state.groups.of(name).rewrites and dtype in FLOAT_DTYPES)

    def spans(self, i: int) -> list[MergeSpan | CopySpan]:
        name = self.table.names[i]
        sketched = self.state.sketched.by_tensor.get(name, {})
        planned = set().union(*(r.get(name, ()) for r in self.reads), *sketched.values())
        return segments(self.table.info(i), self.base_index.tensors[name].ranges, planned,
                        copy_ok=self.copy_ok(i), copy_bytes=self.copy_bytes)


def work_list(base: Checkpoint, base_index: ModelIndex, out: OutOf, reads: list[dict], state: MergeState, *,
              output_dtype: str | None, copy_bytes: int = COPY_BYTES) -> list[WorkItem]:
    """Every tensor's work items, in base order (`reads`: each expert's planned blocks per
    tensor; `output_dtype`: the plan's output.dtype): small single-block tensors in packs
    (engine/packs.py), the others in spans."""
    table = base.tensors
    first_planned = _first_planned(table.names, reads, state.sketched.by_tensor)
    counts = block_counts(base_index, table.names)
    tensors = _Tensors(table, base_index, out, reads, state, copy_bytes)
    kinds = _pack_kinds(table, out.layout, output_dtype, state, first_planned)
    if kinds is not None:  # a run of packs at a time (packs.pack_runs)
        starts = list(accumulate(map(len, out.layout.values()), initial=0))
        work: list[WorkItem] = []
        for what, x in pack_runs(table, counts, kinds, list(zip(out.layout, starts))):
            if what == "pack":
                work.append(pack_item(x))
            else:
                work.extend(tensors.spans(x))
        return work
    return _one_by_one(tensors, counts, first_planned)


def _one_by_one(tensors: _Tensors, counts: list[int], first_planned: list[bool]) -> list[WorkItem]:
    """The work list where tensors are taken one by one (per-tensor parameters, or an output
    laid out in another order): each small tensor joins the open pack where it can."""
    table, out, groups = tensors.table, tensors.out, tensors.state.groups
    packs = PackBuilder(table)
    work: list[WorkItem] = []
    for i, (name, n_blocks, planned) in enumerate(zip(table.names, counts, first_planned)):
        if packable(table.ends[i] - table.begins[i], n_blocks) and tensors.copy_ok(i) and not groups.has_own(name):
            fname = out[name][0]
            done = packs.add(i, MERGE if planned else COPY, fname, out.writers[fname].offset_of(name, 0))
            if done is not None:
                work.append(pack_item(done))
            continue
        if (done := packs.flush()) is not None:
            work.append(pack_item(done))
        work.extend(tensors.spans(i))
    if (done := packs.flush()) is not None:
        work.append(pack_item(done))
    return work


def _first_planned(names: list[str], reads: list[dict], sketched: dict) -> list[bool]:
    """Per tensor, whether some expert's plan reads its block 0 (or sketches it): a few
    C-speed passes over the names, not a generator per tensor."""
    first = [False] * len(names)
    for r in reads:
        first = list(map(or_, first, map(contains, map(r.get, names, repeat(())), repeat(0))))
    if sketched:
        first = list(map(or_, first, map(sketched.__contains__, names)))
    return first


def _pack_kinds(table: TensorTable, layout: dict[str, list[OutTensor]], output_dtype: str | None,
                state: MergeState, first_planned: list[bool]) -> list[str | None] | None:
    """Per tensor, MERGE or COPY where it may join a pack as far as its dtype goes (None: its
    output dtype differs, or the method rewrites its float blocks); None when the tensors
    must be taken one by one (per-tensor parameters, or an output laid out in another order)."""
    if state.groups.grouped or [n for ts in layout.values() for n in map(itemgetter(0), ts)] != table.names:
        return None
    rewrites = state.groups.top.rewrites
    out_dtypes = [t[1] for ts in layout.values() for t in ts] if output_dtype else table.dtypes
    keep = {d: not (rewrites and d in FLOAT_DTYPES) for d in set(table.dtypes)}
    ok = list(map(keep.__getitem__, table.dtypes)) if out_dtypes is table.dtypes else \
        [keep[d] and d == o for d, o in zip(table.dtypes, out_dtypes)]
    return [(MERGE if p else COPY) if k else None for k, p in zip(ok, first_planned)]


def block_counts(index: ModelIndex, names) -> list[int]:
    """Blocks of each tensor `names` lists (a split merge's base is a part of the index's
    model), from the index's columns without making entries."""
    cols = index.tensors
    s = cols.starts
    return [s[i + 1] - s[i] for i in cols.rows_of(names)]
