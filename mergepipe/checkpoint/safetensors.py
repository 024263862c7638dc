"""Checkpoint layer: safetensors headers parsed by hand, exact byte-range reads,
and a streaming writer. The one parser of weight files' headers: every other module that
opens a weight file (the engine's and `stack`'s row copies, checkpoint/treehash.py,
`check-predict`'s read probe, util/fs.hash_file) reads bytes at the offsets a
`FileHeader` from here gives, or the whole file.

Format: 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}},
then the data; offsets are relative to the end of the header. Everything is
validated before a byte of tensor data is read; reads are `os.pread`s of exactly
the requested ranges, counted per file, so a budget can be checked against them.
One concept, the format, in one file on purpose (longer than ~400 lines): the reader's
checks and the writer's layout must agree on alignment, dtypes and offsets, and keeping
them side by side is how they stay in agreement.
"""
from __future__ import annotations

from array import array
import json
from json.encoder import encode_basestring_ascii as _esc
import os
import stat
import sys
import threading
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain, islice, repeat
from math import prod
from operator import add, eq, itemgetter, le, lt, mul, sub
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from mergepipe.checkpoint import header_scan
from mergepipe.checkpoint.direct_io import DirectAppender, direct_open
from mergepipe.checkpoint.blocks import row_bytes
from mergepipe.checkpoint import tensor_table
from mergepipe.checkpoint.tensor_table import TensorTable, concat
from mergepipe.errors import CheckpointError, OutputError
from mergepipe.util.gcpause import paused_gc

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 * 1000 * 1000
INDEX_JSON = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# safetensors dtype -> (itemsize, torch dtype name). torch is imported only when a
# tensor is made (as_tensor, DTYPES), so that header work and `mergepipe index` start fast.
_DTYPE_INFO: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"), "F32": (4, "float32"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "I64": (8, "int64"), "I32": (4, "int32"), "I16": (2, "int16"), "I8": (1, "int8"), "U8": (1, "uint8"),
    "BOOL": (1, "bool"), "U16": (2, "uint16"), "U32": (4, "uint32"), "U64": (8, "uint64"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"),
}
ITEMSIZE = {name: size for name, (size, _) in _DTYPE_INFO.items()}


