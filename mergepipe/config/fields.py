"""params.yaml field types: the annotated pydantic types, their validators and JSON-schema spellings.

Validators raise ValueError; pydantic turns them into field errors, which
config/messages.py renders as "<file>: <key path>: <message>". Sizes and budgets are
parsed by the one grammar in mergepipe.units (block sizes by checkpoint.blocks).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, PlainSerializer, PlainValidator,
                      WithJsonSchema, WrapValidator)

from mergepipe.checkpoint.blocks import MAX_BLOCK_BYTES, MIN_BLOCK_BYTES, parse_block_bytes
from mergepipe.config.settings import is_setting, parse_setting
from mergepipe.units import BUDGET_PATTERN, SIZE_PATTERN, Budget, UnitError, parse_budget, parse_bytes, short_repr

DEFAULT_CACHE_DIR = ".mergepipe"
DEFAULT_OUTPUT_DIR = "merged"
MAX_SEED = (1 << 63) - 1
MIN_SHARD_BYTES = MIN_BLOCK_BYTES  # output.shard_bytes
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME_RE = re.compile(NAME_PATTERN)


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError("must be 1-128 characters of letters, digits, '.', '_', '-', "
                         f"starting with a letter or digit (it names files), got {name!r}")
    return name


def _check_path(value: Any) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a path string, got {type(value).__name__} {short_repr(value)}")
    if not value.strip():
        raise ValueError("must be a non-empty path")
    if "\0" in value:
        raise ValueError("must not contain NUL characters")
    return Path(value)


def check_density(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {short_repr(value)}")
    return value


def check_gamma(value: float) -> float:
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {short_repr(value)}")
    return value


def _bytes_detail(value: int | str) -> int:
    try:
        return parse_bytes(value)
    except UnitError as err:  # the key path already says what the value is
        raise ValueError(err.detail) from None


def _parse_block_bytes(value: Any) -> int:
    try:
        return parse_block_bytes(value)
    except UnitError as err:  # the key path already says what the value is
        raise ValueError(err.detail) from None


def _parse_shard_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be a byte count or size like '2GiB', got {short_repr(value)}")
    size = _bytes_detail(value)
    if size < MIN_SHARD_BYTES:
        raise ValueError(f"must be at least 4KiB, got {short_repr(value)} ({size} bytes)")
    return size


def _parse_budget_field(value: Any) -> Budget:
    if not isinstance(value, Budget | str | int | float) or isinstance(value, bool):
        raise ValueError(f"must be 'full', a percentage, a fraction or a size, got {short_repr(value)}")
    try:
        return parse_budget(value)
    except UnitError as err:
        raise ValueError(err.detail) from None


_PATH_SCHEMA = {"type": "string", "minLength": 1}
_SIZE_SCHEMA = {"type": "string", "pattern": SIZE_PATTERN}

Name = Annotated[str, Field(strict=True), AfterValidator(_check_name),
                 WithJsonSchema({"type": "string", "pattern": NAME_PATTERN})]
ConfigPath = Annotated[Path, BeforeValidator(_check_path), WithJsonSchema(_PATH_SCHEMA),
                       PlainSerializer(str)]
Weight = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Density = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(check_density),
                    WithJsonSchema({"type": "number", "exclusiveMinimum": 0, "maximum": 1})]
Gamma = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(check_gamma),
                  WithJsonSchema({"type": "number", "minimum": 0, "exclusiveMaximum": 1})]
BlockBytes = Annotated[int, PlainValidator(_parse_block_bytes), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": MIN_BLOCK_BYTES, "maximum": MAX_BLOCK_BYTES}, _SIZE_SCHEMA]})]
ShardBytes = Annotated[int, PlainValidator(_parse_shard_bytes), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": MIN_SHARD_BYTES}, _SIZE_SCHEMA]})]
BudgetField = Annotated[Budget, PlainValidator(_parse_budget_field), PlainSerializer(str),
                        WithJsonSchema({"anyOf": [
                            {"type": "string", "pattern": BUDGET_PATTERN},
                            {"type": "integer", "minimum": 1},
                            {"type": "number", "exclusiveMinimum": 0, "maximum": 1}]})]



def setting_schema(leaf: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of a per-tensor setting (config/settings.py) whose values match `leaf`."""
    gradient = {"type": "array", "minItems": 1, "items": leaf}
    condition = {"type": "object", "additionalProperties": False, "required": ["value"],
                 "properties": {"filter": {"type": "string", "minLength": 1},
                                "value": {"anyOf": [leaf, gradient]}}}
    return {"anyOf": [gradient, condition, {"type": "array", "minItems": 1, "items": condition}]}


def _scalar_or_setting(value: Any, handler: Any) -> Any:
    """A scalar through the field's own validation; a list or mapping as a per-tensor
    Setting whose every value goes through that same validation."""
    if is_setting(value):
        return parse_setting(value, handler)
    return handler(value)


def per_tensor(leaf_schema: dict[str, Any]) -> tuple[Any, ...]:
    """Annotated metadata that lets a numeric field also take a per-tensor setting."""
    return (WrapValidator(_scalar_or_setting),
            WithJsonSchema({"anyOf": [leaf_schema, setting_schema(leaf_schema)]}),
            PlainSerializer(lambda v: v.to_json() if is_setting(v) else v))


_DENSITY_SCHEMA = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_GAMMA_SCHEMA = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
TensorWeight = Annotated[Weight, *per_tensor({"type": "number"})]
TensorDensity = Annotated[Density, *per_tensor(_DENSITY_SCHEMA)]
TensorGamma = Annotated[Gamma, *per_tensor(_GAMMA_SCHEMA)]

OutputDtype = Literal["bfloat16", "float16", "float32"]

MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True)
