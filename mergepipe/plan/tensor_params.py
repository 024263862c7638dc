"""A plan's per-tensor parameters (`tensor_parameters`, see config/tensor_params.py): the
parameters and expert entries a tensor is merged with, and their check on a plan from disk.

`overlay` lays one group's values over the plan's `parameters` and `experts`: what the
engine and `explain` merge a tensor with (PlanRecord.view on the typed plan, `view` on its
JSON form). A tensor the plan does not list (or a plan without `tensor_parameters`) uses
the top-level values.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from mergepipe.errors import ConfigError

EXPERT_KEYS = ("weight", "density", "gamma")


def group_of(tensor_parameters: dict | None, tensor: str) -> int | None:
    """The group of `tensor`, or None when it uses the plan's top-level values."""
    return None if tensor_parameters is None else tensor_parameters["tensors"].get(tensor)


def overlay(parameters: dict[str, Any], experts: list[dict[str, Any]], tensor_parameters: dict | None,
            group: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(parameters, expert entries) with `group`'s values laid over them (None: as given)."""
    if group is None:
        return parameters, experts
    g = tensor_parameters["groups"][group]
    return {**parameters, **g["parameters"]}, [{**e, **g["experts"].get(e["name"], {})} for e in experts]


def group_index(plan: dict, tensor: str) -> int | None:
    """group_of for a plan's JSON form."""
    return group_of(plan.get("tensor_parameters"), tensor)


def view(plan: dict, group: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(parameters, experts) of `group` (None: the top-level ones) of a plan's JSON form,
    experts in plan order (PlanRecord.view for the typed plan)."""
    return overlay(plan["parameters"], plan["experts"], plan.get("tensor_parameters"), group)


def check(plan, method, where: str) -> None:
    """A plan record's `tensor_parameters` (plan/record.py PlanRecord): groups the method
    accepts, expert keys of the plan's experts with finite values, tensors that point at a
    group. Raises ConfigError."""
    tp = plan.tensor_parameters
    if tp is None:
        return
    if not isinstance(tp, dict) or set(tp) != {"groups", "tensors"} or not isinstance(tp["groups"], list) \
            or not isinstance(tp["tensors"], dict):
        raise ConfigError(f"{where}: plan key tensor_parameters: must be {{groups: [...], tensors: {{...}}}}")
    for i, g in enumerate(tp["groups"]):
        _check_group(plan, method, i, g, where)
    n = len(tp["groups"])
    for tensor, g in tp["tensors"].items():
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < n:
            raise ConfigError(f"{where}: plan key tensor_parameters.tensors.{tensor}: not a group index")


def _check_group(plan, method, i: int, g: object, where: str) -> None:
    """Group `i`: {parameters, experts}, parameters the method accepts over the plan's, expert
    entries of the plan's experts with finite weight/density/gamma."""
    key = f"tensor_parameters.groups.{i}"
    if not isinstance(g, dict) or set(g) != {"parameters", "experts"} or \
            not isinstance(g["parameters"], dict) or not isinstance(g["experts"], dict):
        raise ConfigError(f"{where}: plan key {key}: must be {{parameters, experts}}")
    try:
        method.params.model_validate({**plan.parameters, **g["parameters"]})
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{where}: plan key {key}.parameters: {err['msg']}") from None
    names = set(plan.expert_names)
    for name, over in g["experts"].items():
        if name not in names or not isinstance(over, dict) or not set(over) <= set(EXPERT_KEYS):
            raise ConfigError(f"{where}: plan key {key}.experts.{name}: not an expert of the plan "
                              f"with keys among {', '.join(EXPERT_KEYS)}")
        for k, v in over.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ConfigError(f"{where}: plan key {key}.experts.{name}.{k}: must be a finite number")