def __getattr__(name: str):
    """DTYPES (safetensors dtype -> (itemsize, torch.dtype)) and TORCH_TO_ST, built on first use."""
    if name in ("DTYPES", "TORCH_TO_ST"):
        import torch
        dtypes = {k: (size, getattr(torch, tname)) for k, (size, tname) in _DTYPE_INFO.items()}
        globals().update(DTYPES=dtypes, TORCH_TO_ST={t: k for k, (_, t) in dtypes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


class TensorInfo(NamedTuple):
    """One tensor's place in a checkpoint. A named tuple, not a frozen dataclass: made
    100k times per checkpoint header, where a dataclass's __init__ was 2.4 us a tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in `file`
    end: int

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def row_bytes(self) -> int:
        return row_bytes(self.shape, self.itemsize)


tensor_table.TensorInfo = TensorInfo  # what a TensorTable's lookups make (it cannot import this module)


@dataclass(frozen=True, slots=True)
class FileHeader:
    path: Path
    header_bytes: bytes  # the raw 8 + N bytes, hashed into the file fingerprint
    data_start: int
    size: int
    table: TensorTable  # this file's tensors, in data-offset order
    metadata: dict[str, str]

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        """The TensorInfo of each tensor, in data-offset order (made on each call)."""
        return tuple(self.table.values())


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen = dict(pairs)  # C speed; a header of 100,000 tensors calls this 100,001 times
    if len(seen) != len(pairs):
        counted: set[str] = set()
        for key, _ in pairs:
            if key in counted:
                raise ValueError(f"duplicate key {key!r}")
            counted.add(key)
    return seen


def _pread_exact(fd: int, n: int, offset: int, path: Path) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            raise CheckpointError(f"{path}: truncated: wanted {n} bytes at offset {offset}, file ends early")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _is_text(s: str) -> bool:
    """Valid Unicode (JSON can escape lone surrogates, which safetensors and UTF-8 refuse)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(path: str | Path) -> FileHeader:
    """Parse and validate one .safetensors file's header; reads no tensor data.

    Raises:
        CheckpointError: naming the file (and tensor) for any malformed field.
    """
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: pickle checkpoints are refused (never unpickled); convert to .safetensors")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO must not hang the open
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file (a directory, pipe or device); "
                                  "expected a .safetensors file")
        size = st.st_size
        if size < 8:
            raise CheckpointError(f"{path}: not a safetensors file: {size} bytes, "
                                  "shorter than the 8-byte header length")
        if hasattr(os, "posix_fadvise"):
            # A plain read here leaves a readahead mark in the page cache; a later planned
            # read that reaches it pulls in up to read_ahead_kb of unplanned tensor data,
            # FADV_RANDOM on the reader's fd notwithstanding (BENCHMARKS.md, page residency).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} runs past the end of the {size}-byte file")
        raw = _pread_exact(fd, n, 8, path)
    finally:
        os.close(fd)
    head = n.to_bytes(8, "little") + raw
    last = _LAST[0] if _LAST else None
    if last is not None and last.size == size and last.header_bytes == head:
        return _same_header(last, path)
    _LAST[:] = [_parse_raw(path, n, raw, size, head)]
    return _LAST[0]


# The last header parsed. The experts of one family often have the base's header byte for
# byte (same tensors, same writer): theirs then takes its checked entries, with its own
# path, and shares its bytes and names (one header kept alive at most, its checkpoint's own).
_LAST: list[FileHeader] = []


def _same_header(last: FileHeader, path: Path) -> FileHeader:
    """`last`'s entries, for a file of the same size whose header has the same bytes: its
    table's columns, shared (read only), with this path."""
    return replace(last, path=path, table=last.table.with_file(path), metadata=dict(last.metadata))


def _parse_raw(path: Path, n: int, raw: bytes, size: int, head: bytes) -> FileHeader:
    """parse_header after the read: the `n` header bytes `raw` (`head`: with the length
    before them) of a file of `size` bytes.

    One pass reads the entries' fields as columns (header_scan's regular expression for the
    usual spelling, else json.loads) and checks them whole columns at a time
    (`_table_of_columns`). A header that pass refuses is read again, entry by entry, by
    `_header_error`, only to name what is wrong: both apply the same checks."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: header is not valid UTF-8") from None
    data_start = 8 + n
    with paused_gc():  # no cycles among the many small objects (util/gcpause.py)
        header = None
        cols = header_scan.scan(text, _reject_duplicates)
        if cols is None:
            header = _json_object(path, text)
            cols = _columns_of_json(header)
        table = None if cols is None else _table_of_columns(path, cols, data_start, size - data_start)
    if table is None:
        raise _header_error(path, _json_object(path, text) if header is None else header, data_start, size)
    return FileHeader(path, head, data_start, size, table, {} if cols[0] is None else dict(cols[0]))


def _json_object(path: Path, text: str) -> dict:
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply for the parser
        raise CheckpointError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


def _good_metadata(metadata: object) -> bool:
    return isinstance(metadata, dict) and all(isinstance(v, str) and _is_text(k) and _is_text(v)
                                              for k, v in metadata.items())


_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


def _columns_of_json(header: dict) -> header_scan.Columns | None:
    """A json.loads'd header as header_scan's columns (raw values, unchecked), or None when an
    entry is not an object of exactly dtype, shape and two data_offsets. Whole-column steps
    at C speed: 100k entries in a few dozen passes, not 100k Python calls."""
    entries = dict(header)
    metadata = entries.pop("__metadata__", None)
    values = list(entries.values())
    if not set(map(type, values)) <= {dict} or not all(map(eq, map(dict.keys, values), repeat(_ENTRY_KEYS))):
        return None
    offsets = list(map(itemgetter("data_offsets"), values))
    if not set(map(type, offsets)) <= {list} or not set(map(len, offsets)) <= {2}:
        return None
    return header_scan.Columns((metadata, list(entries), list(map(itemgetter("dtype"), values)),
                                list(map(itemgetter("shape"), values)), list(map(itemgetter(0), offsets)),
                                list(map(itemgetter(1), offsets))))


def _fields_ok(names: list, dtypes: list, shapes: list, begins: list, ends: list, data_len: int) -> bool:
    """Each entry's fields as `_entry_span` checks them, a column at a time (`names` not empty)."""
    try:
        if set(map(type, dtypes)) != {str} or not set(dtypes) <= ITEMSIZE.keys() \
                or not set(map(type, shapes)) <= {list, tuple}:
            return False
        dims = list(chain.from_iterable(shapes))
        if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) >= 2**53):
            return False
        if set(map(type, begins)) != {int} or set(map(type, ends)) != {int} or min(begins) < 0 \
                or max(ends) > data_len:
            return False
        "\n".join(names).encode("utf-8")  # no lone surrogate in any name (_is_text)
    except UnicodeEncodeError:
        return False
    # end - begin == numel x itemsize (so begin <= end)
    return list(map(sub, ends, begins)) == list(map(mul, map(prod, shapes), map(ITEMSIZE.__getitem__, dtypes)))


