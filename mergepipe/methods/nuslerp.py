"""NuSLERP, row mode: spherical interpolation of each row (mergekit's `nuslerp`, 0.1.5).

With two experts (mergekit with a base model), v0, v1 = their deltas; with one expert
(mergekit without a base model: the base is the first model, the expert the second),
v0 = W0, v1 = W0 + delta. t = w1 / (w0 + w1) (0.5 where |w0 + w1| < 1e-6), w0, w1 the two
weights (one expert: w0 = `base_weight`, w1 its weight). For each vector along the last
axis (each row of a matrix, the whole of a 1-d tensor):
  cos = <v0, v1> / (max(|v0|, 1e-7) max(|v1|, 1e-7)), clamped to [-1, 1], theta = acos(cos),
  r = (sin((1 - t) theta) v0 + sin(t theta) v1) / sin(theta), or (1 - t) v0 + t v1 where
  1 - cos^2 <= 1e-16 (in fp32: cos^2 rounds to 1);
theta_out = W0 + r with two experts, r with one.

Only mergekit's `nuslerp_flatten: false, nuslerp_row_wise: false` is here: a row is inside one
block. `nuslerp_flatten: true` (mergekit's default: one angle per whole tensor) needs sums of
products of the two experts over the whole tensor, and `nuslerp_row_wise: true` (one angle per
column) sums down every column; both are refused with that reason.

Arithmetic: the norms and the dot product are fp64 sums in a fixed order
(methods/_rowsums.py), not mergekit's fp32 norms of fp32 normalized vectors, whose order
torch picks per CPU; cos is rounded to fp32 and everything after it is mergekit's fp32
operations in its order, so the result differs from mergekit's in the last bits only (the
coefficients move by an ulp or two). Experts go in canonical (content-hash) order, and t
belongs to the second: listed the other way round, mergekit computes the same two
coefficients up to one rounding of 1 - t. An unread block (budget, or identical to the base)
is a zero delta (two experts) or the base (one expert: the output is then the base's rows, as it
is for every vector the expert leaves unchanged; mergekit's (1 - t) v0 + t v0 is within an ulp).
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import BaseModel, model_validator

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG, canonical, scaled_delta
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import register

NORM_EPS = 1e-7  # mergekit's clamp on each norm
COLINEAR_EPS = 1e-8  # mergekit: colinear where 1 - cos^2 <= eps^2


class NuslerpParams(BaseModel):
    model_config = PARAMS_CONFIG
    nuslerp_row_wise: bool = False
    nuslerp_flatten: bool = True
    # one expert only: the weight of the base as the first model (mergekit without base_model)
    base_weight: float | None = None

    @model_validator(mode="after")
    def _row_mode_only(self) -> NuslerpParams:
        if self.nuslerp_flatten:
            raise ValueError("nuslerp_flatten: true (one angle per whole tensor, mergekit's default) needs "
                             "sums across the two experts' whole tensors, which mergepipe does not compute "
                             "yet; set nuslerp_flatten: false (one angle per row)")
        if self.nuslerp_row_wise:
            raise ValueError("nuslerp_row_wise: true (one angle per column) needs sums down whole columns, "
                             "which mergepipe does not compute yet; set nuslerp_row_wise: false (per row)")
        return self


def interpolation_t(w0: float, w1: float) -> float:
    """mergekit's t: the second model's share of the weight (0.5 if the weights cancel)."""
    total = w0 + w1
    return 0.5 if abs(total) < 1e-6 else w1 / total


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """|w_k / (w0 + w1)| (about the share of each delta in the output)."""
    base_weight = params.get("base_weight")
    total = sum(weights.values()) + (float(base_weight) if len(weights) == 1 and base_weight is not None else 0.0)
    if abs(total) < 1e-6:
        return {name: 0.5 for name in weights}
    return {name: abs(w / total) for name, w in weights.items()}


def row_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos between each row of a and of b (2-d fp32): fp64 fixed-order sums, rounded to fp32, (rows, 1)."""
    from mergepipe.methods._rowsums import row_sums

    sums = torch.from_numpy(row_sums(a.numpy(), b.numpy()))
    norms = sums[:, :2].sqrt().clamp(min=NORM_EPS)
    return (sums[:, 2] / (norms[:, 0] * norms[:, 1])).to(torch.float32).clamp(-1, 1).reshape(-1, 1)


def slerp_rows(t: float, a: torch.Tensor, b: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """mergekit's interpolation of rows a toward rows b given each row's cos (fp32, its operations)."""
    colinear = (1 - cos.square()) <= COLINEAR_EPS ** 2
    theta = torch.acos(torch.where(colinear, 0, cos))
    sin_theta = torch.sin(theta)
    result = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / sin_theta
    return torch.where(colinear, (1 - t) * a + t * b, result)


def nuslerp_rows(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """Interpolate each vector along the last axis of v0 toward v1's (same shape, fp32)."""
    shape = v0.shape
    n = shape[-1] if v0.dim() else 1
    a, b = v0.reshape(-1, n), v1.reshape(-1, n)
    return slerp_rows(t, a, b, row_cosines(a, b)).reshape(shape)


@register("nuslerp", params=NuslerpParams, additive=False, max_experts=2,
          effective_weights=effective_weights,
          paper="Shoemake 1985 (slerp); mergekit nuslerp (Goddard et al. 2024, arXiv:2403.13257)")
def merge(block: BlockInputs, p: NuslerpParams) -> torch.Tensor:
    experts = canonical(block.experts)
    base = block.base
    if len(experts) == 1:
        if p.base_weight is None:
            raise MethodError(f"tensor {block.tensor!r}: nuslerp with one expert interpolates the base model "
                              "and the expert (mergekit without base_model) and needs parameters.base_weight, "
                              "the base's weight; or list two experts")
        delta = scaled_delta(experts[0])
        if delta is None:
            return base.clone()
        result = nuslerp_rows(interpolation_t(p.base_weight, experts[0].weight), base, base + delta)
        # a vector the expert leaves as the base's is the base's, as in an unread block
        unchanged = (delta == 0).reshape(-1, delta.shape[-1] if delta.dim() else 1).all(dim=1, keepdim=True)
        return torch.where(unchanged, base.reshape(unchanged.shape[0], -1), result.reshape(unchanged.shape[0], -1)
                           ).reshape(base.shape)
    if len(experts) != 2:
        raise MethodError(f"tensor {block.tensor!r}: nuslerp interpolates two experts' deltas (or the base "
                          f"and one expert), got {len(experts)} experts")
    d0, d1 = (scaled_delta(e) for e in experts)
    if d0 is None and d1 is None:
        return base.clone()
    v0 = torch.zeros_like(base) if d0 is None else d0
    v1 = torch.zeros_like(base) if d1 is None else d1
    return base + nuslerp_rows(interpolation_t(experts[0].weight, experts[1].weight), v0, v1)
