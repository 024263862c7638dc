"""Method registry: one decorator per method file; a duplicate name is an error.

A Method carries everything the plan and the engine need to know about it, so neither
names a method: its params model (defaults), its torch `fn`, what it needs from the
index (`magnitude`, `cosine`), how it scales each delta for the plan's bound
(`effective_weights`), optionally a compiled bf16 kernel (`compiled`), and, for a
method that couples experts over whole tensors, its joint statistics (`joint`,
methods/joint.py: then every block is read for all experts or none).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from mergepipe.util.lazy import torch
from pydantic import BaseModel

from mergepipe.errors import ConfigError
from mergepipe.methods.base import BlockInputs, RawBlock
from mergepipe.methods.joint import JointSpec

MergeFn = Callable[[BlockInputs, BaseModel], "torch.Tensor"]
# (normalized parameters dict, expert name -> weight) -> expert name -> |scale of delta_k|
EffectiveWeights = Callable[[dict[str, Any], dict[str, float]], dict[str, float]]
# (typed params, plan experts) -> kernel: RawBlock -> output bytes (bf16 in, bf16 out)
KernelFactory = Callable[[BaseModel, list[dict]], Callable[[RawBlock], memoryview]]


def scaled_weights(params: dict[str, Any], weights: dict[str, float]) -> dict[str, float]:
    """|lambda * w_k|: how much delta_k is scaled in the output (the default)."""
    lam = float(params.get("lambda", 1.0))
    return {name: abs(lam * w) for name, w in weights.items()}


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
    # |scale| of each expert's delta in the output, for the plan's priorities and bound
    effective_weights: EffectiveWeights = scaled_weights
    # compiled kernel for bf16 blocks written as bf16, same bytes as `fn`; None: `fn` only
    compiled: KernelFactory | None = None
    # typed params -> True when a block no expert is read for is NOT the base's rows (passthrough
    # with a scale): the engine then sends every float block through `fn` instead of copying it
    rewrites_base: Callable[[BaseModel], bool] | None = None
    # whole-tensor statistics coupling the experts (methods/joint.py); None: block-local
    joint: JointSpec | None = None


# Every method, by the module that registers it (mergepipe/methods/<name>.py). A module is
# imported when its method is first looked up: each builds pydantic models (~5-10 ms), and a
# merge needs one method, not twenty (tests/test_methods_registry.py keeps this list true).
NAMES = ("arcee_fusion", "breadcrumbs", "breadcrumbs_ties", "dare_linear", "dare_ties", "della",
         "della_linear", "karcher", "linear", "model_stock", "multislerp", "nearswap", "nuslerp",
         "passthrough", "ram", "ramplus_tl", "sce", "slerp", "task_arithmetic", "ties")
_registered: dict[str, Method] = {}


class _Registry(MutableMapping[str, Method]):
    """name -> Method, importing the method's module on first lookup. Setting an item adds a
    method that has no module (tests do, with monkeypatch.setitem)."""

    def __getitem__(self, name: str) -> Method:
        if name not in _registered and name in NAMES:
            importlib.import_module(f"mergepipe.methods.{name}")
        return _registered[name]

    def __setitem__(self, name: str, method: Method) -> None:
        _registered[name] = method

    def __delitem__(self, name: str) -> None:
        del _registered[name]

    def __contains__(self, name: object) -> bool:
        return name in NAMES or name in _registered

    def __iter__(self) -> Iterator[str]:
        return iter([*NAMES, *(n for n in _registered if n not in NAMES)])

    def __len__(self) -> int:
        return len(NAMES) + sum(n not in NAMES for n in _registered)


METHODS: MutableMapping[str, Method] = _Registry()


def register(name: str, *, params: type[BaseModel], additive: bool, paper: str,
             magnitude: bool = False, max_experts: int | None = None, cosine: bool = False,
             effective_weights: EffectiveWeights = scaled_weights,
             compiled: KernelFactory | None = None,
             rewrites_base: Callable[[BaseModel], bool] | None = None,
             joint: JointSpec | None = None) -> Callable[[MergeFn], MergeFn]:
    def wrap(fn: MergeFn) -> MergeFn:
        if name in _registered or name not in NAMES:
            raise ValueError(f"merge method {name!r} registered twice, or missing from registry.NAMES")
        _registered[name] = Method(name, params, fn, additive, magnitude, paper, max_experts, cosine,
                                   effective_weights, compiled, rewrites_base, joint)
        return fn
    return wrap


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        known = ", ".join(sorted(METHODS))
        raise ConfigError(f"unknown merge method {name!r}; known: {known}") from None
