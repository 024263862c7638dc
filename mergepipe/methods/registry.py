"""Method registry: one decorator per method file; a duplicate name is an error.

A Method carries everything the plan, the engine and import-mergekit need to know about
it, so none of them names a method: its params model (defaults), its torch `fn`, what it
needs from the index (`magnitude`, `cosine`), how it scales each delta for the plan's bound
(`effective_weights`), optionally a compiled bf16 kernel (`compiled`), for a method that
couples experts over whole tensors its joint statistics (`joint`, methods/joint.py: then
every block is read for all experts or none), whether a delta sketch can stand in for a
delta (`sketchable`) and is the default below the full budget (`sketch_by_default`), and
how mergekit names and reads it (`mergekit`). docs/adding-a-method.md walks through one.
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
# (normalized parameters dict, expert name -> weight) -> expert name -> c_k such that the output
# is exactly W0 + sum_k c_k * delta_k; raises ValueError (why not) for parameters where it is not
DeltaCoefficients = Callable[[dict[str, Any], dict[str, float]], dict[str, float]]
# (typed params, plan experts) -> kernel: RawBlock -> output bytes (bf16 in, bf16 out)
KernelFactory = Callable[[BaseModel, list[dict]], Callable[[RawBlock], memoryview]]


def scaled_weights(params: dict[str, Any], weights: dict[str, float]) -> dict[str, float]:
    """|lambda * w_k|: how much delta_k is scaled in the output (the default)."""
    lam = float(params.get("lambda", 1.0))
    return {name: abs(lam * w) for name, w in weights.items()}


@dataclass(frozen=True, slots=True)
class Mergekit:
    """How mergekit 0.1.5 spells and reads the method (config/mergekit.py imports by these)."""

    aliases: tuple[str, ...] = ()  # other mergekit names for it (older spellings)
    # what an absent `base_model` means: None = a base is required; "first" = the first model
    # plays the base and its weight becomes parameters.base_weight (mergekit averages it in);
    # "member" = the first model plays the base and stays one of the averaged inputs
    # (karcher's include_base); "self" = the one model is base and expert
    no_base: str | None = None
    unweighted: bool = False  # its models take no weight (1.0 unless one is given)
    # per-model parameters that are method parameters here: every model must give the same value
    shared_model_keys: tuple[str, ...] = ()
    # the parameters mergekit's method reads: `shared` one value per tensor (from the slice, module
    # and global scopes), `per_input` one per model (its own scope first); a recipe's other
    # parameters are never read by mergekit, and import drops them (config/mergekit_ignored.py)
    shared: tuple[str, ...] = ()
    per_input: tuple[str, ...] = ()


# mergekit's generalized task arithmetic methods (task_arithmetic, ties, dare_*, breadcrumbs*, della*)
GTA_SHARED = ("int8_mask", "normalize", "rescale", "lambda")


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
    # (density, gamma, numel) -> the ranks 0 < r < numel a tensor's trim asks cuts at
    # (index/ranks.py: trim_ranks, band_ranks); set exactly for the magnitude methods
    cut_ranks: Callable[[float, float, int], tuple[int, ...]] | None = None
    max_experts: int | None = None
    # cosine: needs ExpertBlock.cosine, the whole-tensor angle between base and expert (slerp)
    cosine: bool = False
    # |scale| of each expert's delta in the output, for the plan's priorities and bound
    effective_weights: EffectiveWeights = scaled_weights
    # the output as W0 + sum_k c_k delta_k (an adapter output, output/adapter_out.py); None: never so
    delta_coefficients: DeltaCoefficients | None = None
    # compiled kernel for bf16 blocks written as bf16, same bytes as `fn`; None: `fn` only
    compiled: KernelFactory | None = None
    # typed params -> True when a block no expert is read for is NOT the base's rows (passthrough
    # with a scale): the engine then sends every float block through `fn` instead of copying it
    rewrites_base: Callable[[BaseModel], bool] | None = None
    # whole-tensor statistics coupling the experts (methods/joint.py); None: block-local
    joint: JointSpec | None = None
    # the output is a (sign-consensus) weighted sum of per-element sparsified deltas
    # (methods/_common.combine), so a delta sketch (index/sketch.py) can stand in for a delta:
    # a magnitude trim leaves a sketch as it is (ExpertBlock.sketched), DARE drops its
    # elements like any delta's. Not cosine, joint or per-tensor-statistics methods.
    sketchable: bool = False
    # a config without `plan:` gets the `sketch` strategy below the full budget (needs
    # sketchable; plan/strategies/default.py; EVAL.md "Delta sketches" measured which)
    sketch_by_default: bool = False
    mergekit: Mergekit = Mergekit()


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
             magnitude: bool = False, cut_ranks: Callable[[float, float, int], tuple[int, ...]] | None = None,
             max_experts: int | None = None, cosine: bool = False,
             effective_weights: EffectiveWeights = scaled_weights,
             delta_coefficients: DeltaCoefficients | None = None,
             compiled: KernelFactory | None = None,
             rewrites_base: Callable[[BaseModel], bool] | None = None,
             joint: JointSpec | None = None, sketchable: bool = False, sketch_by_default: bool = False,
             mergekit: Mergekit = Mergekit()) -> Callable[[MergeFn], MergeFn]:
    if magnitude != (cut_ranks is not None):
        raise ValueError(f"merge method {name!r}: a magnitude method names its cut_ranks, and only it")
    if sketch_by_default and not sketchable:
        raise ValueError(f"merge method {name!r}: sketch_by_default needs sketchable")
    if mergekit.no_base not in (None, "first", "member", "self"):
        raise ValueError(f"merge method {name!r}: mergekit.no_base {mergekit.no_base!r} is not first/member/self")

    def wrap(fn: MergeFn) -> MergeFn:
        if name in _registered or name not in NAMES:
            raise ValueError(f"merge method {name!r} registered twice, or missing from registry.NAMES")
        _registered[name] = Method(name=name, params=params, fn=fn, additive=additive, magnitude=magnitude,
                                   paper=paper, cut_ranks=cut_ranks, max_experts=max_experts, cosine=cosine,
                                   effective_weights=effective_weights, delta_coefficients=delta_coefficients,
                                   compiled=compiled,
                                   rewrites_base=rewrites_base, joint=joint, sketchable=sketchable,
                                   sketch_by_default=sketch_by_default, mergekit=mergekit)
        return fn
    return wrap


def every_method() -> list[Method]:
    """All registered methods, by name (imports every method module: ~0.1-0.2 s)."""
    return [METHODS[name] for name in sorted(METHODS)]


def mergekit_names() -> dict[str, str]:
    """mergekit method name (and alias) -> our method name."""
    return {mk: m.name for m in every_method() for mk in (m.name, *m.mergekit.aliases)}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        known = ", ".join(sorted(METHODS))
        raise ConfigError(f"unknown merge method {name!r}; known: {known}") from None
