"""Model Stock (Jang et al., 2024, arXiv:2403.19522), as mergekit 0.1.5 `model_stock`.

With k >= 2 experts W_i = W0 + d_i, cos = the mean over pairs i < j of
clamp(<d_i,d_j> / max(|d_i| |d_j|, 1e-6), -1, 1), t = k cos / (1 + (k-1) cos), and

    theta = t * (sum_i W_i / k) + (1 - t) * W0.

Where the denominator 1 + (k-1) cos is below 1e-6 in magnitude (opposing updates)
t = 0: the base is kept, as mergekit does. Without `filter_wise` the cosines are over
the whole tensor (flattened): the joint statistics' Gram matrix (methods/_gram.py), so
each block is read for all experts or none. With `filter_wise` there is one t per vector
along the last axis (a row of a matrix; a 1-d tensor is one vector), computed from the
block alone (blocks are whole rows), so no joint scan is made.

Arithmetic: the sums are fp64 in a fixed order (not mergekit's fp32 torch reductions),
t is rounded to fp32, then mergekit's fp32 operations follow; the average sums the
experts in canonical (content-hash) order, mergekit in config order. An unread block
(budget) or one no expert changes is the base.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from mergepipe.util.lazy import torch

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG
from mergepipe.methods._gram import block_rows, canonical_block, gram_spec, tensor_gram
from mergepipe.methods._joint_kernels import gram_rows, pair_index
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register

SINGULAR = 1e-6  # |1 + (k-1) cos| below this keeps the base (mergekit 0.1.5)
NORM_FLOOR = 1e-6  # |d_i| |d_j| is clamped to at least this


class ModelStockParams(BaseModel):
    model_config = PARAMS_CONFIG
    filter_wise: bool = False


def interpolation_ratio(dd: np.ndarray) -> np.ndarray:
    """t per vector from <d_i,d_j> matrices (..., k, k), fp64: mergekit's formula."""
    k = dd.shape[-1]
    norms = np.sqrt(np.maximum(np.diagonal(dd, axis1=-2, axis2=-1), 0.0))
    total = np.zeros(dd.shape[:-2], dtype=np.float64)
    for i in range(k):
        for j in range(i + 1, k):
            cos = dd[..., i, j] / np.maximum(norms[..., i] * norms[..., j], NORM_FLOOR)
            total = total + np.clip(cos, -1.0, 1.0)
    cos_theta = total / (k * (k - 1) // 2)
    denominator = 1.0 + (k - 1) * cos_theta
    singular = np.abs(denominator) < SINGULAR
    return np.where(singular, 0.0, k * cos_theta / np.where(singular, 1.0, denominator))


def _row_gram(block: BlockInputs) -> np.ndarray:
    """<d_i,d_j> per vector along the last axis of the block: (vectors, k, k)."""
    base, deltas = block_rows(block)
    last = block.tensor_shape[-1] if len(block.tensor_shape) >= 2 else base.size
    k = deltas.shape[0]
    grams = gram_rows(base.reshape(-1, last), deltas.reshape(k, -1, last))
    dd = np.empty((grams.shape[0], k, k), dtype=np.float64)
    for i in range(k):
        for j in range(i, k):
            dd[:, i, j] = dd[:, j, i] = grams[:, pair_index(k, i, j)]
    return dd


@register("model_stock", mergekit=Mergekit(unweighted=True, shared=("filter_wise",)),
          params=ModelStockParams, additive=False, joint=gram_spec(lambda p: not p.filter_wise),
          paper="Jang et al. 2024, Model Stock: All we need is just a few fine-tuned models, arXiv:2403.19522")
def merge(block: BlockInputs, p: ModelStockParams) -> torch.Tensor:
    block = canonical_block(block)
    k = len(block.experts)
    if k < 2:
        raise MethodError(f"tensor {block.tensor!r}: model_stock needs at least 2 experts besides the base, "
                          f"got {k}")
    base = block.base
    if all(e.delta is None for e in block.experts):
        return base.clone()
    if p.filter_wise:
        t64 = interpolation_ratio(_row_gram(block))  # (vectors,)
        last = block.tensor_shape[-1] if len(block.tensor_shape) >= 2 else max(1, base.numel())
        t = torch.from_numpy(t64.astype(np.float32)).reshape(-1, 1)
        shape = (-1, last)
    else:
        _, _, dd = tensor_gram(block, p)
        t = torch.tensor([float(interpolation_ratio(dd))], dtype=torch.float32)
        shape = (-1,)
    total = None
    for e in block.experts:  # mergekit: sum(ws) / count, i.e. 0 + W_1 + W_2 + ...
        w = base if e.delta is None else base + e.delta
        total = w if total is None else total + w
    average = (total / k).reshape(shape)
    w0 = base.reshape(shape)
    return (t * average + (1 - t) * w0).reshape(base.shape)
