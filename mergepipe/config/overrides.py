"""Dotted overrides ("output.dir", "experts.1.weight") merged into a params dict before validation."""
from __future__ import annotations

import copy
from typing import Any

from mergepipe.errors import ConfigError


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any],
                     source: str) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `data`.

    Keys may be dotted ("output.dir", "experts.1.weight"); mapping values merge
    into mappings, anything else replaces.
    """
    result = copy.deepcopy(data)

    def merge(target: Any, key: Any, value: Any, shown: str) -> None:
        if isinstance(target, dict):
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                for sub_key, sub_value in value.items():
                    merge(target[key], sub_key, sub_value, f"{shown}.{sub_key}")
            else:
                target[key] = copy.deepcopy(value)
        elif isinstance(target, list) and isinstance(key, int) and -len(target) <= key < len(target):
            if isinstance(value, dict) and isinstance(target[key], dict):
                for sub_key, sub_value in value.items():
                    merge(target[key], sub_key, sub_value, f"{shown}.{sub_key}")
            else:
                target[key] = copy.deepcopy(value)
        else:
            raise ConfigError(f"{source}: override {shown!r}: no such key to set")

    for raw_key, value in overrides.items():
        parts: list[Any] = str(raw_key).split(".")
        target: Any = result
        for depth, part in enumerate(parts):
            if isinstance(target, list):
                if not part.lstrip("-").isdigit():
                    raise ConfigError(f"{source}: override {raw_key!r}: "
                                      f"{'.'.join(parts[:depth])} is a list; use an index")
                parts[depth] = part = int(part)
            if depth == len(parts) - 1:
                merge(target, part, value, str(raw_key))
                break
            if isinstance(target, dict):
                target = target.setdefault(part, {})
            elif isinstance(target, list) and -len(target) <= part < len(target):
                target = target[part]
            else:
                raise ConfigError(f"{source}: override {raw_key!r}: no such key to set")
    return result
