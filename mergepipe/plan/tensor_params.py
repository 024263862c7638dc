"""A plan's per-tensor parameters (`tensor_parameters`, see config/tensor_params.py): the
parameters and expert entries a tensor is merged with, and their check on a plan from disk.

`view(plan, group)` is what the engine and the planner use: the plan's `parameters` and
`experts` with one group's values laid over them. A tensor the plan does not list (or a
plan without `tensor_parameters`) uses the top-level values.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from mergepipe.errors import ConfigError

EXPERT_KEYS = ("weight", "density", "gamma")


def group_index(plan: dict, tensor: str) -> int | None:
    """The group of `tensor`, or None when it uses the plan's top-level values."""
    tp = plan.get("tensor_parameters")
    return None if tp is None else tp["tensors"].get(tensor)


def view(plan: dict, group: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(parameters, experts) of `group` (None: the top-level ones), experts in plan order."""
    if group is None:
        return plan["parameters"], plan["experts"]
    g = plan["tensor_parameters"]["groups"][group]
    params = {**plan["parameters"], **g["parameters"]}
    experts = [{**e, **g["experts"].get(e["name"], {})} for e in plan["experts"]]
    return params, experts


def check(plan: dict, method, where: str) -> None:
    """A plan's `tensor_parameters`: groups the method accepts, expert keys of the plan's
    experts with finite values, tensors that point at a group. Raises ConfigError."""
    tp = plan.get("tensor_parameters")
    if tp is None:
        return
    if not isinstance(tp, dict) or set(tp) != {"groups", "tensors"} or not isinstance(tp["groups"], list) \
            or not isinstance(tp["tensors"], dict):
        raise ConfigError(f"{where}: plan key tensor_parameters: must be {{groups: [...], tensors: {{...}}}}")
    names = {e["name"] for e in plan["experts"]}
    for i, g in enumerate(tp["groups"]):
        key = f"tensor_parameters.groups.{i}"
        if not isinstance(g, dict) or set(g) != {"parameters", "experts"} or \
                not isinstance(g["parameters"], dict) or not isinstance(g["experts"], dict):
            raise ConfigError(f"{where}: plan key {key}: must be {{parameters, experts}}")
        try:
            method.params.model_validate({**plan["parameters"], **g["parameters"]})
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(f"{where}: plan key {key}.parameters: {err['msg']}") from None
        for name, over in g["experts"].items():
            if name not in names or not isinstance(over, dict) or not set(over) <= set(EXPERT_KEYS):
                raise ConfigError(f"{where}: plan key {key}.experts.{name}: not an expert of the plan "
                                  f"with keys among {', '.join(EXPERT_KEYS)}")
            for k, v in over.items():
                if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                    raise ConfigError(f"{where}: plan key {key}.experts.{name}.{k}: must be a finite number")
    n = len(tp["groups"])
    for tensor, g in tp["tensors"].items():
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < n:
            raise ConfigError(f"{where}: plan key tensor_parameters.tensors.{tensor}: not a group index")
