"""One merge's state, and the bytes of each block it writes.

`MergeState` is what stays the same for every block of one merge: the method, its values for
each tensor (`Group`: the plan's top-level parameters and experts, or a `tensor_parameters`
group's, engine/tensor_variants.py), the strategy's scales, a joint method's statistics, the
sketched blocks, and the read-only lookups (base index, delta index, rank cuts). A block's
output is the base's bytes (cast where the output dtype differs), or merged by the method's
compiled kernel (bf16 in, bf16 out) or its torch code (`fn` in fp32, cast).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mergepipe.util.lazy import torch

from mergepipe.checkpoint import safetensors as st
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, OutTensor, SafetensorsWriter, TensorInfo, as_tensor, \
    tensor_bytes
from mergepipe.engine.cuts import CutTable
from mergepipe.engine.hashing import OutputHasher
from mergepipe.engine.packs import Pack, PackRead, slice_digests
from mergepipe.engine.prefetch import Got
from mergepipe.engine.sketched import Represented
from mergepipe.engine.stats import JointStatistics
from mergepipe.engine.tensor_variants import TensorGroups
from mergepipe.errors import MethodError
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.methods import Method
from mergepipe.methods.base import BlockInputs, ExpertBlock, RawBlock, expert_knobs
from mergepipe.methods.slerp import cosine_from_sums


@dataclass(frozen=True, slots=True)
class _Expert:
    """A plan expert as every block of the merge sees it."""

    name: str
    content_hash: str
    weight: float
    knobs: dict[str, float]  # density / gamma (methods.base.expert_knobs)


@dataclass(frozen=True, slots=True)
class Group:
    """The method's values for a group of tensors: typed parameters, experts in canonical
    order (content hash), the compiled kernel (RawBlock -> bytes, or None), and whether the
    method's output differs from the base where no expert is read (Method.rewrites_base:
    then no float block is copied or passed through, every one goes through `fn`)."""

    params: object
    experts: tuple[_Expert, ...]
    kernel: object | None
    rewrites: bool


def method_group(method: Method, parameters: dict, plan_experts: list[dict], *, compiled: bool) -> Group:
    """The Group of `parameters` and plan expert entries (name, content_hash, weight[,
    density, gamma]); without `compiled` no kernel (every block through the torch code)."""
    params = method.params.model_validate(parameters)
    experts = tuple(_Expert(e["name"], e["content_hash"], float(e["weight"]), expert_knobs(params, e))
                    for e in plan_experts)
    kernel = method.compiled(params, plan_experts) if method.compiled is not None and compiled else None
    return Group(params, experts, kernel, method.rewrites_base is not None and bool(method.rewrites_base(params)))


class TorchThreads:
    """torch set to one intra-op thread the first time a block of this merge takes the torch
    path, restored when the merge ends (`restored`). Per-block ops are ~0.5M elements: too
    small for intra-op threads to pay, and with reader threads (or other processes) on the
    cores, OpenMP's spinning threads slowed the merge 3-5x (BENCHMARKS.md). One thread also
    makes any reduction's order independent of the machine's core count. Merges whose blocks
    all take the compiled kernels (or are copied) never import torch."""

    def __init__(self) -> None:
        self.before: int | None = None  # torch's thread count before the merge set it

    def one(self) -> None:
        if self.before is None:
            import torch as real_torch
            self.before = real_torch.get_num_threads()
            real_torch.set_num_threads(1)

    @contextmanager
    def restored(self) -> Iterator[None]:
        try:
            yield
        finally:
            if self.before is not None:
                torch.set_num_threads(self.before)


@dataclass(frozen=True, slots=True)
class MergeState:
    """What stays the same for every block of one merge."""

    method: Method
    seed: int
    groups: TensorGroups  # tensor -> its Group
    # tensor -> expert -> factor on its read delta (plan `strategy.scales`, only != 1);
    # a tensor listed here always takes the torch path (the kernels have no scale)
    scales: dict[str, dict[str, float]]
    joint: JointStatistics | None  # a joint method's per-tensor statistics (engine/stats.py)
    # blocks read as sketches (plan `strategy.sketch`; engine/sketched.py): bf16 task
    # arithmetic and TIES merge them in C, other methods on the torch path
    sketched: Represented
    base_index: ModelIndex
    deltas: dict[str, DeltaIndex]  # expert -> its delta index (a cosine method's sums)
    cuts: CutTable
    torch: TorchThreads


def merge_unit(m: MergeState, t: TensorInfo, out_t: OutTensor, unit: list[int], base_buf: memoryview,
               got: Got, writer: SafetensorsWriter, hasher: OutputHasher) -> None:
    """Merge, write and hash the blocks of one unit (rows read together)."""
    ranges = m.base_index.tensors[t.name].ranges
    row_bytes = t.row_bytes()
    pos = 0
    for b in unit:
        r0, r1 = ranges[b]
        n = (r1 - r0) * row_bytes
        out = block_bytes(m, t, out_t, b, r0, r1, base_buf[pos:pos + n], got)
        pos += n
        writer.write_rows(t.name, r0, out)
        hasher.add(t.name, out)


def block_bytes(m: MergeState, t: TensorInfo, out_t: OutTensor, b: int, r0: int, r1: int, raw: memoryview,
                got: Got) -> memoryview:
    """The output bytes of block b (rows r0:r1, base bytes `raw`): the base's, cast, or merged
    by the method's kernel or its torch code."""
    shape = (r1 - r0, *t.shape[1:]) if t.shape else ()
    g = m.groups.of(t.name)
    sketched = m.sketched.of(t.name)
    if t.dtype not in FLOAT_DTYPES or (not g.rewrites and not any(b in got.get(e.name, {}) for e in g.experts)
                                       and not m.sketched.touches(t.name, b)):
        # nothing to merge here: the base rows, cast if the output dtype differs
        return raw if out_t.dtype == t.dtype else _cast(m, raw, t.dtype, shape, out_t.dtype, t.name)
    if g.kernel is not None and t.dtype == "BF16" and out_t.dtype == "BF16" and t.name not in m.scales:
        if not sketched:
            return g.kernel(_raw_block(m, g, t, b, raw, got))
        if getattr(g.kernel, "sketches", False):  # task arithmetic's C loop reads the codes itself
            return g.kernel(_raw_block(m, g, t, b, raw, got, sketches=True))
    return _merge_block(m, g, t, out_t, b, r0, r1, shape, raw, got)


