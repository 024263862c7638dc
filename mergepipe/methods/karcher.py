"""Karcher (Riemannian) mean on the unit sphere, as mergekit 0.1.5 `karcher`.

The inputs are whole weight tensors v_0 = W0 (with `include_base`, the default: mergekit
averages every model of the config, base_model included) and v_i = W0 + d_i, each with
weight 1/N. Their directions u_i = v_i / |v_i| (only those with |v_i| > tol) are averaged
by fixed-point iteration: start at the normalized weighted mean; move along
sum_j a_j (theta_j / sin theta_j)(u_j - cos theta_j m) by its norm (the exponential map)
until that norm is below `tol` or `max_iter` steps are done; the result is
(sum_i |v_i| / N) * m.

Every iterate is a linear combination of the u_i, so the iteration runs on coefficient
vectors against the inputs' Gram matrix, which the joint statistics give (<W0,W0>,
<W0,d_i>, <d_i,d_j>: methods/_gram.py), in fp64, following mergekit's branches (zero
norms, angles below tol, a degenerate mean). The output is then a weighted sum of the
inputs, evaluated block by block in fp32: theta = (sum_i c_i) W0 + sum_i c_i d_i. Its
output scales the base too, so every float block is merged (`rewrites_base`), also where
no expert changes it; an unread block (budget) counts as d_i = 0 there.
"""
from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, Field

from mergepipe.util.lazy import torch

from mergepipe.methods._common import PARAMS_CONFIG
from mergepipe.methods._gram import canonical_block, gram_spec, matvec, quad, tensor_gram, weighted_sum
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register


class KarcherParams(BaseModel):
    model_config = PARAMS_CONFIG
    max_iter: int = Field(10, ge=0, le=10_000)
    tol: float = Field(1e-5, ge=0.0)
    include_base: bool = True


def input_gram(bb: float, bd: np.ndarray, dd: np.ndarray, include_base: bool) -> np.ndarray:
    """Gram matrix of the inputs (W0 first when included, then W0 + d_i), fp64."""
    k = bd.shape[0]
    g = bb + bd[:, None] + bd[None, :] + dd
    if not include_base:
        return g
    out = np.empty((k + 1, k + 1), dtype=np.float64)
    out[0, 0] = bb
    out[0, 1:] = out[1:, 0] = bb + bd
    out[1:, 1:] = g
    return out


def karcher_coefficients(gram: np.ndarray, max_iter: int, tol: float) -> np.ndarray:
    """c with result = sum_i c_i v_i (mergekit's karcher_merge_tensors on coefficients)."""
    n = gram.shape[0]
    if n == 1:
        return np.ones(1)
    alphas = [1.0 / n] * n
    norms = np.sqrt(np.maximum(np.diagonal(gram), 0.0))
    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return np.zeros(n)
    alpha_sum = sum(alphas[i] for i in valid)
    a = np.array([alphas[i] / alpha_sum for i in valid])
    nv = norms[valid]
    g = gram[np.ix_(valid, valid)] / np.outer(nv, nv)  # Gram of the unit vectors

    def norm(c: np.ndarray) -> float:
        return math.sqrt(max(quad(c, g), 0.0))

    mean = a.copy()
    mean_norm = norm(mean)
    if mean_norm < tol:
        mean = np.zeros(len(valid))
        mean[0] = 1.0
    else:
        mean = mean / mean_norm
    for _ in range(max_iter):
        tangent = np.zeros(len(valid))
        dots = matvec(g, mean)  # <m, u_j>
        for j in range(len(valid)):
            dot = min(1.0, max(-1.0, float(dots[j])))
            theta = math.acos(dot)
            if theta < tol:
                continue
            unit = np.zeros(len(valid))
            unit[j] = 1.0
            tangent = tangent + a[j] * (theta / math.sin(theta)) * (unit - dot * mean)
        tangent_norm = norm(tangent)
        if tangent_norm < tol:
            break
        mean = math.cos(tangent_norm) * mean + math.sin(tangent_norm) * (tangent / tangent_norm)
        unit_norm = norm(mean)
        if unit_norm > tol:
            mean = mean / unit_norm
    scale = sum(alpha * float(nrm) for alpha, nrm in zip(alphas, norms))
    out = np.zeros(n)
    out[valid] = scale * mean / nv
    return out


@register("karcher", mergekit=Mergekit(no_base="member", unweighted=True, shared=("max_iter", "tol")),
          params=KarcherParams, additive=False, joint=gram_spec(), rewrites_base=lambda p: True,
          effective_weights=lambda params, weights: {name: 1.0 / max(1, len(weights) + bool(
              params.get("include_base", True))) for name in weights},
          paper="Karcher 1977, Riemannian center of mass and mollifier smoothing, CPAM 30(5); "
                "mergekit 0.1.5 `karcher`")
def merge(block: BlockInputs, p: KarcherParams) -> torch.Tensor:
    block = canonical_block(block)
    bb, bd, dd = tensor_gram(block, p)
    c = karcher_coefficients(input_gram(bb, bd, dd, p.include_base), p.max_iter, p.tol)
    experts = c[1:] if p.include_base else c
    return weighted_sum(block, math.fsum(float(x) for x in c), [float(x) for x in experts])
