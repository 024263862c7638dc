"""The method's values for each tensor, for plans with `tensor_parameters` (plan/tensor_params.py).

A merge builds one group (typed parameters, experts' weights and knobs, compiled kernel) for
the plan's top-level values; a tensor whose `tensor_parameters` group differs gets that
group's, built once per group, so a tensor's block sees exactly its own resolved parameters.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mergepipe.plan.tensor_params import group_index, view


class TensorGroups:
    """`of(tensor)`: the group of values `tensor` is merged with (`top` where it has none of
    its own). `plan` is the mapping plan/tensor_params reads (parameters, experts,
    tensor_parameters); `build(parameters, plan experts)` makes a group."""

    def __init__(self, top: Any, plan: dict, build: Callable[[dict, list[dict]], Any]) -> None:
        self.top = top
        self.grouped = plan.get("tensor_parameters") is not None  # else every tensor has the top-level values
        self._plan = plan
        self._build = build
        self._cache: dict[int, Any] = {}

    def of(self, tensor: str) -> Any:
        if not self.grouped:
            return self.top
        g = group_index(self._plan, tensor)
        if g is None:
            return self.top
        if g not in self._cache:
            self._cache[g] = self._build(*view(self._plan, g))
        return self._cache[g]

    def has_own(self, tensor: str) -> bool:
        """Whether `tensor` has a group of its own (never packed with others: engine/work.py)."""
        return self.grouped and group_index(self._plan, tensor) is not None
