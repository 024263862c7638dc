"""The whole-tensor Gram statistic shared by model_stock, karcher and multislerp.

One pass: per block, `gram_rows` of the block flattened to one row (fixed-order fp64
sums, methods/_joint_kernels.py), added over blocks in block order. The result is one
row: <W0,W0>, <W0,d_i> for each expert, <d_i,d_j> for i <= j (experts in canonical
order; d_i the fp32 delta). Everything these methods need (norms, cosines, the Gram
matrix of the experts' weights W_i = W0 + d_i) follows from it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from mergepipe.util.lazy import torch

from mergepipe.checkpoint.blocks import num_rows
from mergepipe.errors import MethodError
from mergepipe.methods._common import canonical
from mergepipe.methods._joint_kernels import gram_rows, gram_size, unpack_gram
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.joint import (JointBlock, JointExpert, JointPass, JointSpec, TensorContext, as_rows,
                                     in_memory_statistics)


def _accumulate(block: JointBlock, prev: np.ndarray | None) -> np.ndarray:
    k = block.deltas.shape[0]
    return gram_rows(block.base.reshape(1, -1), block.deltas.reshape(k, 1, -1))[0]


def gram_spec(active=lambda params: True) -> JointSpec:
    """The spec to pass as `@register(..., joint=gram_spec())`; `active(params)` False skips the scan."""
    return JointSpec(passes=(JointPass(lambda ctx: gram_size(ctx.k), _accumulate, lambda acc, prev, ctx: acc),),
                     result_size=lambda ctx: gram_size(ctx.k), active=active)


def canonical_block(block: BlockInputs) -> BlockInputs:
    """The block with its experts in canonical order (content hash, name): the order of the
    joint statistics. The engine already passes them so; a caller need not."""
    ordered = tuple(canonical(block.experts))
    same = all(a is b for a, b in zip(ordered, block.experts))
    return block if same else replace(block, experts=ordered)


def tensor_gram(block: BlockInputs, params) -> tuple[float, np.ndarray, np.ndarray]:
    """(<W0,W0>, <W0,d_i>, <d_i,d_j>) of the whole tensor: the engine's joint statistics, or,
    when the block is the whole tensor and none were given, computed here the same way."""
    k = len(block.experts)
    stats = block.joint
    if stats is None:
        if not (block.row_start == 0 and block.row_end == num_rows(block.tensor_shape)):
            raise MethodError(f"tensor {block.tensor!r}: rows {block.row_start}:{block.row_end} need the "
                              "whole tensor's joint statistics (BlockInputs.joint); the engine's joint scan "
                              "provides them")
        base = block.base.numpy()
        deltas = [np.zeros_like(base) if e.delta is None else e.delta.numpy() for e in block.experts]
        ctx = TensorContext(block.tensor, tuple(block.tensor_shape),
                            tuple(JointExpert(e.name, e.content_hash, e.weight) for e in block.experts), params)
        stats = in_memory_statistics(gram_spec(), ctx, base, deltas, [(block.row_start, block.row_end)])
    stats = np.asarray(stats, dtype=np.float64)
    if stats.size != gram_size(k):
        raise MethodError(f"tensor {block.tensor!r}: joint statistics have {stats.size} entries, expected "
                          f"{gram_size(k)} for {k} experts")
    return unpack_gram(stats, k)


def block_rows(block: BlockInputs) -> tuple[np.ndarray, np.ndarray]:
    """The block's base (rows, n) and deltas (k, rows, n) as fp32 numpy (unread: zeros)."""
    shape = tuple(block.tensor_shape)
    base = as_rows(block.base.numpy(), shape)
    deltas = np.stack([np.zeros_like(base) if e.delta is None else as_rows(e.delta.numpy(), shape)
                       for e in block.experts]) if block.experts else np.zeros((0,) + base.shape, np.float32)
    return base, deltas


def weighted_sum(block: BlockInputs, base_coef: float, coefs: list[float]) -> torch.Tensor:
    """base_coef * W0 + sum_i coefs[i] * d_i in fp32, one operation at a time, experts in
    canonical order (unread deltas skipped: they are zero)."""
    out = block.base * torch.tensor(base_coef, dtype=torch.float32)
    for e, c in zip(block.experts, coefs):
        if e.delta is not None:
            out = out + e.delta * torch.tensor(c, dtype=torch.float32)
    return out


# Small fixed-order linear algebra for the coefficient iterations (karcher, multislerp):
# numpy's `@` goes through BLAS, whose summation order depends on the CPU.

def matvec(g: np.ndarray, c: np.ndarray) -> np.ndarray:
    """g @ c, each entry summed left to right in fp64."""
    n = len(c)
    out = np.zeros(n)
    for i in range(n):
        s = 0.0
        for j in range(n):
            s += float(g[i, j]) * float(c[j])
        out[i] = s
    return out


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """a . b summed left to right in fp64."""
    s = 0.0
    for x, y in zip(a, b):
        s += float(x) * float(y)
    return s


def quad(c: np.ndarray, g: np.ndarray) -> float:
    """c^T g c in a fixed order."""
    return dot(c, matvec(g, c))
