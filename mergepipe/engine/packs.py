"""Packs: runs of small single-block tensors that the engine handles as one unit.

A checkpoint of many small tensors (MoE experts' norms and routers, biases: tens of
thousands) would otherwise cost one prefetch future, one pread per input, one
pwrite, one writeback hint and one hasher message per tensor. A pack is a run of
consecutive tensors, each a single non-empty block of at most SMALL_TENSOR_BYTES,
all merged or all copied (the same kind), whose bytes are one contiguous range in
the base file and one in the output file. It is read with one pread of the base
(MERGE) and one per contiguous run of planned tensors in each expert, or copied
with one in-kernel copy (COPY); written with one pwrite; hashed with one message.

What is read, copied, written and hashed is exactly what the tensor-by-tensor path
does (the same bytes counted, the same block hashes checked), so the output and
its manifest are byte-identical; only the number of calls changes.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain, compress, groupby, islice, repeat
from operator import contains, eq, ge, lt, mul, ne, sub
from pathlib import Path

from blake3 import blake3

from mergepipe.checkpoint.safetensors import Checkpoint, CheckpointReader, TensorInfo
from mergepipe.checkpoint.tensor_table import TensorTable
from mergepipe.errors import IntegrityError
from mergepipe.index.columns import DIGEST
from mergepipe.index.records import ModelIndex

SMALL_TENSOR_BYTES = 64 << 10  # larger tensors take the per-tensor path (their own unit or runs)
PACK_BYTES = 4 << 20  # base bytes per pack, like a prefetch unit (engine/prefetch.py UNIT_BYTES)


@dataclass(frozen=True, slots=True)
class Pack:
    """Consecutive single-block tensors, contiguous in the base file and in one output file."""

    kind: str  # engine.merge MERGE or COPY
    names: list[str]
    file: Path  # the base file
    begin: int  # absolute byte range in the base file
    end: int
    out_file: str  # the output weight file, where the range starts at the first tensor's offset
    table: TensorTable  # the base's tensors (checkpoint/tensor_table.py): rows r0:r1 are the pack's
    r0: int
    r1: int
    _offsets: list = field(default_factory=list, compare=False, repr=False)  # offsets(), once made

    @property
    def first(self) -> TensorInfo:
        return self.table.info(self.r0)

    def dtypes(self) -> list[str]:
        return self.table.dtypes[self.r0:self.r1]

    def spans(self):
        """(name, start, end) of each tensor within the pack's bytes (every buffer of it)."""
        return list(zip(self.names, *self.offsets()))

    def offsets(self) -> tuple[list[int], list[int]]:
        """(starts, ends) of the tensors within the pack's bytes, as two columns; made once
        (the base's check, the output's hashes and views use them), the tensors being
        contiguous each start is the previous end (the same int objects)."""
        if not self._offsets:
            ends = list(map(sub, self.table.ends[self.r0:self.r1], repeat(self.begin)))
            self._offsets.append(([0, *ends[:-1]] if ends else [], ends))
        return self._offsets[0]

    def views(self, buf: memoryview) -> list[memoryview]:
        """Each tensor's bytes in `buf`, a buffer of the pack's range (pack order)."""
        return list(map(buf.__getitem__, map(slice, *self.offsets())))


def packable(size: int, n_blocks: int) -> bool:
    """Whether a tensor of `size` bytes and `n_blocks` blocks may join a pack: one non-empty
    block, small."""
    return n_blocks == 1 and 0 < size <= SMALL_TENSOR_BYTES


class PackBuilder:
    """Groups a stream of packable tensors (rows of the base's table) into Packs; `add`
    returns a finished pack when the new tensor cannot extend the open one (other kind,
    file, gap, or full)."""

    def __init__(self, table: TensorTable) -> None:
        self.table = table
        self._r0 = self._r1 = 0
        self._kind = self._file = self._out_file = None
        self._begin = self._end = self._out_end = 0

    def add(self, i: int, kind: str, out_file: str, out_offset: int) -> Pack | None:
        table = self.table
        file, begin, end = table.file_at(i), table.begins[i], table.ends[i]
        extends = (self._r1 > self._r0 and i == self._r1 and kind == self._kind and _same(file, self._file)
                   and begin == self._end and out_file == self._out_file and out_offset == self._out_end
                   and end - self._begin <= PACK_BYTES)
        done = None if extends else self.flush()
        if not extends:
            self._kind, self._file, self._out_file, self._begin, self._r0 = kind, file, out_file, begin, i
        self._r1 = i + 1
        self._end, self._out_end = end, out_offset + end - begin
        return done

    def flush(self) -> Pack | None:
        """The open pack, if any (and none open after)."""
        if self._r1 <= self._r0:
            return None
        t = self.table
        pack = Pack(self._kind, t.names[self._r0:self._r1], self._file, self._begin, self._end, self._out_file,
                    t, self._r0, self._r1)
        self._r0 = self._r1
        return pack


