"""NuSLERP: spherical interpolation of two models or two deltas, per vector (mergekit's `nuslerp`, 0.1.5).

With two experts (mergekit with a base model), v0, v1 = their deltas; with one expert
(mergekit without a base model: the base is the first model, the expert the second),
v0 = W0, v1 = W0 + delta. t = w1 / (w0 + w1) (0.5 where |w0 + w1| < 1e-6), w0, w1 the two
weights (one expert: w0 = `base_weight`, w1 its weight). For each vector:
  cos = <v0, v1> / (max(|v0|, 1e-7) max(|v1|, 1e-7)), clamped to [-1, 1], theta = acos(cos),
  r = (sin((1 - t) theta) v0 + sin(t theta) v1) / sin(theta), or (1 - t) v0 + t v1 where
  1 - cos^2 <= 1e-16 (in fp32: cos^2 rounds to 1);
theta_out = W0 + r with two experts, r with one. The vectors, as mergekit's modes define them:
- `nuslerp_flatten: true` (mergekit's default): the whole tensor is one vector;
- `nuslerp_flatten: false`: each vector along the last axis (a row of a matrix; block-local);
- `nuslerp_flatten: false, nuslerp_row_wise: true`: each vector along the first axis (a column
  of the (rows, elements per row) matrix; a 0-d or 1-d tensor is one vector).
The whole-tensor modes take their sums (v0^2, v1^2, v0*v1: 3, or 3 per column) from the
engine's joint scan (methods/joint.py, NUSLERP_SUMS): a block is then read for both experts or
neither, and the scan reads every block once before the merge.

Arithmetic: the norms and the dot product are fp64 sums in a fixed order
(methods/_rowsums.py), not mergekit's fp32 norms of fp32 normalized vectors, whose order
torch picks per CPU; cos is rounded to fp32 and everything after it is mergekit's fp32
operations in its order, so the result differs from mergekit's in the last bits only (the
coefficients move by an ulp or two; where mergekit's fp32 cos misses +-1 by an ulp it takes the
slerp branch of an exactly colinear pair, the knife edge of this method). Experts go in canonical
(content-hash) order, and t belongs to the second: listed the other way round, mergekit computes
the same two coefficients up to one rounding of 1 - t. An unread block (budget, or identical to
the base) is a zero delta (two experts: both unread is the base), or, with one expert, the base
as v1: in row mode the output is then the base's rows (as for every row the expert leaves
unchanged; mergekit's (1 - t) v0 + t v0 is within an ulp), in the whole-tensor modes the
interpolation at the tensor's angle, as mergekit computes it (Method.rewrites_base).
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
import numpy as np
from pydantic import BaseModel

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG, canonical, scaled_delta
from mergepipe.checkpoint.blocks import num_rows, row_numel
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.joint import JointBlock, JointPass, JointSpec, TensorContext
from mergepipe.methods.registry import Mergekit, register

NORM_EPS = 1e-7  # mergekit's clamp on each norm
COLINEAR_EPS = 1e-8  # mergekit: colinear where 1 - cos^2 <= eps^2


class NuslerpParams(BaseModel):
    model_config = PARAMS_CONFIG
    nuslerp_row_wise: bool = False
    nuslerp_flatten: bool = True
    # one expert only: the weight of the base as the first model (mergekit without base_model)
    base_weight: float | None = None



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


# --- whole-tensor modes: sums over the whole tensor (flatten) or down each column ----------

def _mode(params, shape: tuple[int, ...]) -> str:
    """"row" (a vector per row, block-local), "flat" (the whole tensor) or "column" (a vector per
    column of the (rows, elements per row) matrix; a 0-d or 1-d tensor has one vector: flat)."""
    if params.nuslerp_flatten or (params.nuslerp_row_wise and len(shape) < 2):
        return "flat"
    return "column" if params.nuslerp_row_wise else "row"


def _vectors(base: np.ndarray, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(v0, v1) as fp32 numpy from a block's base (rows, n) and deltas (k, rows, n):
    the two deltas, or (one expert) the base and the expert's weights."""
    if deltas.shape[0] == 1:
        return base, base + deltas[0]
    return deltas[0], deltas[1]


def _sums_of(v0: np.ndarray, v1: np.ndarray, mode: str) -> np.ndarray:
    """Fixed-order fp64 sums v0^2, v1^2, v0*v1 of (rows, n) fp32 arrays: 3 for "flat", 3 per column."""
    from mergepipe.methods._rowsums import row_sums

    if mode == "flat":
        return row_sums(v0.reshape(1, -1), v1.reshape(1, -1)).reshape(-1)
    return row_sums(np.ascontiguousarray(v0.T), np.ascontiguousarray(v1.T)).reshape(-1)


