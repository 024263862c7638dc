"""params.yaml's `modules:`: parts of the model named by tensor-name prefixes, each merged with
its own method parameters and expert settings (mergekit's `modules:`), and which part each
tensor belongs to.

  modules:
    text_decoder:
      prefixes: [model., lm_head.]
      parameters: {lambda: 0.9}
      experts: {b: {weight: 0.7}}
    vision_tower:
      prefixes: [visual.]
      parameters: {t: [0, 1]}          # over the vision tower's own layers
    multi_modal_projector:
      prefixes: [visual.merger.]       # the longest matching prefix wins

A tensor belongs to the module with the longest prefix its name starts with; a tensor no
prefix matches is an error (mergekit writes only its modules' tensors). Gradients are evaluated at the tensor's
position in its own layer stack (config/settings.py `layer_positions`: a VLM's vision and
language layers each run from t = 0 to 1), as mergekit evaluates them over each module's
layers. A module's key wins over the top-level one; where it gives none (absent, or no filter
matches) the top-level value applies. Not combined with `slices:`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, Field

from mergepipe.config.fields import MODEL_CONFIG
from mergepipe.config.settings import Setting, layer_positions
from mergepipe.config.slices import SliceExpert
from mergepipe.errors import ConfigError

Prefix = Annotated[str, Field(strict=True, min_length=1)]


class ModuleConfig(BaseModel):
    """The tensors whose names start with one of `prefixes`, and their method parameters and
    expert settings."""

    model_config = MODEL_CONFIG
    prefixes: list[Prefix] = Field(min_length=1, description="tensor-name prefixes of this module's tensors")
    parameters: Annotated[dict[str, Any], Field(strict=True)] = Field(
        default_factory=dict, description="method parameters over this module (numbers or settings)")
    experts: dict[str, SliceExpert] = Field(
        default_factory=dict, description="expert name -> weight, density, gamma over this module")

    def normalized(self) -> dict[str, Any]:
        experts = {name: {k: v.to_json() if isinstance(v, Setting) else v
                          for k, v in e.model_dump().items() if v is not None}
                   for name, e in sorted(self.experts.items())}
        parameters = {k: v.to_json() if isinstance(v, Setting) else v for k, v in sorted(self.parameters.items())}
        return {"prefixes": sorted(self.prefixes), "parameters": parameters, "experts": experts}


def check_modules(modules: dict[str, ModuleConfig], expert_names: Iterable[str]) -> None:
    """Each prefix names one module, and modules name only experts of the config.

    Raises:
        ValueError: naming the module.
    """
    names = set(expert_names)
    if not modules:
        raise ValueError("modules: give at least one module, or leave modules out")
    owner: dict[str, str] = {}
    for module, m in modules.items():
        for prefix in m.prefixes:
            if prefix in owner:
                raise ValueError(f"modules.{module}.prefixes: {prefix!r} is also modules.{owner[prefix]}'s; "
                                 "a prefix names one module")
            owner[prefix] = module
        for name in m.experts:
            if name not in names:
                raise ValueError(f"modules.{module}.experts.{name}: not an expert of this config; "
                                 f"experts: {', '.join(sorted(names))}")


def module_of(name: str, modules: dict[str, ModuleConfig]) -> str | None:
    """The module whose longest prefix starts `name` (None: no prefix does)."""
    best, length = None, 0
    for module, m in modules.items():
        for prefix in m.prefixes:
            if len(prefix) > length and name.startswith(prefix):
                best, length = module, len(prefix)
    return best


def module_placements(modules: dict[str, ModuleConfig], names: Iterable[str],
                      where: str) -> dict[str, tuple[str, float]]:
    """(module, t) of every tensor (see the module docstring).

    Raises:
        ConfigError: a tensor in no module, naming it.
    """
    out = {}
    for name, t in layer_positions(names).items():
        module = module_of(name, modules)
        if module is None:
            raise ConfigError(f"{where}: modules: tensor {name!r} is in no module (no prefix starts it); mergekit "
                              "writes only its modules' tensors: add its prefix to a module")
        out[name] = (module, t)
    return out
