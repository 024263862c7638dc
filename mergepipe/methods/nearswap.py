"""NearSwap: take the expert's value where it is near the base (mergekit's `nearswap`).

Elementwise, with a = W0, b = W1 = W0 + delta the one expert:
  w = clamp(t / max(|a - b|, 1e-6), 0, 1),   theta = w * b + (1 - w) * a,
so an element within t of the base moves all the way to the expert, and a farther one moves
by about t towards it. `t` is required, as in mergekit 0.1.5 (no default there).

Same fp32 operations as mergekit 0.1.5 with `dtype: float32` (torch's scalar / tensor is a
reciprocal and a product in both). b is rebuilt as W0 + delta, exact for bf16/fp16 inputs.
Where the delta is 0 (or the block is unread: skipped by a budget, or byte-identical to the
base) the base element is returned bit for bit; mergekit's w*a + (1-w)*a is a there too when
t >= 1e-6 (w = 1) and within an ulp of it otherwise.
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import BaseModel

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG, scaled_delta
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register

MIN_DISTANCE = 1e-6  # mergekit's clamp on |a - b|


class NearswapParams(BaseModel):
    model_config = PARAMS_CONFIG
    # distance within which the expert's value is taken whole
    t: float


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """The largest w can be: 1 for t >= 1e-6 (|output change| <= |delta| always)."""
    w = min(1.0, max(0.0, float(params["t"]) / MIN_DISTANCE))
    return {name: w for name in weights}


@register("nearswap", mergekit=Mergekit(unweighted=True, shared=("t",)),
          params=NearswapParams, additive=False, max_experts=1,
          effective_weights=effective_weights,
          paper="alchemonaut 2024, QuartetAnemoi-70B-t0.0001 (NearSwap), "
                "https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001")
def merge(block: BlockInputs, p: NearswapParams) -> torch.Tensor:
    if len(block.experts) != 1:
        raise MethodError(f"tensor {block.tensor!r}: nearswap takes the base and exactly one expert, "
                          f"got {len(block.experts)}")
    a = block.base
    delta = scaled_delta(block.experts[0])
    if delta is None:
        return a.clone()
    b = a + delta
    absdiff = torch.abs(a - b)
    weight = (p.t / absdiff.clamp(min=MIN_DISTANCE)).clamp(min=0, max=1)
    return torch.where(delta != 0, weight * b + (1 - weight) * a, a)
