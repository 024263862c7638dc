"""params.yaml's `slices:`: output layer ranges, each merged with its own method parameters
and expert settings (mergekit's slices that merge), and where each tensor falls among them.

  slices:
    - layers: [0, 3]                      # output layers 0, 1, 2
      parameters: {t: [0, 1]}             # over this slice's layers: t = 0 at layer 0, 1 at 2
      experts: {b: {weight: 0.7}}
    - layers: [3, 5]
      parameters: {t: 0.2}

The slices tile the output's layers in order from 0. A tensor of output layer L takes the
settings of the slice holding L at t = (L - start) / (end - start - 1) (1 for a one-layer
slice); the embeddings (a name part containing embed, wte or wpe: mergekit's pre-weights)
take the first slice's, every other tensor outside the layers (final norm, head) the last
slice's, at t = 0 (mergekit 0.1.5's planner). With slices, every gradient, the top-level ones
too, is evaluated at that t. A slice's key wins over the top-level one; where the slice gives
none (absent, or no filter matches) the top-level value applies.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, Field

from mergepipe.config.fields import MODEL_CONFIG, TensorDensity, TensorGamma, TensorWeight
from mergepipe.config.settings import LAYER_RE, Setting, is_setting, parse_setting
from mergepipe.errors import ConfigError

# mergekit's pre-weights (embeddings); every other tensor outside the layers is a post-weight.
PRE_WEIGHT_RE = re.compile(r"(^|\.)[^.]*(embed|wte|wpe)[^.]*(\.|$)")
LayerIndex = Annotated[int, Field(strict=True, ge=0)]


class SliceExpert(BaseModel):
    """An expert's weight, density or gamma over one slice (each a number or a setting)."""

    model_config = MODEL_CONFIG
    weight: TensorWeight | None = None
    density: TensorDensity | None = None
    gamma: TensorGamma | None = None


class SliceConfig(BaseModel):
    """Output layers [start, end) and their method parameters and expert settings."""

    model_config = MODEL_CONFIG
    layers: tuple[LayerIndex, LayerIndex] = Field(description="output layers [start, end)")
    parameters: Annotated[dict[str, Any], Field(strict=True)] = Field(
        default_factory=dict, description="method parameters over these layers (numbers or settings)")
    experts: dict[str, SliceExpert] = Field(
        default_factory=dict, description="expert name -> weight, density, gamma over these layers")

    def normalized(self) -> dict[str, Any]:
        experts = {name: {k: v.to_json() if isinstance(v, Setting) else v
                          for k, v in e.model_dump().items() if v is not None}
                   for name, e in sorted(self.experts.items())}
        parameters = {k: v.to_json() if isinstance(v, Setting) else v for k, v in sorted(self.parameters.items())}
        return {"layers": list(self.layers), "parameters": parameters, "experts": experts}


def check_slices(slices: list[SliceConfig], expert_names: Iterable[str]) -> None:
    """Slices tile layers from 0 in order, and name only experts of the config.

    Raises:
        ValueError: naming the slice.
    """
    names = set(expert_names)
    if not slices:
        raise ValueError("slices: give at least one slice, or leave slices out")
    end = 0
    for i, s in enumerate(slices):
        start, stop = s.layers
        if start != end or stop <= start:
            raise ValueError(f"slices[{i}].layers: {list(s.layers)} must start where the previous slice ends "
                             f"({end}) and hold at least one layer")
        end = stop
        for name in s.experts:
            if name not in names:
                raise ValueError(f"slices[{i}].experts.{name}: not an expert of this config; "
                                 f"experts: {', '.join(sorted(names))}")


def parameter_settings(s: SliceConfig, check_leaf) -> dict[str, Setting]:
    """A slice's parameters, each as a Setting (a number is one unfiltered value);
    `check_leaf(key, leaf)` validates every value (raises ValueError)."""
    out = {}
    for key, value in sorted(s.parameters.items()):
        def check(leaf: Any, key: str = key) -> Any:
            return check_leaf(key, leaf)
        out[key] = parse_setting(value if is_setting(value) else [{"value": value}], check)
    return out


def placements(slices: list[SliceConfig], names: Iterable[str], where: str) -> dict[str, tuple[int, float]]:
    """(slice index, t) of every tensor (see the module docstring).

    Raises:
        ConfigError: the model's layers are not one stack, or the slices do not cover them exactly.
    """
    names = list(names)
    layer_of: dict[str, int] = {}
    prefixes = set()
    for name in names:
        m = LAYER_RE.match(name)
        if m:
            prefixes.add(m.group(1))
            layer_of[name] = int(m.group(2))
    if len(prefixes) > 1:
        raise ConfigError(f"{where}: slices: the model has {len(prefixes)} layer stacks "
                          f"({', '.join(sorted(prefixes))}); slices take a model with one")
    n_layers = max(layer_of.values(), default=-1) + 1
    if slices[-1].layers[1] != n_layers:
        raise ConfigError(f"{where}: slices: they cover layers [0, {slices[-1].layers[1]}) but the base has "
                          f"{n_layers}; the slices must cover every layer of the merged models")
    slice_at = [i for i, s in enumerate(slices) for _ in range(*s.layers)]
    out = {}
    for name in names:
        if name not in layer_of:
            out[name] = (0 if PRE_WEIGHT_RE.search(name) else len(slices) - 1, 0.0)
            continue
        i = slice_at[layer_of[name]]
        start, end = slices[i].layers
        out[name] = (i, (layer_of[name] - start) / (end - start - 1) if end - start > 1 else 1.0)
    return out