def _table_of_columns(path: Path, cols: header_scan.Columns, data_start: int, data_len: int) -> TensorTable | None:
    """The header's tensors in data order, when its metadata and every entry are well formed
    and the tensors tile the data region exactly; else None (`_header_error` names why)."""
    metadata, names, dtypes, shapes, begins, ends = cols
    if metadata is not None and not _good_metadata(metadata):
        return None
    if not names:  # no tensors: valid only on an empty data region
        return TensorTable([], [], [], [], [], [(path, 0)]) if data_len == 0 else None
    if not _fields_ok(names, dtypes, shapes, begins, ends, data_len):
        return None
    pairs = list(zip(begins, ends))
    if not all(map(le, pairs, islice(pairs, 1, None))):  # not in data order: a stable sort by (begin, end)
        order = sorted(range(len(pairs)), key=pairs.__getitem__)
        names, dtypes, shapes = [names[i] for i in order], [dtypes[i] for i in order], [shapes[i] for i in order]
        begins, ends = [begins[i] for i in order], [ends[i] for i in order]
    if begins[0] != 0 or ends[-1] != data_len or begins[1:] != ends[:-1]:  # gaps or overlaps
        return None
    if set(map(type, shapes)) != {tuple}:  # json.loads' lists: one tuple per distinct shape
        shape_of = {s: s for s in map(tuple, shapes)}
        shapes = list(map(shape_of.__getitem__, map(tuple, shapes)))
    begins = list(map(add, begins, repeat(data_start)))
    ends = [*begins[1:], ends[-1] + data_start]  # tiling: each end is the next begin (the same int)
    return TensorTable(names, dtypes, shapes, begins, ends, [(path, 0)])


def _header_error(path: Path, header: dict, data_start: int, size: int) -> CheckpointError:
    """What is wrong with a header `_table_of_columns` refused, one check at a time in the
    order a reader meets them: the metadata, each entry in the header's order, then the
    tiling in data order (like safetensors itself: no gaps or overlaps, so that every byte
    of the file is covered by the header hash or a block hash)."""
    entries = dict(header)
    metadata = entries.pop("__metadata__", None)
    if metadata is not None and not _good_metadata(metadata):
        return CheckpointError(f"{path}: __metadata__ must map strings to strings")
    spans = [_entry_span(path, name, entry, size - data_start) for name, entry in entries.items()]
    pos = 0
    for begin, end, name in sorted(spans, key=itemgetter(0, 1)):  # stable: ties keep the header's order
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else "leaves a gap before it"
            return CheckpointError(f"{path}: tensor {name!r}: data_offsets {what}")
        pos = end
    if data_start + pos != size:
        return CheckpointError(f"{path}: {size - data_start - pos} bytes after the last tensor are not "
                               "described by the header")
    # unreachable while _table_of_columns and _entry_span apply the same checks
    return CheckpointError(f"{path}: header refused, but no check names why (a mergepipe bug: please report)")


