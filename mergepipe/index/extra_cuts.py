"""Exact rank cuts off the index's grid: the |delta| thresholds a magnitude method (TIES,
Breadcrumbs) asks for at a density or gamma the delta index holds no cut for (it stores the
ranks of two-decimal values only, index/ranks.py `requested_ranks`).

Made by the index's own passes (index/scan.py, `build.build_extra_cuts`) at just the wanted
ranks, in one scan of the tensors that need them, so each cut is the one the index would hold
at that rank: value, elements above and equal, and the per-block counts where it splits a run of
equal values. Cached by content under `cuts/` (index/cache.py) and keyed by (format, expert,
base, block layout, the wanted ranks of each tensor); the entry records the blake3 of its cuts,
which the plan records per expert (`cuts`), so a merge uses exactly the cuts it was planned
with. An entry is untrusted input: one that is not well-formed, is another request's, does not
fit the tensors, or whose cuts do not hash to its blake3 is refused in one line (IntegrityError).

`with_cuts` lays an expert's cuts over its decoded delta index, so a tensor's record holds its
grid cuts and these, in rank order (engine/cuts.py looks a rank up there). No torch here.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from blake3 import blake3

from mergepipe.errors import IntegrityError
from mergepipe.index.cache import CacheLayout
from mergepipe.index.columns import DeltaColumns
from mergepipe.index.records import DeltaIndex, TensorDelta
from mergepipe.util.fs import canonical_json

CUTS_FORMAT = 1
MAX_ENTRY_BYTES = 1 << 30  # an entry's cuts are a few numbers per tensor (block counts where split)
Wanted = dict[str, tuple[int, ...]]  # tensor -> ascending ranks 0 < r < numel


@dataclass(frozen=True, slots=True)
class Cut:
    """The cut at one rank: |delta| as its fp32 pattern, how many elements are above and equal,
    and, only where the rank splits a run of equal values, how many each block holds."""
    rank: int
    value_bits: int
    count_gt: int
    count_eq: int
    block_eq: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class ExtraCuts:
    """One expert's cuts off the grid (tensor -> cuts in rank order) and their blake3."""
    tensors: dict[str, tuple[Cut, ...]]
    digest: str


def cache_path(root: str | Path, expert_hash: str, base_hash: str, layout_key: int | str, wanted: Wanted) -> Path:
    """Where the entry of these cuts lives; `layout_key`: the index's `BlockLayout.key`."""
    key = blake3(canonical_json({"format": CUTS_FORMAT, "expert": expert_hash, "base": base_hash,
                                 "blocks": str(layout_key), "ranks": {t: list(r) for t, r in wanted.items()}}))
    return CacheLayout(root).cuts(key.hexdigest()[:40])


def from_scan(scanned: dict[str, TensorDelta]) -> ExtraCuts:
    """The cuts of `build.build_extra_cuts`'s records (ranks (0, *wanted)), in tensor name order."""
    tensors = {}
    for name in sorted(scanned):
        td = scanned[name]
        tensors[name] = tuple(Cut(td.ranks[j], _bits(td.values[j]), td.count_gt[j], td.count_eq[j],
                                  tuple(td.block_eq[j]) if j in td.block_eq else None)
                              for j in range(1, len(td.ranks)))
    return ExtraCuts(tensors, _digest(_cuts_json(tensors)))


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]  # an fp32 value: exact


def _value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _cuts_json(tensors: dict[str, tuple[Cut, ...]]) -> dict:
    return {name: [[c.rank, c.value_bits, c.count_gt, c.count_eq, None if c.block_eq is None else list(c.block_eq)]
                   for c in cuts] for name, cuts in tensors.items()}


def _digest(cuts_json: dict) -> str:
    return blake3(canonical_json(cuts_json)).hexdigest()


def save(path: Path, cuts: ExtraCuts) -> None:
    from mergepipe.util.fs import atomic_write_bytes
    atomic_write_bytes(path, canonical_json({"format": CUTS_FORMAT, "key": path.stem,
                                             "tensors": _cuts_json(cuts.tensors), "blake3": cuts.digest}))


