"""Rank-cut lookup: where the `rank` largest |delta| of a whole tensor end, seen from one
block, answered from the delta index (exact thresholds, per-block counts of equal values)
so that a budgeted merge never rereads a tensor to find its magnitude thresholds."""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from mergepipe.errors import MethodError
from mergepipe.index.records import DeltaIndex, TensorDelta
from mergepipe.methods.base import RankCut


class TensorCuts:
    """RankCut lookups for one (expert, tensor), from the delta index."""

    def __init__(self, td: TensorDelta, expert: str) -> None:
        self.td, self.expert = td, expert
        self.prefix: dict[int, list[int]] = {}

    def position(self, rank: int) -> int | None:
        """Where `rank` is in the index's ranks, or None: a binary search (index/ranks.py
        stores them ascending), not a map of the hundreds of ranks a tensor holds; a linear
        search where the index's ranks are in another order."""
        ranks = self.td.ranks
        j = bisect_left(ranks, rank)
        if j < len(ranks) and ranks[j] == rank:
            return j
        return ranks.index(rank) if rank in ranks else None

    def for_block(self, i: int, block_numel: int) -> Callable[[int], RankCut]:
        """rank -> RankCut for block `i` (of `block_numel` elements)."""
        def cut(rank: int) -> RankCut:
            if rank <= 0:
                return RankCut(0, float("inf"), 0)
            if rank >= self.td.numel:  # everything: every |delta| > -inf
                return RankCut(rank, float("-inf"), 0)
            j = self.position(rank)
            if j is None:
                raise MethodError(f"expert {self.expert!r}, tensor {self.td.name!r}: no exact threshold for rank "
                                  f"{rank} of {self.td.numel} in its index or the plan's exact cuts (plan key cuts); "
                                  "plan it again")
            keep_eq = rank - self.td.count_gt[j]
            if j in self.td.block_eq:  # the cut splits a run of equal values across blocks
                if j not in self.prefix:
                    acc, pre = 0, []
                    for c in self.td.block_eq[j]:
                        pre.append(acc)
                        acc += c
                    self.prefix[j] = pre
                eq_keep = max(0, min(keep_eq - self.prefix[j][i], self.td.block_eq[j][i]))
                eq_all = eq_keep >= self.td.block_eq[j][i]
            else:
                eq_keep = block_numel if keep_eq >= self.td.count_eq[j] and keep_eq > 0 else 0
                eq_all = True
            return RankCut(rank, self.td.values[j], eq_keep, eq_all)
        return cut


class CutTable:
    """TensorCuts per (expert, tensor), built on first use, dropped when the tensor is done."""

    def __init__(self, deltas: dict[str, DeltaIndex]) -> None:
        self.deltas = deltas
        self._cuts: dict[tuple[str, str], TensorCuts] = {}

    def get(self, expert: str, tensor: str) -> TensorCuts:
        key = (expert, tensor)
        if key not in self._cuts:
            self._cuts[key] = TensorCuts(self.deltas[expert].tensors[tensor], expert)
        return self._cuts[key]

    def drop(self, tensor: str) -> None:
        for key in [k for k in self._cuts if k[1] == tensor]:
            del self._cuts[key]

    def drop_all(self, tensors) -> None:
        """`drop` each of `tensors` (a pack's: usually none was cut)."""
        if self._cuts:
            for t in tensors:
                self.drop(t)