def _entry_span(path: Path, name: str, entry: object, data_len: int) -> tuple[int, int, str]:
    """(begin, end, name) of one entry, offsets relative to the data region, after the checks
    `_fields_ok` makes a column at a time, one by one, so the error names what is wrong."""
    where = f"{path}: tensor {name!r}"
    if not _is_text(name):
        raise CheckpointError(f"{where}: tensor name is not valid Unicode (lone surrogate escape)")
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise CheckpointError(f"{where}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**53 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be two integers, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{where}: data_offsets {offsets} out of range for {data_len} data bytes")
    expected = prod(shape) * ITEMSIZE[dtype]
    if end - begin != expected:
        raise CheckpointError(f"{where}: {end - begin} bytes but shape {shape} x {dtype} needs {expected}")
    return begin, end, name


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A model folder or single file: every tensor's location, from headers only."""

    root: Path
    files: tuple[FileHeader, ...]  # in weight_map / name order
    tensors: TensorTable = field(repr=False)  # name -> TensorInfo, in file order, then offset order

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    @property
    def total_bytes(self) -> int:
        return self.tensors.total_bytes()


def _inside(root: Path, rel: str) -> Path:
    """Resolve a weight_map file name, refusing anything that leaves `root`."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\\" in rel:
        raise CheckpointError(f"{root / INDEX_JSON}: weight_map names an invalid file {rel!r}")
    candidate = (root / rel)
    real_root = root.resolve()
    real = candidate.resolve()
    if real_root not in real.parents and not _hub_blob(real_root, real):
        raise CheckpointError(f"{root / INDEX_JSON}: weight_map file {rel!r} leaves the model folder")
    if not candidate.is_file():
        raise CheckpointError(f"{root / INDEX_JSON}: weight_map names missing file {rel!r}")
    return candidate


def _hub_blob(real_root: Path, real: Path) -> bool:
    """A Hugging Face cache snapshot (`models--org--name/snapshots/<rev>/`) links each file to
    the same repo's blob store (`models--org--name/blobs/<hash>`): the one place outside the
    folder a shard may resolve to."""
    repo = real_root.parent.parent
    return (real_root.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--"))
            and real.parent == repo / "blobs" and real.is_file())


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a model folder (single file or sharded with an index json) or one file.

    Raises:
        CheckpointError: missing/empty folder, pickle-only folder, bad index json,
        malformed headers, duplicate tensors across shards, index/header disagreement.
    """
    path = Path(path)
    if path.is_file():
        return _build(path.parent, [path], None)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such model folder or file")
    index_path = path / INDEX_JSON
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{index_path}: not valid JSON: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
        names = weight_map.values()
        if all(isinstance(f, str) for f in names):
            names = set(names)  # each shard resolved once, not once per tensor (a resolve() each)
        files = sorted({_inside(path, f) for f in names})
        single = path / "model.safetensors"
        if single.exists() and single.resolve() not in {f.resolve() for f in files}:
            # transformers loads model.safetensors before the index: merging the shards would
            # merge another model than the one the folder loads as
            raise CheckpointError(f"{single}: the folder also has {INDEX_JSON}, which does not name it; "
                                  "transformers would load this file, the index names other shards; "
                                  "remove whichever is stale")
        return _build(path, files, weight_map)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(f"{path}: only pickle checkpoints ({pickles[0]}); "
                                  "they are refused, convert to safetensors")
        raise CheckpointError(f"{path}: no .safetensors files in model folder")
    if len(files) > 1:
        raise CheckpointError(f"{path}: {len(files)} .safetensors files but no {INDEX_JSON}")
    return _build(path, files, None)


def _build(root: Path, files: list[Path], weight_map: dict | None) -> Checkpoint:
    headers = [parse_header(f) for f in files]
    with paused_gc():
        tensors = concat([h.table for h in headers])
    if not tensors.unique():
        first: dict[str, int] = {}
        for i, name in enumerate(tensors.names):
            if name in first:
                raise CheckpointError(f"{tensors.file_at(i)}: tensor {name!r} also stored in "
                                      f"{tensors.file_at(first[name])}")
            first[name] = i
    if weight_map is not None:
        index_path = root / INDEX_JSON
        resolved: dict[tuple[bool, object], Path] = {}

        def real(p: Path | str, *, in_root: bool) -> Path:  # resolved once per file, not once per tensor
            key = (in_root, p)
            if key not in resolved:
                resolved[key] = ((root / p) if in_root else Path(p)).resolve()
            return resolved[key]

        row = tensors.row_map
        for name, fname in weight_map.items():
            i = row.get(name)
            if i is None:
                raise CheckpointError(f"{index_path}: tensor {name!r} listed in weight_map but not in {fname}")
            file = tensors.file_at(i)
            if real(file, in_root=False) != real(fname, in_root=True):
                raise CheckpointError(f"{index_path}: tensor {name!r} mapped to {fname} but stored in {file.name}")
        if len(weight_map) != len(tensors):
            extra = [n for n in tensors if n not in weight_map]
            raise CheckpointError(f"{index_path}: tensor {extra[0]!r} in {tensors[extra[0]].file.name} "
                                  "is missing from weight_map")
    return Checkpoint(root, tuple(headers), tensors)