def recorded_digest(path: Path) -> str | None:
    """The blake3 an entry records (what a plan's `cuts` names: gc's reference), or None."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_ENTRY_BYTES))
    except (OSError, ValueError):
        return None
    digest = data.get("blake3") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) else None


def load(path: Path, wanted: Wanted, records: Mapping[str, TensorDelta]) -> ExtraCuts | None:
    """The entry at `path` (None when there is none), checked against the request and the delta
    index (`records`: tensor -> its TensorDelta): exactly the wanted tensors and ranks, cuts that
    fit the tensor (its numel and blocks) and lie between the index's own cuts either side, and
    the recorded blake3. Raises IntegrityError (one line, naming the entry) otherwise."""
    try:
        if path.stat().st_size > MAX_ENTRY_BYTES:
            raise IntegrityError(f"{path}: not a valid exact-cuts cache entry (over {MAX_ENTRY_BYTES} bytes); "
                                 "delete it")
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{path}: unreadable exact-cuts cache entry ({e}); delete it") from None
    # `key`: the entry's own name, so an entry of another expert or request copied here is refused
    if not (isinstance(data, dict) and set(data) == {"format", "key", "tensors", "blake3"}
            and data["format"] == CUTS_FORMAT and data["key"] == path.stem and isinstance(data["tensors"], dict)):
        raise IntegrityError(f"{path}: not an exact-cuts cache entry of this request; delete it")
    if sorted(data["tensors"]) != sorted(wanted):
        raise IntegrityError(f"{path}: exact-cuts cache entry names other tensors than its key's; delete it")
    tensors = {}
    for name in sorted(wanted):
        td = records[name]
        problem = _check_tensor(data["tensors"][name], wanted[name], td.numel, len(td.block_l2))
        if problem is None:
            tensors[name] = tuple(Cut(r, v, gt, eq, None if be is None else tuple(be))
                                  for r, v, gt, eq, be in data["tensors"][name])
            problem = next((p for p in (_between(c, td) for c in tensors[name]) if p), None)
        if problem is not None:
            raise IntegrityError(f"{path}: exact-cuts cache entry, tensor {name!r}: {problem}; delete it")
    if _digest(_cuts_json(tensors)) != data["blake3"]:
        raise IntegrityError(f"{path}: exact cuts do not match their recorded blake3; damaged or edited; delete it")
    return ExtraCuts(tensors, data["blake3"])


def _between(c: Cut, td: TensorDelta) -> str | None:
    """Why cut `c` contradicts the index's cuts of the same tensor at the stored ranks either side
    (None: it fits): |delta| at a rank is non-increasing in the rank, a value equal to a stored
    one has its counts, and one strictly between has above it every element at or above the
    larger stored value and none at or above the smaller one."""
    ranks = td.ranks
    lo = max((j for j, r in enumerate(ranks) if r < c.rank), key=ranks.__getitem__, default=None)
    hi = min((j for j, r in enumerate(ranks) if r > c.rank), key=ranks.__getitem__, default=None)
    value = c.value_bits  # fp32 patterns of |delta|: their integer order is the values' (NaNs above Inf)
    for j, side in ((lo, 1), (hi, -1)):
        if j is None:
            continue
        v, gt, eq = _bits(td.values[j]), td.count_gt[j], td.count_eq[j]
        if v == value and (gt, eq) == (c.count_gt, c.count_eq):
            continue
        fits = value < v and c.count_gt >= gt + eq if side == 1 else value > v and c.count_gt + c.count_eq <= gt
        if not fits:
            return f"the cut at rank {c.rank} contradicts the delta index's cut at rank {ranks[j]}"
    return None


def _count(x: object) -> bool:
    return type(x) is int and x >= 0


def _check_tensor(rows: object, ranks: tuple[int, ...], numel: int, n_blocks: int) -> str | None:
    """Why these cuts cannot be a tensor's at `ranks` (None: they can)."""
    if not isinstance(rows, list) or len(rows) != len(ranks):
        return f"expected {len(ranks)} cuts"
    return next((p for p in (_check_cut(row, rank, numel, n_blocks) for row, rank in zip(rows, ranks)) if p), None)


