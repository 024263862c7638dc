"""Per-tensor method state for plans with `tensor_parameters` (plan/tensor_params.py).

A merge keeps one state (typed parameters, experts' weights and knobs, compiled kernel)
for the plan's top-level values; a tensor whose group differs gets a copy built for that
group, once per group, so a tensor's block sees exactly its own resolved parameters.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mergepipe.plan.tensor_params import group_index, view


class TensorVariants:
    """`get(state, tensor)`: the merge state for `tensor` (the given one when it has no group)."""

    def __init__(self, plan: dict, rebuild: Callable[[Any, dict, list[dict]], Any]) -> None:
        self.plan = plan
        self.rebuild = rebuild  # (state, parameters, plan experts) -> state for them
        self.cache: dict[int, Any] = {}

    def get(self, state: Any, tensor: str) -> Any:
        g = group_index(self.plan, tensor)
        if g is None:
            return state
        if g not in self.cache:
            params, experts = view(self.plan, g)
            self.cache[g] = self.rebuild(state, params, experts)
        return self.cache[g]