class ReadCounter:
    """Bytes requested per file; what budgets are checked against. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_file: dict[str, int] = {}

    def add(self, path: Path, n: int) -> None:
        with self._lock:
            key = str(path)
            self.by_file[key] = self.by_file.get(key, 0) + n

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.by_file.values())


class CheckpointReader:
    """Exact byte-range reads of one checkpoint, counted per file.

    `random_access` sets POSIX_FADV_RANDOM so the kernel does not read ahead
    into regions the plan skips (experts); the base is read sequentially.
    """

    def __new__(cls, ckpt: Checkpoint, **options: object) -> CheckpointReader:
        # A virtual checkpoint (checkpoint/lora.py) names the reader that makes its bytes, so
        # that every reader opened on it, wherever, returns those and not its files' own.
        own = getattr(type(ckpt), "reader_class", None)
        return object.__new__(own if own is not None and issubclass(own, cls) else cls)

    def __init__(self, ckpt: Checkpoint, *, counter: ReadCounter | None = None,
                 random_access: bool = True) -> None:
        self.ckpt = ckpt
        self.counter = counter or ReadCounter()
        self._fds: dict[Path, int] = {}
        for h in ckpt.files:
            fd = os.open(h.path, os.O_RDONLY)
            self._fds[h.path] = fd
            if hasattr(os, "posix_fadvise"):
                advice = os.POSIX_FADV_RANDOM if random_access else os.POSIX_FADV_SEQUENTIAL
                os.posix_fadvise(fd, 0, 0, advice)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_range(self, t: TensorInfo, begin: int, end: int) -> bytearray | memoryview:
        """Read absolute bytes [begin, end) of tensor t's file into a fresh, writable buffer
        (a bytearray, or, where numpy is loaded, a view of an uninitialised numpy array: the
        read fills every byte, so zero-filling it first, a pass over every byte merged or
        indexed, is saved)."""
        np = sys.modules.get("numpy")
        buf = bytearray(end - begin) if np is None else memoryview(np.empty(end - begin, dtype=np.uint8))
        view = memoryview(buf)
        fd, got = self._fds[t.file], 0
        while got < len(buf):
            n = os.preadv(fd, [view[got:]], begin + got)
            if n == 0:
                raise CheckpointError(f"{t.file}: tensor {t.name!r}: file truncated at byte {begin + got}")
            got += n
        self.counter.add(t.file, len(buf))
        return buf

    def read_rows(self, name: str, row_start: int, row_end: int) -> bytearray:
        t = self.ckpt.tensors[name]
        rb = t.row_bytes()
        return self.read_range(t, t.begin + row_start * rb, t.begin + row_end * rb)

    def read_blocks(self, name: str, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """Read several row ranges of one tensor, one pread per run of adjacent ranges."""
        t = self.ckpt.tensors[name]
        rb = t.row_bytes()
        out: list[memoryview] = []
        i = 0
        while i < len(ranges):
            j = i
            while j + 1 < len(ranges) and ranges[j + 1][0] == ranges[j][1]:
                j += 1
            buf = memoryview(self.read_range(t, t.begin + ranges[i][0] * rb, t.begin + ranges[j][1] * rb))
            pos = 0
            for start, end in ranges[i:j + 1]:
                n = (end - start) * rb
                out.append(buf[pos:pos + n])
                pos += n
            i = j + 1
        return out


def as_tensor(buf: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """View raw little-endian bytes as a tensor (no copy when the buffer is writable)."""
    import torch
    tdtype = getattr(torch, _DTYPE_INFO[dtype][1])
    if len(buf) == 0:
        return torch.empty(shape, dtype=tdtype)
    if isinstance(buf, bytes):
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=tdtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor (bf16 included) without a copy."""
    import torch
    t = t.contiguous().reshape(-1)  # 0-d tensors cannot be viewed as bytes; their 1-element view can
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.dtype != torch.uint8 else memoryview(t.numpy())


