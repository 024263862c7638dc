"""Resolve a config's per-tensor settings over a checkpoint's tensor names.

The result is what the plan records as `tensor_parameters` (docs/design.md, "Plan"):

  {"groups": [{"parameters": {key: value}, "experts": {expert: {weight|density|gamma: value}}}],
   "tensors": {tensor name: group index}}

Only the per-tensor keys appear in a group; everything else is the plan's top-level
`parameters` and expert entries. Groups are the distinct resolved combinations, numbered in
the order of the sorted tensor names, so the same config and names give the same bytes.

Precedence, as in mergekit's `resolve_parameter`: an expert's own setting, else (density,
gamma) the method's value for that tensor, else the method's default. An expert weight with
no matching condition is an error naming the tensor. With `slices:` (config/slices.py), a
tensor's slice's settings come first, and every setting is evaluated at the slice's t; with
`modules:` (config/modules.py), its module's settings come first.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from mergepipe.config.fields import check_density, check_gamma
from mergepipe.config.messages import describe
from mergepipe.config.modules import module_placements
from mergepipe.config.settings import Setting, layer_positions
from mergepipe.config.slices import placements
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS
from mergepipe.util.fs import canonical_json

if TYPE_CHECKING:
    from mergepipe.config.models import MergeConfig

KNOBS = ("density", "gamma")


def resolve_tensor_parameters(cfg: MergeConfig, names: Iterable[str]) -> dict[str, Any] | None:
    """The plan's `tensor_parameters` for `cfg` over the tensors `names`; None when the
    config has no per-tensor setting (then the plan has no `tensor_parameters` key, and its hash
    is that of the same config without the grammar).

    Raises:
        ConfigError: a weight no condition gives for some tensor, a value that is out of range
            for a tensor (naming the config key and the tensor), or a filter in no tensor name.
    """
    if not cfg.per_tensor:
        return None
    names = sorted(names)
    _check_filters(cfg, names)
    resolver = _Resolver(cfg, names)
    groups: list[dict[str, Any]] = []
    index: dict[bytes, int] = {}
    tensors: dict[str, int] = {}
    for name in names:
        group = resolver.group(name)
        gkey = canonical_json(group)
        if gkey not in index:  # groups numbered in first-use order over the sorted names
            index[gkey] = len(groups)
            groups.append(group)
        tensors[name] = index[gkey]
    return {"groups": groups, "tensors": tensors}


class _Resolver:
    """One tensor's group: its resolved per-tensor method parameters and each expert's own
    settings. `parts` are the slices or modules a tensor's own settings come from
    (`placed[name][0]` indexes them; None: the recipe's top level)."""

    def __init__(self, cfg: MergeConfig, names: list[str]):
        self.cfg = cfg
        self.method = METHODS[cfg.method]
        self.scalars = {k: v for k, v in cfg.parameters.items() if k not in cfg.param_settings}
        self.defaults = cfg.method_params.model_dump(mode="json", by_alias=True)
        if cfg.slices is not None:
            self.placed, self.parts, self.part_settings = (placements(cfg.slices, names, cfg.source), cfg.slices,
                                                           cfg.slice_settings)
        elif cfg.modules is not None:
            self.placed = module_placements(cfg.modules, names, cfg.source)
            self.parts, self.part_settings = cfg.modules, cfg.module_settings
        else:
            self.placed = {name: (None, t) for name, t in layer_positions(names).items()}
            self.parts, self.part_settings = [], []
        self.checked: dict[bytes, dict[str, Any]] = {}  # validated parameters, by the given values' bytes

    def group(self, name: str) -> dict[str, Any]:
        s, t = self.placed[name]
        where = f"{self.cfg.source}: tensor {name!r}"
        params = self._parameters(name, s, t, where)
        experts = {}
        for i, e in enumerate(self.cfg.experts):
            over = self._expert(i, e, name, s, t, params, where)
            if over:
                experts[e.name] = dict(sorted(over.items()))
        return {"parameters": dict(sorted(params.items())), "experts": dict(sorted(experts.items()))}

    def _parameters(self, name: str, s: int | str | None, t: float, where: str) -> dict[str, Any]:
        """The per-tensor method parameters: the recipe's settings, then the slice's or module's,
        evaluated last, winning where they give a value; validated once per distinct value set."""
        scopes = [self.cfg.param_settings] if s is None else [self.cfg.param_settings, self.part_settings[s]]
        given = {}
        for settings in scopes:
            for key, setting in settings.items():
                value = setting.evaluate(name, t)
                if value is not None:
                    given[key] = value
        key_bytes = canonical_json(given)
        if key_bytes not in self.checked:
            params_cls = self.method.params
            try:
                dumped = params_cls.model_validate({**self.scalars, **given}).model_dump(mode="json", by_alias=True)
            except ValidationError as err:
                raise ConfigError(f"{where}: {describe(err, params_cls, ('parameters',))}") from None
            self.checked[key_bytes] = {k: dumped[k] for k in sorted({*self.cfg.param_settings, *given})}
        return self.checked[key_bytes]

    def _expert(self, i: int, e, name: str, s: int | str | None, t: float, params: dict[str, Any],
                where: str) -> dict[str, float]:
        """Expert i's own settings for this tensor (precedence: the slice's entry for the expert,
        the expert's own, the method's per-tensor value, the method's default)."""
        in_slice = None if s is None else self.parts[s].experts.get(e.name)
        over = {}
        weight = self._weight(i, e, in_slice, name, t, where)
        if weight is not None:
            over["weight"] = weight
        for knob in KNOBS:
            value = self._knob_value(e, in_slice, knob, name, t, params)
            if value is not None:
                over[knob] = _knob(float(value), knob, f"{where}: experts[{i}].{knob}")
        if "density" in over or "gamma" in over:
            density = over.get("density", self.cfg.expert_density(e))
            gamma = over.get("gamma", self.cfg.expert_gamma(e))
            if isinstance(density, float) and isinstance(gamma, float) and density < 1 and \
                    density + gamma > 1 + 1e-12:
                raise ConfigError(f"{where}: experts[{i}]: density + gamma must be <= 1, "
                                  f"got {density!r} + {gamma!r}")
        return over

    @staticmethod
    def _weight(i: int, e, in_slice, name: str, t: float, where: str) -> float | None:
        """The expert's weight for this tensor where it is per tensor (a Setting, or a slice's
        own); None where the expert's plain weight applies."""
        weight = e.weight if in_slice is None or in_slice.weight is None else in_slice.weight
        if not isinstance(weight, Setting) and weight is e.weight:
            return None
        w = weight.evaluate(name, t) if isinstance(weight, Setting) else weight
        if w is None:
            raise ConfigError(f"{where}: experts[{i}].weight: no condition matches this tensor; "
                              "add a condition without a filter ({value: ...})")
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise ConfigError(f"{where}: experts[{i}].weight: must be a finite number, got {w!r}")
        return float(w)

    def _knob_value(self, e, in_slice, knob: str, name: str, t: float, params: dict[str, Any]):
        """The expert's density or gamma for this tensor, or None where none is per tensor."""
        own = getattr(e, knob)
        from_slice = in_slice is not None and getattr(in_slice, knob) is not None
        if from_slice:
            own = getattr(in_slice, knob)
        if not isinstance(own, Setting) and not from_slice and knob not in params:
            return None
        value = own.evaluate(name, t) if isinstance(own, Setting) else own
        if value is None:
            value = params.get(knob, self.defaults.get(knob))
        return value


def _check_filters(cfg: MergeConfig, names: list[str]) -> None:
    """A condition whose filter is in no tensor name is a typo (`self_atn`): mergekit would let
    it apply nowhere, silently merging with the fallback value everywhere; here it is an error."""
    settings = {f"parameters.{k}": s for k, s in cfg.param_settings.items()}
    for i, e in enumerate(cfg.experts):
        for knob in ("weight", *KNOBS):
            if isinstance(getattr(e, knob), Setting):
                settings[f"experts[{i}].{knob}"] = getattr(e, knob)
    for i, (s, parsed) in enumerate(zip(cfg.slices or (), cfg.slice_settings)):
        settings.update({f"slices[{i}].parameters.{k}": v for k, v in parsed.items()})
        for name, e in s.experts.items():
            settings.update({f"slices[{i}].experts.{name}.{k}": v
                             for k, v in vars(e).items() if isinstance(v, Setting)})
    for module, m in (cfg.modules or {}).items():
        settings.update({f"modules.{module}.parameters.{k}": v for k, v in cfg.module_settings[module].items()})
        for name, e in m.experts.items():
            settings.update({f"modules.{module}.experts.{name}.{k}": v
                             for k, v in vars(e).items() if isinstance(v, Setting)})
    for key, setting in settings.items():
        for flt, _ in setting.conditions:
            if flt not in (None, "*") and not any(flt in n for n in names):
                raise ConfigError(f"{cfg.source}: {key}: filter {flt!r} is in no tensor name of the base, so "
                                  "its condition would apply nowhere; check the spelling")


def _knob(value: float, knob: str, where: str) -> float:
    try:
        (check_density if knob == "density" else check_gamma)(value)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    return value
