"""Spherical linear interpolation between the base and one expert (Shoemake, 1985).

theta = sin((1-t)*phi)/sin(phi) * W0 + sin(t*phi)/sin(phi) * W1, with
cos(phi) = <W0, W1> / (|W0| |W1|) over the WHOLE tensor (each flattened), and
plain (1-t)*W0 + t*W1 where |cos(phi)| > 0.9995.

mergekit 0.1.5 `slerp` takes one angle per output tensor: its kernel flattens
everything but the leading axis, and that axis is the batch of packed weights
("[output, *weight_shape]"), not the tensor's rows. (The original design's "per row" read
the batch axis as rows; docs/design.md says "per whole tensor".) A block therefore cannot find the angle alone: the
engine supplies ExpertBlock.cosine, computed once per (expert, tensor) by
`cosine_from_sums` from three whole-tensor sums: sum W0^2, sum W1^2 and
sum W0*W1 (W1 = W0 + delta). When the block is the whole tensor and no cosine is
given, it is computed here as mergekit does (fp32, 2^20-element chunks), and
then the result matches mergekit bit for bit.

The two coefficients follow mergekit's fp32 operations exactly; with a cosine
from fp64 sums they can differ from mergekit's fp32 one in the last bits, which
moves the result by an ulp at most in the slerp branch and not at all in the
lerp branch (almost every tensor of a fine-tune), except if the two cosines fall
on opposite sides of 0.9995. Where the delta is zero in the lerp branch the
base element is returned bit for bit (mergekit's (1-t)*W0 + t*W0 can be an ulp
off). `t` defaults to the expert's weight.
"""
from __future__ import annotations

import math

from mergepipe.util.lazy import torch
from pydantic import BaseModel

from mergepipe.checkpoint.blocks import num_rows
from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register

DOT_THRESHOLD = 0.9995
NORM_EPS = 1e-8
_CHUNK_ELEMENTS = 1 << 20


class SlerpParams(BaseModel):
    model_config = PARAMS_CONFIG
    # interpolation weight of the expert: 0 gives the base, 1 the expert;
    # None takes the expert's weight
    t: float | None = None


def cosine_from_sums(base_sq: float, expert_sq: float, dot: float) -> float:
    """cos(phi) from whole-tensor sums (fp64 recommended): sum W0^2, sum W1^2, sum W0*W1.

    A norm at or below 1e-8 counts as 1, as mergekit does; clamped to [-1, 1].
    """
    norm_base = math.sqrt(base_sq)
    norm_expert = math.sqrt(expert_sq)
    norm_base = norm_base if norm_base > NORM_EPS else 1.0
    norm_expert = norm_expert if norm_expert > NORM_EPS else 1.0
    return min(1.0, max(-1.0, dot / (norm_base * norm_expert)))


def whole_tensor_cosine(base: torch.Tensor, expert: torch.Tensor) -> float:
    """cos(phi) between two whole tensors in mergekit 0.1.5's fp32 chunked arithmetic."""
    a = base.reshape(1, -1).to(torch.float32)
    b = expert.reshape(1, -1).to(torch.float32)
    if a.shape[1] == 0:
        return 1.0
    starts = range(0, a.shape[1], _CHUNK_ELEMENTS)
    norm_a = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(a[:, s:s + _CHUNK_ELEMENTS], dim=1, keepdim=True) for s in starts]), dim=0)
    norm_b = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(b[:, s:s + _CHUNK_ELEMENTS], dim=1, keepdim=True) for s in starts]), dim=0)
    norm_a = torch.where(norm_a > NORM_EPS, norm_a, 1)
    norm_b = torch.where(norm_b > NORM_EPS, norm_b, 1)
    parts = [((a[:, s:s + _CHUNK_ELEMENTS] / norm_a) * (b[:, s:s + _CHUNK_ELEMENTS] / norm_b))
             .sum(dim=1, keepdim=True) for s in starts]
    return float(torch.stack(parts).sum(dim=0).clamp(-1, 1))


def slerp_coefficients(t: float, cosine: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(coefficient of W0, coefficient of W1, lerp?) as fp32 scalars, mergekit's way."""
    t_ = torch.tensor(t, dtype=torch.float32)
    dot = torch.tensor(cosine, dtype=torch.float32).clamp(-1, 1)
    linear = dot.abs() > DOT_THRESHOLD
    phi = torch.acos(torch.where(linear, 0, dot))
    sin_phi = torch.sin(phi)
    coef_a = torch.where(linear, 1 - t_, torch.sin((1 - t_) * phi) / sin_phi)
    coef_b = torch.where(linear, t_, torch.sin(t_ * phi) / sin_phi)
    return coef_a, coef_b, bool(linear)


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """|t|, or |w| when t is unset: the expert's share of the interpolation."""
    t = params.get("t")
    return {name: abs(float(w if t is None else t)) for name, w in weights.items()}


@register("slerp", mergekit=Mergekit(shared=("t",)), params=SlerpParams, additive=False, max_experts=1, cosine=True,
          effective_weights=effective_weights,
          paper="Shoemake 1985, Animating Rotation with Quaternion Curves, SIGGRAPH '85")
def merge(block: BlockInputs, p: SlerpParams) -> torch.Tensor:
    if len(block.experts) != 1:
        raise MethodError(f"tensor {block.tensor!r}: slerp interpolates the base and exactly one "
                          f"expert, got {len(block.experts)}; list one expert or use linear")
    expert = block.experts[0]
    base = block.base
    t = expert.weight if p.t is None else p.t
    cosine = expert.cosine
    if cosine is None:
        whole = block.row_start == 0 and block.row_end == num_rows(block.tensor_shape)
        if not whole:
            raise MethodError(f"tensor {block.tensor!r}, expert {expert.name!r}: slerp needs the "
                              "whole-tensor cosine for a partial block (rows "
                              f"{block.row_start}:{block.row_end}); the engine must pass "
                              "ExpertBlock.cosine (see cosine_from_sums)")
        cosine = whole_tensor_cosine(base, base if expert.delta is None else base + expert.delta)
    coef_a, coef_b, linear = slerp_coefficients(t, cosine)
    if linear and expert.delta is None:
        return base.clone()
    other = base if expert.delta is None else base + expert.delta
    result = coef_a * base + coef_b * other
    if linear:
        result = torch.where(expert.delta != 0, result, base)
    return result
