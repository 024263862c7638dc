"""Columnar index records: a decoded index's tensors as a few flat arrays, not an object
per tensor (a checkpoint may have 100,000 tensors).

`ModelColumns` and `DeltaColumns` are read-only mappings, name -> TensorEntry /
TensorDelta, that make the entry when it is looked up: code that asks for one tensor
works unchanged, and the bulk checks (store.py: the index describes the checkpoint, the
content hash; plan/record.py: the plan's reads) use the columns directly. A decoded
index of N tensors is then a handful of lists and the file's own bytes (the arrays are
views of it), not N frozen objects with a tuple per field.

Nothing is cached per lookup: an entry looked up twice is made twice (the engine and the
checks use the columns; what looks entries up one by one does so once or a few times).
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate, chain, islice, repeat
from operator import le
from json.encoder import encode_basestring_ascii as _esc

from blake3 import blake3

from mergepipe.checkpoint.blocks import block_ranges
from mergepipe.index.records import TensorDelta, TensorEntry

DIGEST = 32  # bytes of one block hash (blake3)


def _starts(counts: list[int]) -> array:
    """Prefix sums: element i is where item i's run starts, the last one the total. An
    array of int64, not a list: 8 bytes an item instead of an int object each (100k
    tensors, five such columns per delta index)."""
    return array("q", [0, *accumulate(counts)])


class BlockEq(Mapping):
    """A decoded tensor's split-run counts (TensorDelta.block_eq: rank position -> per-block
    counts), cut out of the file's flat array only when a key is looked up: a bf16 family
    has tens of thousands of such keys per expert and a merge asks for a few."""

    __slots__ = ("_keys", "_flat", "_start", "_width", "_cut")

    def __init__(self, keys: list[int], flat: list[int], start: int, width: int) -> None:
        self._keys = {k: i for i, k in enumerate(keys)}
        self._flat, self._start, self._width = flat, start, width
        self._cut: dict[int, tuple[int, ...]] = {}

    def __getitem__(self, key: int) -> tuple[int, ...]:
        got = self._cut.get(key)
        if got is None:
            a = self._start + self._keys[key] * self._width
            got = self._cut[key] = tuple(self._flat[a:a + self._width])
        return got

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


# (names, name -> row) of the last index whose names were shared: the indexes of one family's
# models have the same tensors, so their row maps (100k entries each) are one dict
_LAST_POS: list[tuple[list[str], dict[str, int]]] = []


class _ByName(Mapping):
    """A columnar index's tensors by name: subclasses set `names` and `_pos` (name -> row)
    and make the record of row i with `entry(i)`."""

    def __getitem__(self, name: str):
        return self.entry(self._pos[name])

    def __contains__(self, name: object) -> bool:
        return name in self._pos

    def share_names(self, names: list[str], pos: dict[str, int] | None = None) -> None:
        """Take these equal names (the checkpoint's, the expert index's) in place of the
        decoded ones, which are then freed: one string per tensor name in memory, not one per copy.
        `pos`: their name -> row dict (the checkpoint's, checkpoint/tensor_table.py), shared."""
        if names != self.names:
            raise ValueError("not the same names")
        self.names = names
        last = _LAST_POS[0] if _LAST_POS else None
        if pos is not None:
            self._pos = pos  # read only, so shared
        elif last is not None and last[0] == names:  # the same tensors as the last index checked
            self._pos = last[1]
        else:
            self._pos = dict(zip(names, range(len(names))))
        _LAST_POS[:] = [(names, self._pos)]

    def rows_of(self, names) -> list[int]:
        """The row of each of `names` (KeyError for one not here), in one C-speed pass."""
        return list(map(self._pos.__getitem__, names))

    def has_all(self, names) -> bool:
        return all(map(self._pos.__contains__, names))

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class ModelColumns(_ByName):
    """tensor name -> TensorEntry of a model index, in checkpoint order.

    names, dtypes, shapes (tuples of ints): one item per tensor; starts: tensor i's blocks
    are starts[i]:starts[i + 1]; ranges: the flat (row start, row end) of every block
    (2 ints per block); digests: 32 bytes per block."""

    __slots__ = ("names", "dtypes", "shapes", "starts", "ranges", "digests", "_pos", "row_bytes")

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], counts: list[int],
                 ranges: Sequence[int], digests: bytes | memoryview) -> None:
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.starts = _starts(counts)
        self.ranges, self.digests = ranges, digests
        self.row_bytes = None  # bytes per row of each tensor, once asked (index/read_bytes.py)
        self._pos = dict(zip(names, range(len(names))))
        if len(self._pos) != len(names):
            raise ValueError("duplicate tensor names")
        if len(ranges) != 2 * self.starts[-1] or len(digests) != DIGEST * self.starts[-1]:
            raise ValueError("block arrays do not match the block counts")

    def index_of(self, name: str) -> int:
        return self._pos[name]

    def entry(self, i: int) -> TensorEntry:
        a, z = self.starts[i], self.starts[i + 1]
        flat = list(self.ranges[2 * a:2 * z])
        hexes = bytes(self.digests[DIGEST * a:DIGEST * z]).hex()
        return TensorEntry(self.names[i], self.dtypes[i], self.shapes[i], tuple(zip(flat[0::2], flat[1::2])),
                           tuple(hexes[64 * k:64 * k + 64] for k in range(z - a)))

    def content_hash(self) -> str:
        """records.content_hash of these tensors, from the columns: blake3 over one JSON row
        [name, dtype, shape, hashes] per tensor in name order (the text `_row_json` makes),
        joined from pieces in one pass (escaped names, one text per dtype and per shape with
        the separators around it, the hash lists sliced out of one hex string): no string per
        row is made."""
        n = len(self.names)
        hexes = bytes(self.digests).hex()
        starts = self.starts
        if starts == array("q", range(n + 1)):  # one block each (the many-tensors case): C-speed slices
            hashes = list(map(hexes.__getitem__, map(slice, range(0, 64 * n, 64), range(64, 64 * n + 1, 64))))
            open_list, close = '], ["', '"]]\n'
        else:
            hashes = ['"' + '", "'.join(hexes[64 * k:64 * k + 64] for k in range(a, z)) + '"' if z > a else ""
                      for a, z in zip(starts, starts[1:])]
            open_list, close = "], [", "]]\n"
        dtype_text = {d: ", " + _esc(d) + ", [" for d in set(self.dtypes)}
        shape_text = {sh: ", ".join(map(str, sh)) + open_list for sh in set(self.shapes)}
        names, dtypes, shapes = self.names, self.dtypes, self.shapes
        if not all(map(le, names, islice(names, 1, None))):  # rows in name order
            order = sorted(range(n), key=names.__getitem__)
            names, dtypes, shapes, hashes = ([col[i] for i in order] for col in (names, dtypes, shapes, hashes))
        rows = zip(repeat("["), map(_esc, names), map(dtype_text.__getitem__, dtypes),
                   map(shape_text.__getitem__, shapes), hashes, repeat(close))
        return blake3("".join(chain.from_iterable(rows)).encode()).hexdigest()