def pack_runs(table: TensorTable, counts: list[int], kinds: list[str | None], out_files: list[tuple[str, int]]):
    """The work list's items for rows of `table`, in row order: ("pack", Pack) for runs of
    packable rows (`kinds[i]`: MERGE or COPY, None where row i is not to be packed) and
    ("row", i) for every other row. The same packs PackBuilder makes from the rows one by
    one, found a run at a time: rows of one kind in one base file and one output file are
    contiguous in both (the output lays the base's tensors out in its order, `out_files`:
    (file, first row) of each output file), so a pack ends only at a change of kind or file
    or where PACK_BYTES is reached."""
    sizes = list(map(sub, table.ends, table.begins))
    small = map(mul, map(eq, counts, repeat(1)), map(mul, map(lt, repeat(0), sizes),
                                                   map(ge, repeat(SMALL_TENSOR_BYTES), sizes)))
    keys = [k if ok else None for k, ok in zip(kinds, small)]
    cuts = sorted({*(r for _, r in table.runs), *(r for _, r in out_files), len(keys)})
    begins, ends = table.begins, table.ends
    out_at = [f for f, _ in out_files]
    out_starts = [r for _, r in out_files]
    i = 0
    for kind, run in groupby(keys):
        j = i + len(list(run))
        if kind is None:
            yield from zip(repeat("row"), range(i, j))
            i = j
            continue
        while i < j:
            stop = min(j, cuts[bisect_right(cuts, i)])  # this file's rows (base and output)
            # greedy as PackBuilder: the pack's tensors end within PACK_BYTES of its begin
            k = max(i + 1, min(stop, bisect_right(ends, begins[i] + PACK_BYTES, i, stop)))
            out_file = out_at[bisect_right(out_starts, i) - 1]
            yield "pack", Pack(kind, table.names[i:k], table.file_at(i), begins[i], ends[k - 1], out_file,
                               table, i, k)
            i = k


def _relative(begins: list[int], ends: list[int], origin: int) -> tuple[list[int], list[int]]:
    """(begin - origin, end - origin) of each tensor, as two columns."""
    return list(map(sub, begins, repeat(origin))), list(map(sub, ends, repeat(origin)))


def _other(a: Path, b: Path) -> bool:
    return not _same(a, b)


def _same(a: Path, b: Path) -> bool:
    """Path equality, by identity first: a checkpoint's tensors share their file's Path
    object, and Path.__eq__ (Python code) was a tenth of reading a 100k-tensor pack."""
    return a is b or a == b


def read_pack(pack: Pack, base: Checkpoint, base_index: ModelIndex, base_reader: CheckpointReader,
              experts: dict[str, Checkpoint], expert_indexes: dict[str, ModelIndex],
              readers: dict[str, CheckpointReader], reads: dict[str, dict[str, object]]) -> PackRead:
    """The base bytes of a MERGE pack and, per expert, the bytes of each tensor the plan
    reads of it (adjacent ones with one pread), every block checked against its index."""
    buf = memoryview(base_reader.read_range(pack.first, pack.begin, pack.end)).cast("B")
    bad = _mismatch(slice_digests(buf, *pack.offsets()), pack.names, base_index)
    if bad is not None:
        t, entry = base.tensors[bad], base_index.tensors[bad]
        raise IntegrityError(f"{t.file}: tensor {t.name!r} rows {entry.ranges[0][0]}:{entry.ranges[0][1]} do not "
                             f"match the index of {base.root} (corrupted or modified since indexing)")
    got: dict[str, dict[str, memoryview]] = {}
    whole: dict[str, memoryview] = {}
    for expert, planned in reads.items():
        ckpt = experts[expert]
        # the tensors whose block 0 the plan reads (column steps in C: `0 in planned[name]`)
        names = list(compress(pack.names, map(contains, map(planned.get, pack.names, repeat(())), repeat(0))))
        if not names:
            continue
        table = ckpt.tensors
        # the base's header (checkpoint/safetensors.py _same_header) and every tensor read:
        # the pack's rows, at the base's offsets
        same = table.names is pack.table.names and table.begins is pack.table.begins \
            and table.ends is pack.table.ends and len(names) == len(pack.names)
        if same:  # one run, contiguous in one file as the pack is in the base's
            rows, cuts = range(pack.r0, pack.r1), []
            begins, ends = table.begins[pack.r0:pack.r1], table.ends[pack.r0:pack.r1]
        else:
            rows = list(map(table.row, names))
            begins, ends = list(map(table.begins.__getitem__, rows)), list(map(table.ends.__getitem__, rows))
            files = list(map(table.file_at, rows)) if len(table.runs) > 1 else [table.runs[0][0]] * len(rows)
            # runs adjacent in the expert's file, one pread each: cut where a tensor does not
            # start at the previous one's end or lies in another file
            cuts = set(compress(range(1, len(rows)), map(ne, islice(begins, 1, None), ends)))
            if len(set(map(id, files))) > 1:
                cuts.update(compress(range(1, len(rows)), map(_other, islice(files, 1, None), files)))
            cuts = sorted(cuts)
        runs, digests = [], []
        for i, j in zip([0, *cuts], [*cuts, len(rows)]):
            run = memoryview(readers[expert].read_range(table.info(rows[i]), begins[i], ends[j - 1])).cast("B")
            if same and i == 0 and j == len(rows):
                starts, stops = pack.offsets()  # the base's columns: made once per pack
            else:
                starts, stops = _relative(begins[i:j], ends[i:j], begins[i])
            digests += slice_digests(run, starts, stops)
            runs.append((run, starts, stops))
            if i == 0 and j == len(pack.names):
                whole[expert] = run  # every tensor of the pack, in one buffer, in pack order
        bad = _mismatch(digests, names, expert_indexes[expert])
        if bad is not None:
            t, entry = ckpt.tensors[bad], expert_indexes[expert].tensors[bad]
            raise IntegrityError(f"{t.file}: tensor {t.name!r} rows {entry.ranges[0][0]}:"
                                 f"{entry.ranges[0][1]} do not match the index (corrupted or modified "
                                 "since indexing); re-index with `mergepipe index`")
        got[expert] = _Views(names, runs)
    return PackRead(buf, got, whole)


