"""Compiled bf16 kernels of the methods that have one (task_arithmetic, ties), behind
`Method.compiled`: a factory (params, plan experts) -> a callable RawBlock -> bytes.

They run the torch path's fp32 arithmetic in its operation order, fused
(methods/_bf16c.c, loaded by methods/_ckernels.py; methods/_kernels.py in numba where the C
library was not built), so the bytes are the same (tests/test_merge_kernels.py). The
engine uses a method's kernel for bf16 blocks written as bf16 and the method's `fn`
for everything else; it knows no method by name. Neither is loaded before first use.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from mergepipe.errors import MethodError
from mergepipe.index.ranks import magnitude_rank
from mergepipe.methods.base import RawBlock, expert_knobs


class CompiledCombine:
    """Weighted delta sums of bf16 blocks (task arithmetic), with TIES's magnitude trim
    and sign election when `consensus`."""

    def __init__(self, params: BaseModel, experts: list[dict], *, consensus: bool) -> None:
        self.k = kernels()
        self.ties = consensus
        # output element i depends only on element i of the base and experts (no per-tensor
        # cut): the engine may merge a run of small tensors as one block (engine/packs.py)
        self.elementwise = not consensus
        # task arithmetic: out = bf16(B + Σ_k w_k (E_k − B) [/ divisor] [· λ]), experts in the
        # order of `weight`: adapters' experts may be summed from their factors in that order
        # (engine/adapter_sums.py)
        self.delta_sum = not consensus
        self.normalize = bool(params.normalize)
        self.lambda_ = np.float32(params.lambda_)
        self.apply_lambda = params.lambda_ != 1
        self.weight = {e["name"]: np.float32(float(e["weight"])) for e in experts}
        self.density = {e["name"]: expert_knobs(params, e).get("density", 1.0) for e in experts}
        # task arithmetic divides by the sum of every expert's weight, read or not
        # (methods._common.combine), summed left to right in fp32 like the torch path
        # (numpy fp32 scalars: the same IEEE additions, without importing torch)
        divisor = np.float32(0.0)
        for e in experts:
            divisor = np.float32(divisor + np.float32(float(e["weight"])))
        if np.abs(divisor) < np.float32(1e-8):
            divisor = np.float32(1.0)
        self.divisor = divisor
        # sketched experts too, where the C library has the loops (numba has none)
        self.sketches = hasattr(self.k, "ties_sketch_bf16" if consensus else "task_arithmetic_sketch_bf16")

    def __call__(self, block: RawBlock) -> memoryview:
        if block.sketches:
            return self._with_sketches(block)
        present = [name for name, _ in block.experts]
        base = _writable(np.frombuffer(block.base, dtype=np.uint16))
        n = base.shape[0]
        stacked = tuple(_writable(np.frombuffer(buf, dtype=np.uint16)) for _, buf in block.experts)
        weights = np.array([self.weight[name] for name in present], dtype=np.float32)
        out = np.empty(n, dtype=np.uint16)
        if not self.ties:
            self.k.task_arithmetic_bf16(base, stacked, weights, self.divisor, self.normalize, self.lambda_,
                                        self.apply_lambda, out)
            return memoryview(out).cast("B")
        modes, values, limits = self._trims(block, base, list(zip(present, stacked)))
        self.k.ties_bf16(base, stacked, weights, modes, values, limits, self.normalize, self.lambda_,
                         self.apply_lambda, out)
        return memoryview(out).cast("B")

    def _trims(self, block: RawBlock, base: np.ndarray, entries: list) -> tuple[np.ndarray, ...]:
        """TIES's per-expert trim (mode, threshold, limit) for (name, read block or sketch)
        entries in canonical order; a sketch is kept as it is (its zeros are its trim)."""
        modes = np.empty(len(entries), dtype=np.int64)
        values = np.zeros(len(entries), dtype=np.float32)
        limits = np.zeros(len(entries), dtype=np.int64)
        numel, n = block.tensor_numel, base.shape[0]
        for i, (name, entry) in enumerate(entries):
            rank = magnitude_rank(self.density[name], numel)
            if not isinstance(entry, np.ndarray) or rank is None or rank >= numel:
                modes[i] = self.k.KEEP_ALL
            elif rank <= 0:
                modes[i] = self.k.DROP_ALL
            else:
                cut = block.cut(name, rank)
                if cut.rank != rank:
                    raise MethodError(f"tensor {block.tensor!r}, expert {name!r}: asked for the rank cut at {rank} "
                                      f"and got one at {cut.rank}; the delta index is stale, rebuild it")
                modes[i], values[i] = self.k.CUT, cut.value
                # where this block stops keeping threshold-equal elements; scans the block
                # only when the cut splits its run of equal values
                if cut.eq_keep <= 0:
                    limits[i] = 0
                elif cut.eq_all:
                    limits[i] = n
                else:
                    limits[i] = self.k.eq_limit(base, entry, values[i], cut.eq_keep)
        return modes, values, limits

    def _with_sketches(self, block: RawBlock) -> memoryview:
        """Task arithmetic or TIES whose experts are read blocks or sketches, in canonical order."""
        if not self.sketches:
            raise MethodError(f"tensor {block.tensor!r}: this kernel cannot merge sketched experts")
        base = _writable(np.frombuffer(block.base, dtype=np.uint16))
        given = {name: _writable(np.frombuffer(buf, dtype=np.uint16)) for name, buf in block.experts}
        given.update({name: (codes, alpha) for name, codes, alpha in block.sketches})
        order = [name for name in self.weight if name in given]  # the plan's (canonical) order
        out = np.empty(base.shape[0], dtype=np.uint16)
        entries = [given[n] for n in order]
        weights = np.array([self.weight[n] for n in order], dtype=np.float32)
        if not self.ties:
            self.k.task_arithmetic_sketch_bf16(base, entries, weights, self.divisor, self.normalize, self.lambda_,
                                               self.apply_lambda, out)
        else:
            modes, values, limits = self._trims(block, base, list(zip(order, entries)))
            self.k.ties_sketch_bf16(base, entries, weights, modes, values, limits, self.normalize, self.lambda_,
                                    self.apply_lambda, out)
        return memoryview(out).cast("B")


def kernels():
    """The C kernels, or the numba ones where the C library was not built (same bytes)."""
    from mergepipe.methods import _ckernels
    c = _ckernels.load()
    if c is not None:
        return c
    from mergepipe.methods import _kernels  # numba: ~0.7 s to import and load per process
    return _kernels


def task_arithmetic_kernel(params: BaseModel, experts: list[dict]) -> CompiledCombine:
    return CompiledCombine(params, experts, consensus=False)


def ties_kernel(params: BaseModel, experts: list[dict]) -> CompiledCombine:
    return CompiledCombine(params, experts, consensus=True)


def _writable(a: np.ndarray) -> np.ndarray:
    # the kernels take a tuple of one array type; reads are bytearrays, so this never copies
    return a if a.flags.writeable else a.copy()