class DeltaColumns(_ByName):
    """tensor name -> TensorDelta of a delta index, in the expert's order.

    Per tensor: names, numel, nonfinite, and where its blocks (`bstarts`), ranks (`rstarts`),
    split-run keys (`estarts`) and their counts (`cstarts`) start in the flat arrays;
    `scalars` holds l1, l2, base_sq, expert_sq, dot per tensor (5 each); per block
    `block_l2`, `block_max`, `block_nnz`, `identical` (0/1 bytes); per rank `ranks`,
    `rank_values`, `count_gt`, `count_eq`; `eq_keys` and `eq` the split-run counts (one count
    per block of the tensor for each key)."""

    __slots__ = ("names", "numel", "nonfinite", "bstarts", "rstarts", "estarts", "cstarts", "scalars", "block_l2",
                 "block_max", "block_nnz", "identical", "ranks", "rank_values", "count_gt", "count_eq", "eq_keys",
                 "eq", "_pos")

    def __init__(self, names: list[str], numel: list[int], nonfinite: list[int], n_blocks: list[int],
                 n_ranks: list[int], n_eq: list[int], arrays: dict[str, Sequence]) -> None:
        self.names, self.numel, self.nonfinite = names, numel, nonfinite
        self.bstarts, self.rstarts, self.estarts = _starts(n_blocks), _starts(n_ranks), _starts(n_eq)
        self.cstarts = _starts([b * e for b, e in zip(n_blocks, n_eq)])
        for k in ("scalars", "block_l2", "block_max", "block_nnz", "identical", "ranks", "count_gt", "count_eq",
                  "eq_keys", "eq"):
            setattr(self, k, arrays[k])
        self.rank_values = arrays["values"]  # not `values`: that is Mapping.values()
        self._pos = dict(zip(names, range(len(names))))
        if len(self._pos) != len(names):
            raise ValueError("duplicate tensor names")
        nb, nr = self.bstarts[-1], self.rstarts[-1]
        want = {"scalars": 5 * len(names), "block_l2": nb, "block_max": nb, "block_nnz": nb, "identical": nb,
                "ranks": nr, "values": nr, "count_gt": nr, "count_eq": nr, "eq_keys": self.estarts[-1],
                "eq": self.cstarts[-1]}
        bad = next((k for k, n in want.items() if len(arrays[k]) != n), None)
        if bad is not None:
            raise ValueError(f"array {bad!r}: expected {want[bad]} items")
        for i in (i for i, e in enumerate(n_eq) if e > 1):
            keys = self.eq_keys[self.estarts[i]:self.estarts[i + 1]]
            if len(set(keys)) != len(keys):
                raise ValueError(f"tensor {names[i]!r}: duplicate block_eq keys")

    def index_of(self, name: str) -> int:
        return self._pos[name]

    def n_blocks(self) -> list[int]:
        b = self.bstarts
        return [z - a for a, z in zip(b, b[1:])]

    def entry(self, i: int) -> TensorDelta:
        b0, b1 = self.bstarts[i], self.bstarts[i + 1]
        r0, r1 = self.rstarts[i], self.rstarts[i + 1]
        e0, e1 = self.estarts[i], self.estarts[i + 1]
        l1, l2, base_sq, expert_sq, dot = self.scalars[5 * i:5 * i + 5]
        return TensorDelta(
            self.names[i], self.numel[i], l1, l2, self.nonfinite[i], tuple(self.block_l2[b0:b1]),
            tuple(self.block_max[b0:b1]), tuple(self.block_nnz[b0:b1]), tuple(x != 0 for x in self.identical[b0:b1]),
            tuple(self.ranks[r0:r1]), tuple(self.rank_values[r0:r1]), tuple(self.count_gt[r0:r1]),
            tuple(self.count_eq[r0:r1]), BlockEq(list(self.eq_keys[e0:e1]), self.eq, self.cstarts[i], b1 - b0),
            base_sq, expert_sq, dot)


