"""Method registry: one decorator per method file; a duplicate name is an error."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from mergepipe.errors import ConfigError
from mergepipe.methods.base import BlockInputs

MergeFn = Callable[[BlockInputs, BaseModel], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    params: type[BaseModel]
    fn: MergeFn
    # additive: output is linear in the deltas, so the plan's omitted mass is a
    # certified bound on ||M_S - M||_F; otherwise it is reported as a heuristic.
    additive: bool
    # magnitude: needs exact per-tensor |delta| rank cuts (TIES / Breadcrumbs)
    magnitude: bool
    paper: str
    max_experts: int | None = None
    # cosine: needs ExpertBlock.cosine, the whole-tensor angle between base and expert (slerp)
    cosine: bool = False


METHODS: dict[str, Method] = {}


def register(name: str, *, params: type[BaseModel], additive: bool, paper: str,
             magnitude: bool = False, max_experts: int | None = None,
             cosine: bool = False) -> Callable[[MergeFn], MergeFn]:
    def wrap(fn: MergeFn) -> MergeFn:
        if name in METHODS:
            raise ValueError(f"merge method {name!r} registered twice")
        METHODS[name] = Method(name, params, fn, additive, magnitude, paper, max_experts, cosine)
        return fn
    return wrap


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        known = ", ".join(sorted(METHODS))
        raise ConfigError(f"unknown merge method {name!r}; known: {known}") from None
