"""Which ranks of |delta| the magnitude methods can ask a tensor for (mergekit 0.1.5's
integer conventions), so the index stores an exact cut at each. Pure; no torch."""
from __future__ import annotations

import functools
import math


def magnitude_rank(density: float, n: int) -> int | None:
    """How many of the n largest |delta| TIES keeps; None means "no pruning".

    As mergekit 0.1.5 `sparsify.magnitude`: density >= 1 keeps the tensor as is;
    density <= 0 or an empty tensor keeps nothing; otherwise
    k = max(1, int(density * n)), so a positive density that rounds to k == 0
    still keeps the single largest element.
    """
    if density >= 1:
        return None
    if density <= 0 or n == 0:
        return 0
    return max(1, int(density * n))


def breadcrumbs_ranks(density: float, gamma: float, n: int) -> tuple[int, int] | None:
    """(r_hi, r_lo): Breadcrumbs keeps descending ranks [r_hi, r_lo); None = no pruning.

    As mergekit 0.1.5 `sparsify.magnitude_outliers`: density >= 1 returns the
    tensor unchanged (gamma is then ignored too); else with target = int(density*n),
    n_top = int(gamma*n), n_bot = max(0, n - target - n_top) it keeps ascending
    positions [n_bot, n_bot + target), i.e. descending ranks
    [n - n_bot - target, n - n_bot). Normally that drops the n_top largest and keeps
    the next `target`; when target + n_top > n fewer outliers are dropped so that
    exactly `target` remain. density <= 0 keeps nothing (no max(1, .) here).
    """
    if density >= 1:
        return None
    target = int(density * n) if density > 0 else 0
    n_top = int(gamma * n) if gamma > 0 else 0
    n_bot = max(0, n - target - n_top)
    return n - n_bot - target, n - n_bot


def trim_ranks(density: float, gamma: float, n: int) -> tuple[int, ...]:
    """The ranks a TIES trim of a tensor of n elements asks cuts at (0 < r < n; ranks 0 and n
    need none): k of `magnitude_rank`. `gamma` is unused (one signature for every trim)."""
    k = magnitude_rank(density, n)
    return () if k is None or not 0 < k < n else (k,)


def band_ranks(density: float, gamma: float, n: int) -> tuple[int, ...]:
    """The ranks a Breadcrumbs band of a tensor of n elements asks cuts at (0 < r < n): both
    ends of `breadcrumbs_ranks`, ascending."""
    ends = breadcrumbs_ranks(density, gamma, n)
    return () if ends is None else tuple(sorted({r for r in ends if 0 < r < n}))


GRID = tuple(i / 100 for i in range(101))  # i/100 is the same float as the literal
GRID_TEXT = "at most two decimals (0.01 steps)"


def on_grid(value: float) -> bool:
    """Whether a density or gamma is one the index holds exact cuts for (a value of GRID)."""
    return abs(value * 100 - round(value * 100)) < 1e-9


def grid_neighbours(value: float) -> str:
    """The grid values either side of `value` ("0.12 or 0.13"), for an error message."""
    low = math.floor(value * 100 + 1e-9) / 100
    return f"{low:.2f} or {low + 0.01:.2f}" if low + 0.01 <= 1 else f"{low:.2f}"


@functools.lru_cache(maxsize=4096)  # pure; many tensors share a size
def requested_ranks(n: int) -> tuple[int, ...]:
    """Every rank 0 < r < n that TIES or Breadcrumbs can ask a tensor of n elements
    for, with densities and gammas of at most two decimals.

    The index must store a cut at each of these. Not just int(p*n) and
    int(p*n) - 1: int(gamma*n) + int(density*n) can be int(p*n) + 1 or - 2 for
    p = gamma + density (each float product may round down an exact integer), and
    gamma + density > 1 asks for n - int(density*n).
    """
    floors = [int(p * n) for p in GRID]
    ranks = set()
    for i, density in enumerate(GRID):
        k = magnitude_rank(density, n)
        if k is not None:
            ranks.add(k)
            for gamma_floor in floors:
                n_bot = max(0, n - floors[i] - gamma_floor)
                ranks.update((n - n_bot - floors[i], n - n_bot))
    return tuple(sorted(r for r in ranks if 0 < r < n))
