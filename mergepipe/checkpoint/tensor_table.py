"""A checkpoint's tensors as columns: name -> TensorInfo without an object per tensor.

A header of 100,000 tensors (MoE checkpoints have tens of thousands) made 100k
`TensorInfo`s and a dict per checkpoint, ~25-40 MB each, alive through a merge. A
`TensorTable` holds the same facts as a few lists (names, dtypes, shapes, absolute begin
and end offsets) plus one name -> row dict, and makes the `TensorInfo` when a tensor is
looked up: code that asks for one tensor works unchanged, bulk code (the engine's packs,
the index checks) reads the columns.

The columns are read only, so tables share them: an expert whose header is byte for
byte the base's (checkpoint/safetensors.py `_same_header`) is the base's table with its
own file path, and a single-file checkpoint's table is its file's.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping
from itertools import chain, repeat
from pathlib import Path

# checkpoint/safetensors.py's named tuple, set there once it is defined (that module imports
# this one first); an import in each lookup was a module __getattr__ call per tensor
TensorInfo: type = tuple


class TensorTable(Mapping):
    """name -> TensorInfo, in file order then offset order.

    names, dtypes, shapes (tuples), begins, ends (absolute byte offsets in the tensor's
    file): one item per tensor. `runs`: (file, first row) of each file's tensors, in row
    order (one run for a single-file checkpoint)."""

    __slots__ = ("names", "dtypes", "shapes", "begins", "ends", "runs", "_row", "_starts", "_lookups", "_infos")

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], begins: list[int],
                 ends: list[int], runs: list[tuple[Path, int]], row: dict[str, int] | None = None) -> None:
        self.names, self.dtypes, self.shapes, self.begins, self.ends = names, dtypes, shapes, begins, ends
        self.runs = runs
        self._starts = [r for _, r in runs]
        self._row = dict(zip(names, range(len(names)))) if row is None else row
        self._lookups, self._infos = 0, None

    def with_file(self, path: Path) -> TensorTable:
        """These tensors at the same offsets of another file (same columns and row map)."""
        return TensorTable(self.names, self.dtypes, self.shapes, self.begins, self.ends, [(path, 0)], self._row)

    @property
    def row_map(self) -> dict[str, int]:
        """name -> row (read only: shared with the tables and indexes of the same tensors)."""
        return self._row

    def unique(self) -> bool:
        """Whether no name repeats (the row map then has one entry per row)."""
        return len(self._row) == len(self.names)

    def row(self, name: str) -> int:
        return self._row[name]

    def file_at(self, i: int) -> Path:
        runs = self.runs
        return runs[0][0] if len(runs) == 1 else runs[bisect_right(self._starts, i) - 1][0]

    def files(self) -> Iterator[Path]:
        """Each tensor's file, in row order."""
        bounds = [*self._starts[1:], len(self.names)]
        return chain.from_iterable(repeat(f, z - a) for (f, a), z in zip(self.runs, bounds))

    def info(self, i: int) -> TensorInfo:
        return tuple.__new__(TensorInfo, (self.names[i], self.dtypes[i], self.shapes[i], self.file_at(i),
                                          self.begins[i], self.ends[i]))

    def __getitem__(self, name: str) -> TensorInfo:
        if self._infos is not None:
            return self._infos[name]
        self._lookups += 1
        if self._lookups > 64 + len(self.names) // 4:
            # looked up tensor by tensor (an index scan asks several times per tensor): the
            # objects are made once after all, and kept
            self._infos = dict(zip(self.names, self.values()))
            return self._infos[name]
        return self.info(self._row[name])

    def get(self, name: str, default=None):
        return self[name] if name in self._row else default

    def __contains__(self, name: object) -> bool:
        return name in self._row

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def keys(self):
        return self._row.keys()  # same order as names; a set-like view

    def values(self) -> list[TensorInfo]:
        if self._infos is not None:
            return list(self._infos.values())
        rows = zip(self.names, self.dtypes, self.shapes, self.files(), self.begins, self.ends)
        return list(map(tuple.__new__, repeat(TensorInfo), rows))  # TensorInfo(*row), no Python call each

    def items(self) -> list[tuple[str, TensorInfo]]:
        return list(zip(self.names, self.values()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return (self.names == other.names and self.dtypes == other.dtypes and self.shapes == other.shapes
                    and self.begins == other.begins and self.ends == other.ends
                    and list(self.files()) == list(other.files()))
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorTable({len(self.names)} tensors)"

    def total_bytes(self) -> int:
        return sum(self.ends) - sum(self.begins)


def concat(tables: list[TensorTable]) -> TensorTable:
    """The tensors of several files' tables, in order (a sharded checkpoint)."""
    if len(tables) == 1:
        return tables[0]
    names, dtypes, shapes, begins, ends, runs = [], [], [], [], [], []
    for t in tables:
        runs += [(f, r + len(names)) for f, r in t.runs]
        names += t.names
        dtypes += t.dtypes
        shapes += t.shapes
        begins += t.begins
        ends += t.ends
    return TensorTable(names, dtypes, shapes, begins, ends, runs)


def subset(table: TensorTable, names: list[str]) -> TensorTable:
    """The tensors `names` names, in that order (a split merge's part of the base)."""
    rows = list(map(table.row, names))
    files = list(map(table.file_at, rows))
    runs = [(f, i) for i, f in enumerate(files) if i == 0 or f is not files[i - 1] and f != files[i - 1]]
    pick = [table.names, table.dtypes, table.shapes, table.begins, table.ends]
    return TensorTable(*([col[r] for r in rows] for col in pick), runs)
