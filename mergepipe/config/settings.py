"""Per-tensor parameter settings: mergekit's grammar for a value that varies by tensor.

A setting is written where params.yaml takes a number (a method parameter, an expert's
weight, density or gamma), in the same grammar as mergekit's `ParameterSetting`:

  0.5                                  one value for every tensor (not a setting)
  [0, 0.5, 1]                          a gradient over the layers
  {filter: self_attn, value: 0.3}      one condition
  [{filter: self_attn, value: [0, 1]}, {filter: mlp, value: 0.7}, {value: 0.5}]

Evaluated for a tensor named N at layer position t (`layer_positions`) as mergekit
0.1.5 does (`config.evaluate_setting`): the first condition whose filter is absent, "*"
or a substring of N wins, and its value is evaluated; no match is "unset" (the next
scope, else the default, applies). A gradient of numbers v_0..v_{n-1} is interpolated
at s = t (n - 1): i = int(s), j = min(n - 1, i + 1), (1 - (s - i)) v_i + (s - i) v_j in
fp64; a gradient with a bool or string picks v_{int(s)}.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

Scalar = bool | int | float | str
Value = Scalar | tuple[Scalar, ...]

# A layer's tensors: "<prefix><layers|h|blocks|layer|block>.<i>.<rest>" (llama, gpt2, ...).
LAYER_RE = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block)\.)(\d+)\.")


@dataclass(frozen=True, slots=True)
class Setting:
    """A parsed per-tensor setting: conditions in order, each (filter or None, value)."""

    conditions: tuple[tuple[str | None, Value], ...]
    plain: bool = False  # written as a bare gradient list (kept for `to_json`)

    def evaluate(self, tensor: str, t: float) -> Scalar | None:
        """The value for `tensor` at layer position `t`, or None when no filter matches."""
        for flt, value in self.conditions:
            if flt is None or flt == "*" or (tensor and flt in tensor):
                return _at(value, t)
        return None

    def to_json(self) -> Any:
        """The setting in its canonical written form (feeds back to `parse_setting`)."""
        if self.plain:
            return list(self.conditions[0][1])
        out = []
        for flt, value in self.conditions:
            cond: dict[str, Any] = {} if flt is None else {"filter": flt}
            cond["value"] = list(value) if isinstance(value, tuple) else value
            out.append(cond)
        return out

    def leaves(self) -> Iterable[Scalar]:
        for _, value in self.conditions:
            yield from (value if isinstance(value, tuple) else (value,))


def _at(value: Value, t: float) -> Scalar:
    if not isinstance(value, tuple):
        return value
    scaled = t * (len(value) - 1)
    i0 = int(scaled)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return value[i0]
    i1 = min(len(value) - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * value[i0] + frac * value[i1]


def is_setting(value: Any) -> bool:
    """True for what only a setting can be (a list, a mapping or a parsed Setting)."""
    return isinstance(value, list | tuple | dict | Setting)


def _scalar(value: Any, check: Callable[[Any], Any]) -> Scalar:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be finite, got {value!r}")
    if not isinstance(value, bool | int | float | str):
        raise ValueError(f"a setting's values must be numbers, booleans or strings, got {value!r}")
    check(value)
    return value


def _value(value: Any, check: Callable[[Any], Any]) -> Value:
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError("a gradient must list at least one value")
        return tuple(_scalar(v, check) for v in value)
    return _scalar(value, check)


def parse_setting(value: Any, check: Callable[[Any], Any] = lambda v: v) -> Setting:
    """Parse a written setting; `check(leaf)` validates every value in it (raises ValueError).

    Raises:
        ValueError: malformed (empty, unknown condition keys, nested too deep).
    """
    if isinstance(value, Setting):
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"expected a value, a gradient list or a list of {{filter, value}}, got {value!r}")
    if not any(isinstance(v, dict) for v in value):
        return Setting(((None, _value(value, check)),), plain=True)
    conditions = []
    for cond in value:
        if not isinstance(cond, dict):
            raise ValueError(f"a list of conditions must hold only {{filter, value}} mappings, got {cond!r}")
        unknown = set(cond) - {"filter", "value"}
        if unknown:
            raise ValueError(f"unknown condition key {sorted(unknown)[0]!r}; expected filter, value")
        if "value" not in cond:
            raise ValueError(f"condition {cond!r} has no value")
        flt = cond.get("filter")
        if flt is not None and (not isinstance(flt, str) or not flt):
            raise ValueError(f"a filter must be a non-empty string, got {flt!r}")
        conditions.append((flt, _value(cond["value"], check)))
    return Setting(tuple(conditions))


def layer_positions(names: Iterable[str]) -> dict[str, float]:
    """t of every tensor: i / (L - 1) for layer i of a stack of L layers (1 when L = 1),
    0 outside the layers, as mergekit's planner gives its layers and pre/post weights.

    A stack is the tensors sharing a prefix before the layer number; L is one more than
    its largest layer number (so a VLM's vision and language stacks each have their own).
    """
    names = list(names)
    found: dict[str, tuple[str, int]] = {}
    count: dict[str, int] = {}
    for name in names:
        m = LAYER_RE.match(name)
        if m:
            prefix, i = m.group(1), int(m.group(2))
            found[name] = (prefix, i)
            count[prefix] = max(count.get(prefix, 0), i + 1)
    out = {}
    for name in names:
        if name not in found:
            out[name] = 0.0
            continue
        prefix, i = found[name]
        n = count[prefix]
        out[name] = i / (n - 1) if n > 1 else 1.0
    return out
