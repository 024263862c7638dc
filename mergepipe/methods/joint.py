"""Joint statistics: how a method that couples the experts over a whole tensor declares
what it needs, and the one function that computes it.

A method sees one block at a time (methods/base.py). Some need facts about the whole
tensor that involve every expert at once: model_stock the cosines between deltas,
karcher and multislerp the Gram matrix of their inputs, sce a per-element variance
across experts and a top-k over it. Such a method passes `joint=JointSpec(...)` to
`@register`; then

- the plan reads each block for all experts or for none (plan/planner.py), so a block
  the method merges always has every expert's delta;
- before the merge, one joint scan reads every block of the base and of every expert
  (engine/stats.py) and runs the spec's passes; the per-tensor results are a
  content-addressed artifact in the store (index/joint.py), keyed by `statistics_key`;
- the method finds its tensor's result in `BlockInputs.joint` (an fp64 numpy array).

Declaring statistics: a `JointSpec` is one or more `JointPass`es. For every float tensor,
pass p starts from a zero fp64 accumulator of `size(ctx)` entries; for every block, in
block order, `accumulate(block, prev)` returns an fp64 array of that size, which is added
to the accumulator (elementwise, so the total's order is fixed); `finalize(acc, prev,
ctx)` turns the total into the pass's result, which the next pass receives as `prev`
(e.g. a histogram in pass 1 finds a top-k cut that pass 2 counts against). The last
pass's result, `result_size(ctx)` entries, is what the method gets.

Determinism: `accumulate` must be a function of the block's bytes, the context (params,
seed, expert knobs) and `prev` only, with every sum in a fixed order: use
methods/_joint_kernels.py (fp64, 8 lanes, pairwise) or exact integer counts, never BLAS
or a torch reduction. Then the artifact is the same bytes on any CPU and thread count.
Experts are in canonical order (content hash) everywhere, so index i of a result means
the i-th expert of `BlockInputs.experts`.

The cache key covers the format version, the method, the base and expert content
hashes, the block size (block sums are added in block order), and only what the spec
names as affecting the statistics: `params` (parameter names), `expert_knobs` (weight,
density, gamma) and `seeded`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from blake3 import blake3
from pydantic import BaseModel

from mergepipe.util.fs import canonical_json

JOINT_FORMAT = 1  # bump when a spec's statistics change meaning: old artifacts are then misses


@dataclass(frozen=True, slots=True)
class JointExpert:
    name: str
    content_hash: str
    weight: float
    density: float | None = None
    gamma: float | None = None


@dataclass(frozen=True, slots=True)
class TensorContext:
    """What every block of one tensor's statistics shares."""

    tensor: str
    shape: tuple[int, ...]
    experts: tuple[JointExpert, ...]  # canonical order (content hash)
    params: BaseModel  # the method's typed parameters
    seed: int = 0

    @property
    def k(self) -> int:
        return len(self.experts)


@dataclass(frozen=True, slots=True)
class JointBlock:
    """One block as a statistics pass sees it: every expert, even where identical to the base."""

    ctx: TensorContext
    row_start: int
    row_end: int
    base: np.ndarray  # fp32, (rows, elements per row); a 0-d or 1-d tensor is one row
    deltas: np.ndarray  # fp32, (k, rows, elements per row); zeros where the block equals the base


@dataclass(frozen=True, slots=True)
class JointPass:
    size: Callable[[TensorContext], int]
    accumulate: Callable[[JointBlock, "np.ndarray | None"], np.ndarray]
    finalize: Callable[[np.ndarray, "np.ndarray | None", TensorContext], np.ndarray]


@dataclass(frozen=True, slots=True)
class JointSpec:
    # the passes, or a function of the typed params giving them (sce needs its top-k passes
    # only when select_topk < 1)
    passes: "tuple[JointPass, ...] | Callable[[BaseModel], tuple[JointPass, ...]]"
    result_size: Callable[[TensorContext], int]
    params: tuple[str, ...] = ()  # parameter names the statistics depend on
    expert_knobs: tuple[str, ...] = ()  # of "weight", "density", "gamma"
    seeded: bool = False  # the statistics depend on the plan's seed
    # False: these parameters need no statistics (the scan is skipped; reads stay all-or-none)
    active: Callable[[BaseModel], bool] = lambda params: True


