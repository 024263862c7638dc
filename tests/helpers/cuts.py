"""Reference rank cuts for tests: what the index answers, computed on the full tensor.

`cuts_for(delta)(row_start, row_end)` returns the `cut(rank)` callable an
ExpertBlock carries for that block, so methods can be run blockwise without an
index. Ranks follow RankCut's order (|delta| descending, flat index ascending).
Uses kthvalue and counting on the whole tensor: tests only.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mergepipe.checkpoint.blocks import row_numel
from mergepipe.methods.base import RankCut

CutFn = Callable[[int], RankCut]


def cuts_for(delta: torch.Tensor) -> Callable[[int, int], CutFn]:
    """Per-block cut functions for one expert's whole fp32 delta tensor."""
    magnitudes = delta.detach().to(torch.float32).abs().reshape(-1)
    n = magnitudes.numel()
    per_row = row_numel(tuple(delta.shape))
    cache: dict[int, tuple[float, int]] = {}

    def threshold(rank: int) -> tuple[float, int]:
        """(value at `rank`, how many elements equal to it the whole top-`rank` set keeps)."""
        if rank not in cache:
            value = torch.kthvalue(magnitudes, n - rank + 1).values.item()
            above = int((magnitudes > value).sum())
            cache[rank] = (value, rank - above)
        return cache[rank]

    def for_block(row_start: int, row_end: int) -> CutFn:
        begin = row_start * per_row

        def cut(rank: int) -> RankCut:
            if not 0 <= rank <= n:
                raise ValueError(f"rank {rank} outside [0, {n}]")
            if rank == 0:
                return RankCut(0, math.inf, 0)
            value, need_equal = threshold(rank)
            equal_before = int((magnitudes[:begin] == value).sum())
            return RankCut(rank, value, max(0, need_equal - equal_before))

        return cut

    return for_block


def top_rank_reference(delta: torch.Tensor, rank: int) -> torch.Tensor:
    """Bool mask of the exact top-`rank` set of the whole tensor (stable sort)."""
    magnitudes = delta.to(torch.float32).abs().reshape(-1)
    order = torch.sort(-magnitudes, stable=True).indices  # desc |delta|, then flat index asc
    mask = torch.zeros(magnitudes.numel(), dtype=torch.bool)
    mask[order[:rank]] = True
    return mask.reshape(delta.shape)


# --- running a method blockwise, as the engine would --------------------------------

def split_rows(rows: int, boundaries: list[int] | None) -> list[tuple[int, int]]:
    """[(row_start, row_end)] from inner boundaries (None: one block)."""
    edges = [0] + sorted(b for b in set(boundaries or []) if 0 < b < rows) + [rows]
    return list(zip(edges[:-1], edges[1:]))


def run_method(method: str, params: dict, base: torch.Tensor, experts: list[dict], *,
               boundaries: list[int] | None = None, seed: int = 0, tensor: str = "model.w",
               omit: set[tuple[str, int]] = frozenset(), cosine: bool | None = None,
               joint=None) -> torch.Tensor:
    """Merge one whole tensor block by block, as the engine does at full budget.

    experts: dicts with name, hash, weight, delta (full fp32 tensor or None) and
    optional density / gamma. omit: (expert name, row_start) pairs whose block is
    left unread (delta None). cosine: give slerp the whole-tensor cosine (default:
    only when there are several blocks). joint: the tensor's joint statistics, handed to
    every block (BlockInputs.joint); by default, for a method that declares them, computed
    as the engine's joint scan does (every block of every expert, omitted or not).
    """
    from mergepipe.methods import get_method
    from mergepipe.methods.base import BlockInputs, ExpertBlock
    from mergepipe.methods.slerp import whole_tensor_cosine

    m = get_method(method)
    p = m.params.model_validate(params)
    shape = tuple(base.shape)
    rows = shape[0] if shape else 1
    ranges = split_rows(rows, boundaries) if shape else [(0, 1)]
    if cosine is None:
        cosine = len(ranges) > 1
    prepared = []
    for e in experts:
        full = e.get("delta")
        prepared.append((e, full, None if full is None else cuts_for(full),
                         whole_tensor_cosine(base, base if full is None else base + full) if cosine else None))
    if joint is None and m.joint is not None and m.joint.active(p):
        joint = _joint_statistics(m, p, tensor, base, experts, ranges, seed)
    outputs = []
    for r0, r1 in ranges:
        base_block = base[r0:r1] if shape else base
        blocks = []
        for e, full, cuts, cos in prepared:
            delta = None
            if full is not None and (e["name"], r0) not in omit:
                delta = full[r0:r1] if shape else full
            blocks.append(ExpertBlock(name=e["name"], content_hash=e["hash"], weight=e["weight"],
                                      delta=delta, density=e.get("density", 1.0),
                                      gamma=e.get("gamma", 0.01),
                                      cut=None if cuts is None else cuts(r0, r1), cosine=cos))
        block = BlockInputs(tensor=tensor, row_start=r0, row_end=r1, tensor_shape=shape,
                            base=base_block, experts=tuple(blocks), seed=seed, joint=joint)
        outputs.append(m.fn(block, p))
    return torch.cat(outputs) if shape else outputs[0]


def _joint_statistics(m, p, tensor: str, base: torch.Tensor, experts: list[dict], ranges, seed: int):
    """The engine's joint scan on whole tensors held in memory (methods/joint.py), experts in
    canonical order as the engine passes them."""
    from mergepipe.methods.joint import JointExpert, TensorContext, in_memory_statistics

    ordered = sorted(experts, key=lambda e: (e["hash"], e["name"]))
    ctx = TensorContext(tensor, tuple(base.shape),
                        tuple(JointExpert(e["name"], e["hash"], e["weight"], e.get("density"), e.get("gamma"))
                              for e in ordered), p, seed)
    deltas = [(torch.zeros_like(base) if e.get("delta") is None else e["delta"]).numpy() for e in ordered]
    return in_memory_statistics(m.joint, ctx, base.numpy(), deltas, list(ranges))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in fp32 ulps (units in the last place), as int64."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()