def merge_pack(m: MergeState, pack: Pack, result: PackRead, out_tensor, writer: SafetensorsWriter,
               hasher: OutputHasher) -> None:
    """Merge, write and hash a MERGE pack (engine/packs.py; `out_tensor`: name -> its
    OutTensor). Each tensor of a pack is one whole block, of the plan's top-level group."""
    if _elementwise(m, pack, result):
        # one kernel call for the pack: its tensors are adjacent in every buffer, and an
        # elementwise kernel's output element depends only on the same element of its inputs
        g = m.groups.top
        present = tuple((e.name, result.whole[e.name]) for e in g.experts if e.name in result.whole)
        first = pack.first
        out = g.kernel(RawBlock(first.name, first.numel, result.base, present, _no_cut))
    else:
        buf = bytearray(len(result.base))
        for name in pack.names:
            t = pack.table[name]
            a, z = t.begin - pack.begin, t.end - pack.begin
            got = {e: {0: views[name]} for e, views in result.got.items() if name in views}
            r1 = m.base_index.tensors[name].ranges[0][1]
            buf[a:z] = block_bytes(m, t, out_tensor(name), 0, 0, r1, result.base[a:z], got)
        out = memoryview(buf)
    writer.write_rows(pack.names[0], 0, out)
    hasher.add_whole(pack.names, slice_digests(out, *pack.offsets()), digests=True)
    m.cuts.drop_all(pack.names)