def slice_digests(buf, starts: list[int], stops: list[int]) -> list[bytes]:
    """blake3 digest of each buf[start:stop], hashed from slices of one bytes copy (a small
    bytes object is cheaper to make and to hash than a memoryview: 100k tensors)."""
    data = bytes(buf)
    return [blake3(data[a:z]).digest() for a, z in zip(starts, stops)]


class _Views(Mapping):
    """tensor -> its bytes in the runs read (buffer, starts, stops), made on first lookup:
    a pack merged by one elementwise kernel call never looks a tensor up."""

    def __init__(self, names: list[str], runs: list[tuple]) -> None:
        self._names, self._runs, self._views = names, runs, None

    def _all(self) -> dict[str, memoryview]:
        if self._views is None:
            cut = chain.from_iterable(map(run.__getitem__, map(slice, a, z)) for run, a, z in self._runs)
            self._views = dict(zip(self._names, cut))
        return self._views

    def __getitem__(self, name: str) -> memoryview:
        return self._all()[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _mismatch(got: list[bytes], names, index: ModelIndex) -> str | None:
    """The first of these single-block tensors whose block digests `got` are not the index's,
    or None. Tensors adjacent in a decoded index are compared in one step against one slice
    of its digest column."""
    want = _digest_run(index, names)
    if want is not None and b"".join(got) == want:
        return None
    return next((n for n, d in zip(names, got) if d != block_digest(index, n, 0)), None)


def _digest_run(index: ModelIndex, names) -> bytes | None:
    """The index's digests of `names`, concatenated, when they are consecutive single-block
    tensors of the index (index/columns.py); else None."""
    cols = index.tensors
    if names[0] not in cols:
        return None
    i = cols.index_of(names[0])
    n = len(names)
    k0, k1 = cols.starts[i], cols.starts[min(i + n, len(cols.names))]
    if k1 - k0 != n or cols.names[i:i + n] != list(names):
        return None
    return bytes(cols.digests[DIGEST * k0:DIGEST * k1])


def block_digests(index: ModelIndex, names: list[str]) -> list[bytes]:
    """The index's digest of block 0 of each of these single-block tensors: cut from one
    slice of the digest column where they are consecutive in a decoded index."""
    run = _digest_run(index, names)
    if run is None:
        return [block_digest(index, n, 0) for n in names]
    return list(map(run.__getitem__, map(slice, range(0, len(run), DIGEST), range(DIGEST, len(run) + 1, DIGEST))))


def block_digest(index: ModelIndex, name: str, b: int) -> bytes:
    """The index's blake3 digest (32 bytes) of block `b` of tensor `name`; from the columns
    without making its entry (index/columns.py)."""
    cols = index.tensors
    k = DIGEST * (cols.starts[cols.index_of(name)] + b)
    return bytes(cols.digests[k:k + DIGEST])


@dataclass(frozen=True, slots=True)
class PackRead:
    """What `read_pack` read: the base range, the planned expert tensors, and, for an expert
    read for every tensor of the pack in one pread, that buffer (pack order)."""

    base: memoryview
    got: dict[str, Mapping[str, memoryview]]  # expert -> tensor -> its bytes
    whole: dict[str, memoryview]
