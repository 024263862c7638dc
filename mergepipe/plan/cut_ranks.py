"""Which rank cuts a merge will ask for beyond the delta index's grid: per expert and tensor,
the ranks its magnitude trim asks (the method's `cut_ranks` at the tensor's density and gamma:
its own value, else the method's, per-tensor groups laid over them) that `requested_ranks`
does not hold. Empty for a config whose values are all on the grid, and for every method that
cuts no ranks: such a plan has no `cuts` record and keeps its hash.

Tensors whose every block is byte-identical to the base are left out: their delta is zero, no
block of theirs is merged, so no cut is asked of them (engine/cuts.py would refuse one).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES
from mergepipe.index.columns import delta_rows
from mergepipe.index.ranks import on_grid, requested_ranks
from mergepipe.methods import get_method
from mergepipe.methods.base import ExpertBlock, expert_knobs
from mergepipe.plan.tensor_params import group_index, view

Wanted = dict[str, dict[str, tuple[int, ...]]]  # expert -> tensor -> ascending ranks
_DENSITY = ExpertBlock.__dataclass_fields__["density"].default  # what a trim uses when nothing sets it
_GAMMA = ExpertBlock.__dataclass_fields__["gamma"].default


def _values(plan: dict) -> Iterable[object]:
    """Every density and gamma the plan gives: top level, experts, per-tensor groups."""
    yield from (plan["parameters"].get(k) for k in ("density", "gamma"))
    yield from (e.get(k) for e in plan["experts"] for k in ("density", "gamma"))
    for g in (plan.get("tensor_parameters") or {}).get("groups", ()):
        yield from (g["parameters"].get(k) for k in ("density", "gamma"))
        yield from (v for over in g["experts"].values() for k, v in over.items() if k in ("density", "gamma"))


def off_grid(plan: dict) -> bool:
    """Some density or gamma of the plan is off the two-decimal grid (then cuts may be missing)."""
    return any(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < 1 and not on_grid(v)
               for v in _values(plan))


def wanted_cuts(plan: dict, base_index, deltas: dict) -> Wanted:
    """expert -> tensor -> the ranks its trim asks that the index lacks (experts and tensors
    without any left out). `plan`: the plan's JSON form, or a request's pieces in it (method,
    parameters, experts with name/density/gamma, tensor_parameters)."""
    method = get_method(plan["method"])
    if method.cut_ranks is None or not off_grid(plan):
        return {}
    names = list(base_index.tensors.names)
    numel = {n: math.prod(s) for n, d, s in zip(names, base_index.tensors.dtypes, base_index.tensors.shapes)
             if d in FLOAT_DTYPES}
    views: dict[int | None, list[tuple[str, float, float]]] = {}
    out: Wanted = {}
    for e in plan["experts"]:
        identical = {n: all(same) for n, (_, same, _) in zip(names, delta_rows(deltas[e["name"]].tensors, names))}
        for name, n in numel.items():
            if identical[name] or n < 2:
                continue
            group = group_index(plan, name)
            if group not in views:
                views[group] = _knobs(method, *view(plan, group))
            density, gamma = next((d, g) for x, d, g in views[group] if x == e["name"])
            extra = tuple(r for r in method.cut_ranks(density, gamma, n) if r not in _stored(n))
            if extra:
                out.setdefault(e["name"], {})[name] = extra
    return out


def _knobs(method, parameters: dict, experts: list[dict]) -> list[tuple[str, float, float]]:
    """(expert, density, gamma) as the merge resolves them for one parameter group."""
    params = method.params.model_validate(parameters)
    out = []
    for e in experts:
        k = expert_knobs(params, e)
        out.append((e["name"], k.get("density", _DENSITY), k.get("gamma", _GAMMA)))
    return out


_STORED: dict[int, frozenset[int]] = {}


def _stored(n: int) -> frozenset[int]:
    got = _STORED.get(n)
    if got is None:
        got = _STORED[n] = frozenset(requested_ranks(n))
    return got
