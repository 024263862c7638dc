"""Multi-SLERP: barycentric interpolation of the deltas on the sphere, as mergekit 0.1.5
`multislerp` (with a base model).

With deltas d_i, weights w_i (divided by their sum when `normalize_weights`), norms
n_i = |d_i| and u_i = d_i / (n_i + eps): m = sum w_i u_i normalized; the tangent
t = sum w_i (u_i - <u_i,m> m); with |t|' = |t| + eps, r = cos(|t|') m + sin(|t|')/|t|' t;
theta = W0 + (sum_i w_i n_i) r. One expert: theta = W0 + d_1 (mergekit returns that
model). |sum w_i u_i| < eps: two experts fall back to W0 + w_1 d_1 + w_2 d_2, more are an
error (antipodal deltas with balancing weights), as in mergekit. A tensor no expert
changes is the base (mergekit raises on it with more than two experts).

Norms are of whole tensors, so r is a linear combination of the d_i whose coefficients
come from the deltas' Gram matrix (joint statistics, methods/_gram.py) in fp64; then
theta = W0 + sum_i r_i d_i per block in fp32. An unread block (budget) is the base.
"""
from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, Field

from mergepipe.util.lazy import torch

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG
from mergepipe.methods._gram import canonical_block, dot, gram_spec, matvec, quad, tensor_gram, weighted_sum
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register


class MultislerpParams(BaseModel):
    model_config = PARAMS_CONFIG
    normalize_weights: bool = True
    eps: float = Field(1e-8, ge=0.0)


def multislerp_coefficients(dd: np.ndarray, weights: list[float], normalize: bool, eps: float,
                            tensor: str = "") -> np.ndarray:
    """r with theta = W0 + sum_i r_i d_i, from the deltas' Gram matrix (fp64)."""
    w = np.array(weights, dtype=np.float32)  # mergekit's weights are an fp32 tensor
    if normalize:
        total = np.float32(0.0)
        for x in w:  # left to right, as mergekit sums its few weights
            total = np.float32(total + x)
        w = w / total
    w = w.astype(np.float64)

    def norm(c: np.ndarray) -> float:
        return math.sqrt(max(quad(c, dd), 0.0))

    norms = np.sqrt(np.maximum(np.diagonal(dd), 0.0))
    if not norms.any():  # no expert changes the tensor: the base (mergekit raises here for k > 2)
        return np.zeros(len(weights))
    inv = 1.0 / (norms + eps)
    mean = w * inv
    mean_norm = norm(mean)
    if mean_norm < eps:
        if len(weights) == 2:
            return w.copy()
        raise MethodError(f"tensor {tensor!r}: multislerp: the weighted sum of the experts' directions is zero "
                          "(antipodal deltas whose weights balance out); change the weights")
    mean = mean / mean_norm
    dots = inv * matvec(dd, mean)  # <u_i, m>
    tangent = w * inv - dot(w, dots) * mean
    tangent_norm = norm(tangent) + eps
    r = math.cos(tangent_norm) * mean + (math.sin(tangent_norm) / tangent_norm) * tangent
    return r * dot(norms, w)


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """|w_i| (over sum w when normalized): roughly the share of d_i in the output."""
    total = sum(weights.values()) if params.get("normalize_weights", True) else 1.0
    return {name: abs(w / total) if total else abs(w) for name, w in weights.items()}


@register("multislerp",
          mergekit=Mergekit(shared=("normalize_weights", "eps"),
                            per_input=("weight",)), params=MultislerpParams, additive=False, joint=gram_spec(),
          effective_weights=effective_weights,
          paper="Goddard 2025, Multislerp (goddard.blog/posts/multislerp-wow-what-a-cool-idea); mergekit 0.1.5")
def merge(block: BlockInputs, p: MultislerpParams) -> torch.Tensor:
    block = canonical_block(block)
    if len(block.experts) == 1:
        return weighted_sum(block, 1.0, [1.0])
    _, _, dd = tensor_gram(block, p)
    r = multislerp_coefficients(dd, [e.weight for e in block.experts], p.normalize_weights, p.eps, block.tensor)
    return weighted_sum(block, 1.0, [float(x) for x in r])