def _check_cut(row: object, rank: int, numel: int, n_blocks: int) -> str | None:
    """Why `row` is not the cut at `rank` of a tensor of `numel` elements in `n_blocks` blocks:
    [rank, non-negative fp32 |delta| pattern, count above, count equal, per-block counts or null]
    with count_gt < rank <= count_gt + count_eq <= numel, and per-block counts (summing to
    count_eq) exactly where the rank splits the run of equal values."""
    if not isinstance(row, list) or len(row) != 5 or type(row[0]) is not int or row[0] != rank:
        return f"the cut at rank {rank} is not [rank, value, above, equal, blocks]"
    _, value, gt, eq, blocks = row
    if not (_count(value) and value <= 0x7FFFFFFF and _count(gt) and _count(eq) and gt < rank <= gt + eq <= numel):
        return f"rank {rank} of {numel}: value and counts are not an fp32 |delta| pattern with counts above and " \
               "equal that hold this rank"
    split = gt < rank < gt + eq
    counts_ok = blocks is None if not split else (
        isinstance(blocks, list) and len(blocks) == n_blocks and all(map(_count, blocks)) and sum(blocks) == eq)
    return None if counts_ok else (f"rank {rank}: per-block counts must be given exactly where the rank splits a "
                                   f"run of ties, as {n_blocks} non-negative integers summing to {eq}")


class _MergedEq(Mapping):
    """A tensor's split-run counts by rank position after extra cuts are laid in: the index's
    (looked up lazily, at their old positions) and the extra cuts' own."""

    __slots__ = ("_old", "_extra", "_keys")

    def __init__(self, old: Mapping, old_pos: dict[int, int], extra: dict[int, tuple[int, ...]]) -> None:
        self._old = {old_pos[j]: (old, j) for j in old}  # keys only: the counts are cut out when asked
        self._extra = extra
        self._keys = sorted([*self._old, *extra])

    def __getitem__(self, key: int) -> tuple[int, ...]:
        if key in self._extra:
            return self._extra[key]
        old, j = self._old[key]
        return old[j]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def merged(td: TensorDelta, cuts: tuple[Cut, ...]) -> TensorDelta:
    """`td` with `cuts` laid into its ranks (none of them one it holds), all in rank order."""
    have = set(td.ranks)
    if any(c.rank in have for c in cuts):
        raise IntegrityError(f"tensor {td.name!r}: an exact cut off the grid repeats a rank the index holds")
    rows = sorted([*((r, ("old", j)) for j, r in enumerate(td.ranks)), *((c.rank, ("new", c)) for c in cuts)])
    ranks, values, gt, eq, old_pos, extra_eq = [], [], [], [], {}, {}
    for pos, (rank, (kind, src)) in enumerate(rows):
        ranks.append(rank)
        if kind == "old":
            values.append(td.values[src])
            gt.append(td.count_gt[src])
            eq.append(td.count_eq[src])
            old_pos[src] = pos
        else:
            values.append(_value(src.value_bits))
            gt.append(src.count_gt)
            eq.append(src.count_eq)
            if src.block_eq is not None:
                extra_eq[pos] = src.block_eq
    return replace(td, ranks=tuple(ranks), values=tuple(values), count_gt=tuple(gt), count_eq=tuple(eq),
                   block_eq=_MergedEq(td.block_eq, old_pos, extra_eq))


class CutColumns(DeltaColumns):
    """A decoded delta index's columns whose tensors' records also hold an expert's extra cuts
    (`merged`); every column is the index's own, so the bulk checks see the index unchanged."""

    __slots__ = ("extra",)

    @classmethod
    def over(cls, cols: DeltaColumns, extra: dict[str, tuple[Cut, ...]]) -> CutColumns:
        new = cls.__new__(cls)
        for slot in DeltaColumns.__slots__:
            setattr(new, slot, getattr(cols, slot))
        new.__dict__.update(getattr(cols, "__dict__", {}))
        new.extra = extra
        return new

    def entry(self, i: int) -> TensorDelta:
        td = super().entry(i)
        cuts = self.extra.get(td.name)
        return td if cuts is None else merged(td, cuts)


def with_cuts(delta: DeltaIndex, cuts: ExtraCuts) -> DeltaIndex:
    """`delta` whose tensors' records also hold `cuts`."""
    return replace(delta, tensors=CutColumns.over(delta.tensors, cuts.tensors))