def _block_sums(block: JointBlock, prev) -> np.ndarray:
    v0, v1 = _vectors(block.base, block.deltas)
    return _sums_of(v0, v1, _mode(block.ctx.params, block.ctx.shape))


def _stats_size(ctx: TensorContext) -> int:
    return 3 if _mode(ctx.params, ctx.shape) == "flat" else 3 * row_numel(ctx.shape)


# the sums depend on the mode only; the experts' weights enter later (t)
NUSLERP_SUMS = JointSpec(passes=(JointPass(_stats_size, _block_sums, lambda acc, prev, ctx: acc),),
                         result_size=_stats_size, params=("nuslerp_flatten", "nuslerp_row_wise"),
                         active=lambda p: p.nuslerp_flatten or p.nuslerp_row_wise)


def cosines_from_sums(sums: np.ndarray) -> torch.Tensor:
    """fp32 cos per vector from (vectors, 3) fp64 sums v0^2, v1^2, v0*v1; norms clamped at 1e-7."""
    sums = torch.from_numpy(np.array(sums, dtype=np.float64).reshape(-1, 3))  # a copy: the stats are read-only
    norms = sums[:, :2].sqrt().clamp(min=NORM_EPS)
    return (sums[:, 2] / (norms[:, 0] * norms[:, 1])).to(torch.float32).clamp(-1, 1)


def _tensor_cosines(block: BlockInputs, p: NuslerpParams, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A whole-tensor mode's cos, (1, 1) for "flat" or (1, columns) for "column", of the block's
    vectors a, b (rows, n): the engine's joint statistics, or, when the block is the whole
    tensor and none were given, its own sums (the same numbers)."""
    stats = block.joint
    if stats is None:
        if not (block.row_start == 0 and block.row_end == num_rows(block.tensor_shape)):
            raise MethodError(f"tensor {block.tensor!r}: nuslerp with nuslerp_flatten or nuslerp_row_wise needs "
                              f"the whole tensor's sums for rows {block.row_start}:{block.row_end}; the engine's "
                              "joint scan provides them (BlockInputs.joint)")
        stats = _sums_of(a.numpy(), b.numpy(), _mode(p, tuple(block.tensor_shape)))
    return cosines_from_sums(stats).reshape(1, -1)


def _interpolate(block: BlockInputs, p: NuslerpParams, t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """v0 toward v1 (the block's shape) in the parameters' mode."""
    shape = tuple(block.tensor_shape)
    mode = _mode(p, shape)
    if mode == "row":
        return nuslerp_rows(t, v0, v1)
    n = row_numel(shape) if len(shape) >= 2 else max(1, v0.numel())
    a, b = v0.reshape(-1, n), v1.reshape(-1, n)
    cos = _tensor_cosines(block, p, a, b)
    if mode == "flat":
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    return slerp_rows(t, a, b, cos).reshape(v0.shape)


def rewrites_base(p: NuslerpParams) -> bool:
    """One expert (base_weight set) in a whole-tensor mode: an unchanged block is
    (c0 + c1) W0 with the tensor's angle, not W0, so every block goes through `fn`."""
    return p.base_weight is not None and (p.nuslerp_flatten or p.nuslerp_row_wise)


@register("nuslerp",
          mergekit=Mergekit(no_base="first", shared=("nuslerp_row_wise", "nuslerp_flatten"), per_input=("weight",)),
          params=NuslerpParams, additive=False, max_experts=2, joint=NUSLERP_SUMS,
          effective_weights=effective_weights, rewrites_base=rewrites_base,
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
        t = interpolation_t(p.base_weight, experts[0].weight)
        if _mode(p, tuple(block.tensor_shape)) != "row":
            return _interpolate(block, p, t, base, base if delta is None else base + delta)
        if delta is None:
            return base.clone()
        result = nuslerp_rows(t, base, base + delta)
        # a row the expert leaves as the base's is the base's, as in an unread block
        unchanged = (delta == 0).reshape(-1, delta.shape[-1] if delta.dim() else 1).all(dim=1, keepdim=True)
        return torch.where(unchanged, base.reshape(unchanged.shape[0], -1), result.reshape(unchanged.shape[0], -1)
                           ).reshape(base.shape)
    if len(experts) != 2:
        raise MethodError(f"tensor {block.tensor!r}: nuslerp interpolates two experts' deltas (or the base "
                          f"and one expert), got {len(experts)} experts")
    d0, d1 = (scaled_delta(e) for e in experts)
    if d0 is None and d1 is None:  # two zero vectors interpolate to zero in every mode
        return base.clone()
    v0 = torch.zeros_like(base) if d0 is None else d0
    v1 = torch.zeros_like(base) if d1 is None else d1
    return base + _interpolate(block, p, interpolation_t(experts[0].weight, experts[1].weight), v0, v1)
