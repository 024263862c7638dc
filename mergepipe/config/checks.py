"""Checks across params.yaml fields: unique expert names, per-expert density/gamma
against the method's parameters, weight sums of normalizing methods.

They raise ValueError inside the model validator, so errors carry the key path.
"""
from __future__ import annotations

import math
from decimal import Decimal
from typing import TYPE_CHECKING

from pydantic import BaseModel

from mergepipe.config.fields import check_density, check_gamma
from mergepipe.config.settings import is_setting

if TYPE_CHECKING:
    from mergepipe.config.models import ExpertConfig


def _decimal(value: float) -> Decimal:
    # Sums of user-written decimals: 0.8 + 0.2 must be 1, not 1 + 2**-53.
    return Decimal(repr(float(value)))


def check_density_gamma(density: float, gamma: float, where: str) -> None:
    # density 1 keeps the delta untouched and gamma is unused (as in mergekit),
    # so breadcrumbs' defaults (1.0, 0.01) stay valid.
    if density < 1 and _decimal(density) + _decimal(gamma) > 1:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}density + gamma must be <= 1, got {density!r} + {gamma!r}; "
                         "lower one of them")


def check_unique_names(experts: list[ExpertConfig]) -> None:
    # Case-insensitive: names become file names, and some file systems fold case.
    seen: dict[str, int] = {}
    for i, expert in enumerate(experts):
        key = expert.name.lower()
        if key == "base":  # the plan and the manifest name the base "base": an expert's name must differ
            raise ValueError(f"experts[{i}].name: {expert.name!r} is the name plans and manifests give the "
                             "base model; name the expert otherwise")
        if key in seen:
            raise ValueError(f"experts[{i}].name: duplicate expert name {expert.name!r} "
                             f"(experts[{seen[key]}] is {experts[seen[key]].name!r}); "
                             "names must be unique, ignoring case")
        seen[key] = i


def has_param(params_cls: type[BaseModel], key: str) -> bool:
    return any(name == key or field.alias == key
               for name, field in params_cls.model_fields.items())


def effective(expert: ExpertConfig, key: str, params: BaseModel) -> float | None:
    own = getattr(expert, key)
    if own is not None:
        return own
    if not has_param(type(params), key):
        return None
    value = getattr(params, key, None)
    return None if value is None else float(value)


def check_expert_overrides(experts: list[ExpertConfig], method: str,
                            params_cls: type[BaseModel], params: BaseModel) -> None:
    for key in ("density", "gamma"):
        if has_param(params_cls, key):
            continue
        for i, expert in enumerate(experts):
            if getattr(expert, key) is not None:
                raise ValueError(f"experts[{i}].{key}: method {method!r} takes no {key}; "
                                 "remove it")
    # The method's own defaults must be valid per-expert values too, because
    # normalized() writes them onto every expert.
    for key, check in (("density", check_density), ("gamma", check_gamma)):
        value = getattr(params, key, None) if has_param(params_cls, key) else None
        if value is not None:
            try:
                check(float(value))
            except ValueError as err:
                raise ValueError(f"parameters.{key}: {err}") from None
    for i, expert in enumerate(experts):
        density = effective(expert, "density", params)
        gamma = effective(expert, "gamma", params)
        if is_setting(density) or is_setting(gamma):
            continue  # per tensor: checked where resolved (config/tensor_params.py)
        if density is not None and gamma is not None:
            # blame the key the user has to change
            own = expert.density is not None or expert.gamma is not None
            check_density_gamma(density, gamma, f"experts[{i}]" if own else "parameters")


def check_weight_sum(experts: list[ExpertConfig], method: str, params: BaseModel) -> None:
    if not getattr(params, "normalize", False):
        return
    base_weight = getattr(params, "base_weight", None) or 0.0
    if any(is_setting(e.weight) for e in experts):
        return  # per-tensor weights: the method refuses a zero sum tensor by tensor
    weights = [e.weight for e in experts] + [float(base_weight)]
    try:
        total = math.fsum(weights)
        scale = math.fsum(abs(w) for w in weights)
    except OverflowError:  # finite weights whose sum is not (1e308 + 1e308)
        raise ValueError(f"experts: weights sum past float64's range but method {method!r} normalizes "
                         "by their sum; scale the weights down") from None
    if scale == 0 or abs(total) <= 1e-9 * scale:
        raise ValueError(f"experts: weights sum to {total!r} but method {method!r} normalizes "
                         "by their sum; change the weights or set parameters.normalize: false")