def model_rows(tensors) -> Iterator[tuple[str, str, tuple[int, ...], Sequence[int]]]:
    """(name, dtype, shape, flat row ranges: r0, r1 of each block) of each tensor of a model
    index, in order, from the columns without making entries."""
    s, r = tensors.starts, tensors.ranges
    return zip(tensors.names, tensors.dtypes, tensors.shapes, (r[2 * a:2 * z] for a, z in zip(s, s[1:])))


def delta_rows(tensors, names: list[str]) -> Iterator[tuple[int, Sequence, Sequence[float]]]:
    """(nonfinite, identical per block, block_l2 per block) of each of `names` in a delta
    index, from the columns without making entries."""
    b = tensors.bstarts
    rows = range(len(names)) if tensors.names == names else map(tensors.index_of, names)
    return ((tensors.nonfinite[j], tensors.identical[b[j]:b[j + 1]], tensors.block_l2[b[j]:b[j + 1]])
            for j in rows)


def expected_ranges(names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]],
                    layout) -> tuple[list[int], list[int]]:
    """(block count per tensor, flat row ranges) that `layout` (checkpoint.blocks.BlockLayout)
    gives these tensors: what an index of them must hold. The arithmetic is done once per
    (shape, dtype, block size): a checkpoint of 100k tensors has a few dozen of them."""
    from mergepipe.checkpoint.safetensors import ITEMSIZE
    if layout.embedding_block_bytes is None:
        keys = list(zip(shapes, dtypes, repeat(layout.block_bytes)))
    else:  # a vocabulary tensor's block size depends on its name
        keys = [(sh, d, layout.bytes_for(n, sh)) for n, d, sh in zip(names, dtypes, shapes)]
    flat_of = {k: list(chain.from_iterable(block_ranges(k[0], ITEMSIZE[k[1]], k[2]))) for k in set(keys)}
    count_of = {k: len(v) // 2 for k, v in flat_of.items()}
    return list(map(count_of.__getitem__, keys)), list(chain.from_iterable(map(flat_of.__getitem__, keys)))


# (dtypes, shapes, layout, starts, flat ranges as int64 bytes) of the last index checked: the
# models of one family have the same tensors, so the expected block rows are made once
_LAST_EXPECTED: list[tuple] = []


def _expected_columns(cols: ModelColumns, layout) -> tuple[array, bytes]:
    """(starts, flat row ranges as int64 bytes) that `layout` gives cols' tensors."""
    last = _LAST_EXPECTED[0] if _LAST_EXPECTED else None
    if last is not None and last[2] == layout and last[0] == cols.dtypes and last[1] == cols.shapes \
            and (layout.embedding_block_bytes is None or last[5] == cols.names):
        return last[3], last[4]
    counts, flat = expected_ranges(cols.names, cols.dtypes, cols.shapes, layout)
    got = (_starts(counts), array("q", flat).tobytes())
    vocab_names = cols.names if layout.embedding_block_bytes is not None else None  # kept only when they matter
    _LAST_EXPECTED[:] = [(cols.dtypes, cols.shapes, layout, *got, vocab_names)]
    return got


def describes(index, ckpt, layout) -> bool:
    """store._model_matches for a decoded (columnar) index, in whole-column steps: the
    checkpoint's tensors, dtypes and shapes in its order, the layout's block rows, and a
    content hash that the block hashes give."""
    cols: ModelColumns = index.tensors
    table = ckpt.tensors  # checkpoint/tensor_table.py: columns too
    if index.layout != layout or cols.names != table.names or cols.dtypes != table.dtypes \
            or cols.shapes != table.shapes:
        return False
    starts, flat = _expected_columns(cols, layout)
    ranges = cols.ranges.tobytes() if isinstance(cols.ranges, memoryview) else array("q", cols.ranges).tobytes()
    if cols.starts != starts or ranges != flat or cols.content_hash() != index.content_hash:
        return False
    cols.share_names(table.names, table.row_map)  # one name -> row dict for checkpoint and index
    return True


def delta_describes(delta, base_index, expert_index) -> bool:
    """store._delta_matches for decoded (columnar) indexes: this expert's against this base,
    the expert's tensors, one entry per block (the per-rank arrays have one length by the
    file's construction)."""
    cols: DeltaColumns = delta.tensors
    exp: ModelColumns = expert_index.tensors
    if (delta.expert_hash, delta.base_hash, delta.layout) != \
            (expert_index.content_hash, base_index.content_hash, expert_index.layout):
        return False
    if cols.names == exp.names:
        if cols.bstarts != exp.starts:
            return False
        cols.share_names(exp.names)
        return True
    if set(cols.names) != set(exp.names) or len(cols.names) != len(exp.names):
        return False
    nb = cols.n_blocks()
    return all(nb[cols.index_of(n)] == exp.starts[i + 1] - exp.starts[i] for i, n in enumerate(exp.names))
