"""Passthrough: one model's tensors, optionally times a scale (mergekit's `passthrough`).

theta = W1 * scale, W1 = W0 + delta_1 the one expert (the base where the expert's block is
unread or byte-identical to it); no scale (null, the default) keeps W1 as it is.

mergekit 0.1.5 `passthrough` takes exactly one input model and ignores `base_model`
(listing a base model that differs from the one input is an error there: two inputs). Its
`scale` is a per-model parameter; with one model it is one number, so here it is a method
parameter. mergepipe always needs a base: `import-mergekit` makes the one model both the base
and the expert, so nothing of the expert is read (every block is identical to the base) and
the output is the base's bytes (scale null or 1: copied file to file) or the base times the
scale (every float block read and multiplied: Method.rewrites_base). Listing another base
works too: then the output is the expert, rebuilt as W0 + delta in fp32, so an input whose
fp32 delta is inexact (fp32 weights of very different magnitude) can differ from it in the
last bits. A budget leaves some expert blocks unread: there the output is the base's rows
(times the scale). The scale multiplies in fp32 (mergekit's arithmetic with `dtype: float32`).
"""
from __future__ import annotations

from mergepipe.util.lazy import torch
from pydantic import BaseModel

from mergepipe.errors import MethodError
from mergepipe.methods._common import PARAMS_CONFIG, scaled_delta
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import Mergekit, register


class PassthroughParams(BaseModel):
    model_config = PARAMS_CONFIG
    # factor on every float tensor of the model; null: unscaled (mergekit's default)
    scale: float | None = None


def effective_weights(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """|scale| (1 when unset): how much of the expert's delta reaches the output."""
    scale = params.get("scale")
    return {name: abs(1.0 if scale is None else float(scale)) for name in weights}


def rewrites_base(p: PassthroughParams) -> bool:
    """A scale other than 1 changes blocks no expert is read for."""
    return p.scale is not None and p.scale != 1.0


def delta_coefficients(params: dict, weights: dict[str, float]) -> dict[str, float]:
    """The one expert's delta, whole (c = 1); a scale other than 1 scales the base too."""
    scale = params.get("scale")
    if scale is not None and float(scale) != 1.0:
        raise ValueError(f"scale {scale} multiplies the base's weights too")
    return {name: 1.0 for name in weights}


@register("passthrough",
          mergekit=Mergekit(no_base="self", unweighted=True, shared_model_keys=("scale",), per_input=("scale",)),
          params=PassthroughParams, additive=True, max_experts=1,
          effective_weights=effective_weights, delta_coefficients=delta_coefficients, rewrites_base=rewrites_base,
          paper="mergekit passthrough (Goddard et al. 2024, Arcee's MergeKit, arXiv:2403.13257)")
def merge(block: BlockInputs, p: PassthroughParams) -> torch.Tensor:
    if len(block.experts) != 1:
        raise MethodError(f"tensor {block.tensor!r}: passthrough outputs exactly one model, got "
                          f"{len(block.experts)} experts; list one (the base itself to pass the base through)")
    delta = scaled_delta(block.experts[0])
    model = block.base if delta is None else block.base + delta
    if p.scale is None:
        return model if delta is not None else model.clone()
    return model * p.scale