def _elementwise(m: MergeState, pack: Pack, result: PackRead) -> bool:
    """Whether a MERGE pack can be merged by one call of the method's kernel: the kernel is
    elementwise, every tensor bf16 with no strategy scale, and each expert read either for
    every tensor of the pack (one buffer) or for none."""
    kernel = m.groups.top.kernel
    if kernel is None or not getattr(kernel, "elementwise", False) or result.got.keys() != result.whole.keys():
        return False
    return set(pack.dtypes()) == {"BF16"} and not any(map(m.scales.__contains__, pack.names)) \
        and not any(map(m.sketched.by_tensor.__contains__, pack.names))


def _no_cut(expert: str, rank: int):
    raise MethodError(f"expert {expert!r}: a rank cut was asked of an elementwise kernel merging a pack")


def _raw_block(m: MergeState, g: Group, t: TensorInfo, b: int, raw: memoryview, got: Got, *,
               sketches: bool = False) -> RawBlock:
    n = len(raw) // t.itemsize
    entries = m.sketched.kernel_entries(t.name, b, n, g.experts, got) if sketches else ()

    def cut(expert: str, rank: int):
        return m.cuts.get(expert, t.name).for_block(b, n)(rank)

    present = tuple((e.name, got[e.name][b]) for e in g.experts if b in got.get(e.name, {}))
    return RawBlock(t.name, t.numel, raw, present, cut, entries)


def _merge_block(m: MergeState, g: Group, t: TensorInfo, out_t: OutTensor, b: int, r0: int, r1: int,
                 shape: tuple[int, ...], raw: memoryview, got: Got) -> memoryview:
    """One block through the method's torch code: fp32 deltas, `fn`, cast to the output dtype."""
    m.torch.one()
    base_block = as_tensor(raw, t.dtype, shape).float()
    blocks = tuple(_expert_block(m, e, t, b, shape, base_block, got) for e in g.experts)
    joint = m.joint.tensors.get(t.name) if m.joint is not None else None
    merged = m.method.fn(BlockInputs(t.name, r0, r1, t.shape, base_block, blocks, m.seed, joint=joint), g.params)
    return tensor_bytes(_to_output(merged, t.name, out_t.dtype))


def _expert_block(m: MergeState, e: _Expert, t: TensorInfo, b: int, shape: tuple[int, ...], base_block,
                  got: Got) -> ExpertBlock:
    """Expert e's input to `fn` for block b: its fp32 delta (read, or a sketch's alpha * code;
    None where neither), rank cut, cosine and strategy scale."""
    buf = got.get(e.name, {}).get(b)
    delta, sketched = None, False
    if buf is not None:
        delta = as_tensor(buf, t.dtype, shape).float() - base_block
    elif (rep := m.sketched.delta(e.name, t.name, b, base_block.numel())) is not None:  # alpha * code
        delta, sketched = torch.from_numpy(rep).reshape(shape), True
    cut = m.cuts.get(e.name, t.name).for_block(b, base_block.numel()) if m.method.magnitude else None
    cosine = None
    if m.method.cosine:
        td = m.deltas[e.name].tensors[t.name]
        cosine = cosine_from_sums(td.base_sq, td.expert_sq, td.dot)
    scale = m.scales.get(t.name, {}).get(e.name, 1.0)
    return ExpertBlock(e.name, e.content_hash, e.weight, delta, **e.knobs, cut=cut, cosine=cosine, scale=scale,
                       sketched=sketched)


def _cast(m: MergeState, raw: memoryview, dtype: str, shape: tuple[int, ...], out_dtype: str,
          name: str) -> memoryview:
    """Base rows cast to the output dtype (the torch path)."""
    m.torch.one()
    return tensor_bytes(_to_output(as_tensor(raw, dtype, shape), name, out_dtype))


def _to_output(x, name: str, out_dtype: str):
    """`x` cast to the output dtype. float16's range is float32's and bfloat16's up to 65504
    only: a finite value past it would be published as inf (verify checks bytes, not values)."""
    y = x.to(st.DTYPES[out_dtype][1])
    if out_dtype == "F16" and bool((torch.isinf(y) & torch.isfinite(x)).any()):
        raise MethodError(f"tensor {name!r}: values past float16's range (65504) would be published as inf; "
                          "set output.dtype to bfloat16 or float32, or scale the weights or parameters down")
    return y
