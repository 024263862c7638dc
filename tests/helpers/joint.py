"""Running a joint method (methods/joint.py) on whole in-memory tensors, block by block, as
the engine does: the statistics from `in_memory_statistics` over the same block layout,
then the method's `fn` on each block with `BlockInputs.joint`. Tests only."""
from __future__ import annotations

import torch

from mergepipe.methods import get_method
from mergepipe.methods.base import BlockInputs, ExpertBlock
from mergepipe.methods.joint import JointExpert, TensorContext, in_memory_statistics


def split(rows: int, boundaries: list[int]) -> list[tuple[int, int]]:
    edges = [0] + sorted(b for b in set(boundaries) if 0 < b < rows) + [rows]
    return list(zip(edges[:-1], edges[1:]))


def run_joint(method: str, params: dict, base: torch.Tensor, experts: list[dict], *,
              boundaries: list[int] = (), omit: set[int] = frozenset(), tensor: str = "w") -> torch.Tensor:
    """experts: dicts with name, hash, weight, delta (fp32, base's shape). `omit`: row_starts
    of blocks left unread for every expert (a budgeted plan's all-or-none reads)."""
    m = get_method(method)
    p = m.params.model_validate(params)
    shape = tuple(base.shape)
    # the engine's layout: a 0-d or 1-d tensor is one block
    ranges = split(shape[0], list(boundaries)) if len(shape) >= 2 else [(0, shape[0] if shape else 1)]
    experts = sorted(experts, key=lambda e: e["hash"])
    stats = None
    if m.joint is not None and m.joint.active(p):
        ctx = TensorContext(tensor, shape, tuple(JointExpert(e["name"], e["hash"], e["weight"]) for e in experts), p)
        stats = in_memory_statistics(m.joint, ctx, base.numpy(), [e["delta"].numpy() for e in experts], ranges)
    out = []
    for r0, r1 in ranges:
        b = base[r0:r1] if shape else base
        blocks = tuple(ExpertBlock(e["name"], e["hash"], e["weight"],
                                   None if r0 in omit else (e["delta"][r0:r1] if shape else e["delta"]))
                       for e in experts)
        if r0 in omit and not (m.rewrites_base is not None and m.rewrites_base(p)):
            out.append(b.clone())  # the engine copies a block no expert is read for
            continue
        out.append(m.fn(BlockInputs(tensor, r0, r1, shape, b, blocks, joint=stats), p))
    return torch.cat(out) if shape else out[0]