BlockSource = Callable[[], Iterable[tuple[int, int, np.ndarray, np.ndarray]]]


def run_passes(spec: JointSpec, ctx: TensorContext, blocks: BlockSource) -> np.ndarray:
    """One tensor's statistics: every pass over `blocks()` ((row_start, row_end, base,
    deltas) in block order; called once per pass), accumulated in that order."""
    prev: np.ndarray | None = None
    passes = spec.passes(ctx.params) if callable(spec.passes) else spec.passes
    for p in passes:
        acc = np.zeros(p.size(ctx), dtype=np.float64)
        for r0, r1, base, deltas in blocks():
            part = p.accumulate(JointBlock(ctx, r0, r1, base, deltas), prev)
            if part.shape != acc.shape or part.dtype != np.float64:
                raise ValueError(f"tensor {ctx.tensor!r}: a statistics pass returned {part.dtype}{part.shape}, "
                                 f"declared float64({acc.size},)")
            acc += part
        prev = np.ascontiguousarray(p.finalize(acc, prev, ctx), dtype=np.float64).reshape(-1)
    if prev is None or prev.size != spec.result_size(ctx):
        raise ValueError(f"tensor {ctx.tensor!r}: statistics have {0 if prev is None else prev.size} entries, "
                         f"declared {spec.result_size(ctx)}")
    return prev


def as_rows(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A block's flat fp32 values as (rows, elements per row); 0-d and 1-d tensors are one row."""
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    if len(shape) <= 1:
        return x.reshape(1, -1)
    return x.reshape(-1, per_row)


def in_memory_statistics(spec: JointSpec, ctx: TensorContext, base: np.ndarray, deltas: list[np.ndarray],
                         ranges: list[tuple[int, int]]) -> np.ndarray:
    """`run_passes` over whole fp32 tensors held in memory, cut at `ranges` (row ranges):
    the engine's result for the same block layout (tests, and a method handed a whole tensor)."""
    shape = tuple(base.shape)

    def blocks():
        for r0, r1 in ranges:
            b = base[r0:r1] if base.ndim else base
            ds = np.stack([d[r0:r1] if d.ndim else d for d in deltas]) if deltas else \
                np.zeros((0,) + b.shape, dtype=np.float32)
            yield r0, r1, as_rows(np.ascontiguousarray(b, dtype=np.float32), shape), \
                np.ascontiguousarray(ds, dtype=np.float32).reshape((len(deltas),) + as_rows(b, shape).shape)

    return run_passes(spec, ctx, blocks)


def statistics_key(spec: JointSpec, *, method: str, params: dict[str, Any], base_hash: str,
                   experts: list[dict], seed: int, block_bytes: int | str) -> str:
    """The content address of a family's statistics (blake3 hex): see the module docstring.
    `experts` are plan expert entries (content_hash, weight[, density, gamma]); `block_bytes` is
    the plan's `BlockLayout.key` (the int block size unless vocabulary tensors have their own)."""
    knobs = [{"content_hash": e["content_hash"], **{k: _knob(e, params, k) for k in spec.expert_knobs}}
             for e in sorted(experts, key=lambda e: e["content_hash"])]
    doc = {"format": JOINT_FORMAT, "method": method, "base": base_hash, "experts": knobs,
           "block_bytes": block_bytes, "params": {k: params.get(k) for k in spec.params},
           "seed": seed if spec.seeded else None}
    return blake3(canonical_json(doc)).hexdigest()


def _knob(expert: dict, params: dict, key: str) -> float | None:
    """An expert's own knob, else the method's parameter of that name (as the engine resolves it)."""
    value = expert.get(key)
    return params.get(key) if value is None else value