class OutTensor(NamedTuple):
    """A tensor of a file to write (a named tuple: made once per tensor of the output)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


FS_BLOCK = 4096  # the file-system block size reflinks share at (btrfs, XFS: 4 KiB)


_ENTRY_TEXT = '{}:{{"dtype":{},"shape":{},"data_offsets":[{},{}]}}'.format  # one header entry, compact


def _header_json(names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], begins: list[int],
                 ends: list[int], metadata: dict[str, str] | None) -> bytearray:
    """The header's JSON: json.dumps({"__metadata__": sorted metadata, name: {dtype, shape,
    data_offsets: [begins[i], ends[i]]}, ...}, separators=(",", ":")), the same bytes.
    The entries are formatted in C-speed passes over the columns (json.dumps of a dict per
    tensor, then an f-string per tensor, were most of a 100k-tensor writer's setup), a few
    thousand at a time into one buffer (all the entries' texts at once were ~20 MB more at the peak)."""
    out = bytearray(b"{")
    if metadata:
        out += ('"__metadata__":' + json.dumps(dict(sorted(metadata.items())), separators=(",", ":"))).encode()
    dtype_text = {d: _esc(d) for d in set(dtypes)}
    shape_text = {sh: json.dumps(list(sh), separators=(",", ":")) for sh in set(shapes)}
    for a in range(0, len(names), 4096):
        z = a + 4096
        text = ",".join(map(_ENTRY_TEXT, map(_esc, names[a:z]), map(dtype_text.__getitem__, dtypes[a:z]),
                            map(shape_text.__getitem__, shapes[a:z]), begins[a:z], ends[a:z]))
        out += (("," if len(out) > 1 else "") + text).encode()
    out += b"}"
    return out


class SafetensorsWriter:
    """Writes a .safetensors file whose header is known up front; blocks arrive in
    any order and are `pwrite`n at their offsets, so memory stays O(block)."""

    def __init__(self, path: str | Path, tensors: list[OutTensor], *,
                 metadata: dict[str, str] | None = None, align_like: int | None = None,
                 direct: bool = False) -> None:
        """`align_like`: the data start of the base file this one mirrors (same tensors at
        the same data offsets). The header is then padded with spaces so that this file's
        data starts at the same offset modulo FS_BLOCK as the base's: copied runs of base
        bytes sit at the same place within a file-system block, so a reflink-capable file
        system (btrfs, XFS) can share their extents instead of copying them.

        `direct`: the caller writes every byte in file order (`write_rows` only, no
        `copy_rows`), and they go to the device around the page cache where the file system
        takes O_DIRECT (checkpoint/direct_io.py)."""
        self.path = Path(path)
        # columns, made in whole-column steps (100k tensors): tensor i's data is offsets[i]:offsets[i + 1]
        self._tensors = tensors
        names = list(map(itemgetter(0), tensors))
        dtypes, shapes = list(map(itemgetter(1), tensors)), list(map(itemgetter(2), tensors))
        offsets = [0, *accumulate(map(mul, map(prod, shapes), map(ITEMSIZE.__getitem__, dtypes)))]
        offset = offsets[-1]
        self._row = dict(zip(names, range(len(names))))
        if len(self._row) == len(names):
            begins, ends = offsets[:-1], offsets[1:]
        else:  # a repeated name: one entry, at the last one's place (as a dict of them)
            rows = list(self._row.values())
            names, dtypes, shapes = list(self._row), [dtypes[i] for i in rows], [shapes[i] for i in rows]
            begins, ends = [offsets[i] for i in rows], [offsets[i + 1] for i in rows]
        raw = _header_json(names, dtypes, shapes, begins, ends, metadata)
        del begins, ends
        self._offsets = array("q", offsets)
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors does
        if align_like is not None and align_like % 8 == 0:
            raw += b" " * ((align_like - 8 - len(raw)) % FS_BLOCK)
        self.header = len(raw).to_bytes(8, "little") + raw  # the file's first data_start bytes
        self.data_start = len(self.header)
        self.size = self.data_start + offset
        self._appender = None
        self._direct = direct
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            self._fd = direct_open(self.path, flags) if direct else os.open(self.path, flags, 0o644)
            os.ftruncate(self._fd, self.size)
            if direct:
                self._appender = DirectAppender(self._fd)
                self._appender.append(self.header)
            else:
                self._pwrite(self.header, 0)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot write: {e.strerror}") from None
        self.bytes_written = self.data_start

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, begin, end): each tensor's absolute byte range in the file, in layout order."""
        d, o = self.data_start, self._offsets
        return [(name, d + o[i], d + o[i + 1]) for name, i in self._row.items()]

    def file_order(self) -> list[str]:
        """The tensor names in file order (checkpoint/treehash.py file_order of the spans)."""
        o = self._offsets
        if len(self._row) == len(self._tensors) and all(map(lt, o, islice(o, 1, None))):
            return list(self._row)  # no two tensors begin at one offset: layout order
        from mergepipe.checkpoint.treehash import file_order
        return file_order(self.spans())

    def tensor(self, name: str) -> OutTensor:
        return self._tensors[self._row[name]]

    def offset_of(self, name: str, row_start: int) -> int:
        """Absolute file offset of row `row_start` of tensor `name`."""
        i = self._row[name]
        if row_start == 0:
            return self.data_start + self._offsets[i]
        t = self._tensors[i]
        return self.data_start + self._offsets[i] + row_start * row_bytes(t.shape, ITEMSIZE[t.dtype])

    @property
    def direct(self) -> bool:
        return self._direct

    def write_rows(self, name: str, row_start: int, data: bytes | memoryview) -> None:
        from mergepipe.util.fs import start_writeback
        offset, n = self.offset_of(name, row_start), len(memoryview(data).cast("B"))
        try:
            if self._appender is not None:
                if offset != self._appender.position:  # a bug of the caller's, not a user error
                    raise AssertionError(f"{self.path}: tensor {name!r} row {row_start} written out of order")
                self._appender.append(data)
                if self._appender.position == self.size:  # the last byte: free the buffers now, not
                    self._finish_direct()                 # at close (one output file after another)
            else:
                self._pwrite(data, offset)
                start_writeback(self._fd, offset, n)  # so that close()'s fsync has little left
        except OSError as e:
            raise OutputError(f"{self.path}: write of tensor {name!r} failed: {e.strerror}") from None
        self.bytes_written += n

    def _finish_direct(self) -> None:
        """Write the appender's last chunk, padded to the sector, then cut the file back."""
        appender, self._appender = self._appender, None
        appender.close()
        os.ftruncate(self._fd, self.size)

    def copy_rows(self, name: str, row_start: int, src_fd: int, src_offset: int, nbytes: int) -> int:
        """Copy rows of `name` from another file (base bytes the output keeps) without them
        passing through Python (util.fs.copy_range); returns the bytes the kernel copied."""
        from mergepipe.util.fs import copy_range, start_writeback
        assert not self._direct, "a direct writer takes its bytes in order (write_rows)"
        offset = self.offset_of(name, row_start)
        try:
            kernel = copy_range(src_fd, src_offset, self._fd, offset, nbytes)
        except OSError as e:
            raise OutputError(f"{self.path}: copy of tensor {name!r} failed: {e.strerror}") from None
        start_writeback(self._fd, offset, nbytes)
        return kernel

    def close(self) -> None:
        """fsync and close; the caller publishes the folder."""
        if self._fd >= 0:
            what = "fsync" if self._appender is None else "write"
            try:
                if self._appender is not None:
                    self._finish_direct()
                what = "fsync"
                os.fsync(self._fd)
            except OSError as e:
                raise OutputError(f"{self.path}: {what} failed: {e.strerror}") from None
            finally:
                os.close(self._fd)
                self._fd = -1

    def abort(self) -> None:
        if self._appender is not None:
            self._appender.abort()
            self._appender = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
