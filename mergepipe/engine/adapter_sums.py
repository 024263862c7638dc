"""Task arithmetic over LoRA adapter experts in one pass over the base (docs/design.md, "LoRA
adapters", "One pass").

An adapter's expert (checkpoint/lora.py) reads as the base's bytes with bf16(W + Δ) in its
target tensors; merging K of them as dense experts reads and hashes K + 1 tensors' worth of
bytes per block. Where the merge's compiled kernel is a weighted sum of the experts' deltas
(`delta_sum`: task arithmetic's) and every expert the plan reads in a tensor is an adapter that
leaves it as the base's or adds a LoRA Δ to it, a unit of that tensor is merged on the reader
thread that reads it instead: the base rows are read once and checked against the base index,
and checkpoint/_lorac.c makes each adapter's expert element bf16(W + Δ_k) from the factors and
sums w_k (E_k − W) in the merge's expert order, the kernel's operations on the experts' bytes,
so the output bytes are the same (tests/test_adapter_sums.py). The unit reaches the merging
thread as its output bytes with no expert block, which the engine writes as it writes a unit no
expert reads.

Each adapter's reads are counted as the bytes of the blocks its expert returns (as LoraReader
counts them), so budgets and manifests are those of the merge of the virtual experts. The
adapters' blocks are not hashed against their indexes here: they are a function of the base
rows (checked) and of the adapter's files, hashed into its identity (its index's key) when
opened. Anything else (a dense expert, a whole tensor an adapter replaces, a LoRA bias, a
strategy scale, a sketch, per-tensor parameters, another dtype) keeps the virtual experts' path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mergepipe.checkpoint import _lora_kernel
from mergepipe.checkpoint.lora import AdapterCheckpoint
from mergepipe.checkpoint.safetensors import TensorInfo
from mergepipe.engine.hashing import check_base_unit
from mergepipe.engine.prefetch import Got, UnitReader


@dataclass(frozen=True, slots=True)
class AdapterSums:
    """The tensors whose units are merged from the adapters' factors, each with the compiled
    kernel whose operations it runs (its weights, divisor and λ; its experts' order)."""

    sum_kernel: object  # _lora_kernel.load_sum()
    kernels: dict[str, object]  # tensor -> its kernel (methods/_compiled.CompiledCombine, `delta_sum`)
    adapters: dict[str, AdapterCheckpoint]
    reader: UnitReader

    @classmethod
    def of(cls, reader: UnitReader, out_of, kernel_of: Callable[[str], object | None]) -> AdapterSums | None:
        """For a merge's unit reader, its tensor -> (file, OutTensor) map and `kernel_of(tensor)`:
        the compiled kernel that merges the tensor's bf16 blocks (None where they take the torch
        path: a strategy scale, a sketch, a method that rewrites the base). None where no tensor
        is covered."""
        sum_kernel = _lora_kernel.load_sum()
        adapters = {name: ckpt for name, ckpt in reader.experts.items() if isinstance(ckpt, AdapterCheckpoint)}
        if sum_kernel is None or not adapters:
            return None
        base = reader.base.tensors
        kernels = {}
        for n in sorted({n for a in adapters.values() for n in a.adapter.deltas}):
            t = base.get(n)
            if t is None or t.dtype != "BF16" or out_of[n][1].dtype != "BF16" \
                    or not _all_factors(n, t, reader, adapters):
                continue
            kernel = kernel_of(n)
            if getattr(kernel, "delta_sum", False):
                kernels[n] = kernel
        return cls(sum_kernel, kernels, adapters, reader) if kernels else None

    def covers(self, name: str) -> bool:
        return name in self.kernels

    def load(self, name: str, unit: list[int]) -> tuple[memoryview, Got]:
        """The unit's output bytes, merged here, and no expert blocks (see the module docstring)."""
        import numpy as np
        r = self.reader
        t = r.base.tensors[name]
        entry = r.base_index.tensors[name]
        ranges = entry.ranges
        base_buf = memoryview(r.base_reader.read_rows(name, ranges[unit[0]][0], ranges[unit[-1]][1]))
        check_base_unit(base_buf, t, ranges, unit, entry.hashes, str(r.base.root))
        base = np.frombuffer(base_buf, dtype=np.uint16)
        out = np.empty_like(base)
        kernel = self.kernels[name]
        cols, row0 = t.numel // t.shape[0], ranges[unit[0]][0]
        for present, (a, z) in self._runs(name, list(kernel.weight), unit, ranges, t):
            lo, hi = (a - row0) * cols, (z - row0) * cols
            if not present:  # planned for no expert: the base's bytes
                out[lo:hi] = base[lo:hi]
                continue
            terms = [self._term(e, name, a, z) for e in present]
            weights = [float(kernel.weight[e]) for e in present]
            self.sum_kernel(base[lo:hi], z - a, cols, terms, weights, float(kernel.divisor), kernel.normalize,
                            float(kernel.lambda_), kernel.apply_lambda, out[lo:hi])
        return memoryview(out).cast("B"), {}

    def _runs(self, name: str, experts: list[str], unit: list[int], ranges, t: TensorInfo):
        """(the `experts` planned, in their order; (row begin, row end)) for runs of the unit's
        blocks that the same experts read; each expert's read bytes counted."""
        runs: list[tuple[tuple[str, ...], tuple[int, int]]] = []
        row_bytes = t.row_bytes()
        for b in unit:
            present = tuple(e for e in experts if b in self.reader.reads[e].get(name, ()))
            for e in present:
                self.reader.counters[e].add(t.file, (ranges[b][1] - ranges[b][0]) * row_bytes)
            if runs and runs[-1][0] == present:
                runs[-1] = (present, (runs[-1][1][0], ranges[b][1]))
            else:
                runs.append((present, ranges[b]))
        return runs

    def _term(self, expert: str, name: str, r0: int, r1: int):
        """(left rows, right, scale) of the adapter's Δ of tensor `name`, rows r0:r1, as
        Delta.rows takes them (contiguous fp32); None where it leaves the tensor as the base's."""
        delta = self.adapters[expert].adapter.deltas.get(name)
        if delta is None:
            return None
        return delta.left[r0:r1].float().contiguous(), delta.right32, delta.scale


def summed_kernel(state, name: str) -> object | None:
    """The compiled kernel that merges tensor `name`'s bf16 blocks in merge state `state`
    (engine/blocks.MergeState), or None where they take the torch path (a strategy scale, a
    sketch, a method that rewrites the base's blocks): `AdapterSums.of`'s kernel_of."""
    g = state.groups.of(name)
    if g.rewrites or name in state.scales or state.sketched.of(name) is not None:
        return None
    return g.kernel


def _all_factors(name: str, t: TensorInfo, reader: UnitReader, adapters: dict[str, AdapterCheckpoint]) -> bool:
    """Whether every expert the plan reads in tensor `name` is an adapter of this base tensor
    (same file bytes) that adds a LoRA Δ to it (not a vector, no whole tensor) or leaves it."""
    for expert, reads in reader.reads.items():
        if not reads.get(name):
            continue
        ckpt = adapters.get(expert)
        if ckpt is None or name in ckpt.adapter.replaced:
            return False
        own = ckpt.base.tensors.get(name)
        if own is None or (own.file, own.begin, own.end) != (t.file, t.begin, t.end):
            return False
        delta = ckpt.adapter.deltas.get(name)
        if delta is not None and delta.vector is not None:
            return False
    return True
