"""params.yaml: the typed merge configuration, its validation and its JSON schema.

Owns the pydantic models (extra keys forbidden everywhere), the one-line
`ConfigError`s that name the file and key path, the canonical `normalized()`
form that plans and manifests hash, and `json_schema()`, from which
schemas/params.schema.yaml is generated (scripts/gen_schema.py) for Snakemake.
It reads the YAML file it is given and nothing else: it never opens a model,
never checks that paths exist (the index and plan layers do), never writes.

Method parameters are validated by the registered method's own params model, so
this module knows no method by name.
"""
from __future__ import annotations

import copy
import math
import os
import re
import reprlib
import typing
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from mergepipe.checkpoint.blocks import DEFAULT_BLOCK_BYTES
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS
from mergepipe.units import Budget, UnitError, parse_budget, parse_bytes

DEFAULT_CACHE_DIR = ".mergepipe"
DEFAULT_OUTPUT_DIR = "merged"
MIN_BLOCK_BYTES = 4 << 10
MAX_BLOCK_BYTES = 1 << 30
MAX_SEED = (1 << 63) - 1
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME_RE = re.compile(NAME_PATTERN)
_SIZE_PATTERN = r"^\s*(\d+(\.\d*)?|\.\d+)\s*[A-Za-z]*\s*$"
_BUDGET_PATTERN = r"^\s*([Ff][Uu][Ll][Ll]|(\d+(\.\d*)?|\.\d+)\s*(%|[A-Za-z]*))\s*$"
SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"


# ---------------------------------------------------------------- field types
# Validators raise ValueError; pydantic turns them into field errors, which
# `_one_line` renders as "<file>: <key path>: <message>".

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def _short(value: Any) -> str:
    """A bounded repr: an error line must stay one short line whatever the user wrote."""
    return _REPR.repr(value)


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError("must be 1-128 characters of letters, digits, '.', '_', '-', "
                         f"starting with a letter or digit (it names files), got {name!r}")
    return name


def _check_path(value: Any) -> Path:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a path string, got {type(value).__name__} {_short(value)}")
    if not value.strip():
        raise ValueError("must be a non-empty path")
    if "\0" in value:
        raise ValueError("must not contain NUL characters")
    return Path(value)


def _check_density(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {_short(value)}")
    return value


def _check_gamma(value: float) -> float:
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {_short(value)}")
    return value


def _bytes_detail(value: int | str) -> int:
    try:
        return parse_bytes(value)
    except UnitError as err:  # the key path already says what the value is
        raise ValueError(err.detail) from None


def _parse_block_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be a byte count or size like '1MiB', got {_short(value)}")
    size = _bytes_detail(value)
    if not MIN_BLOCK_BYTES <= size <= MAX_BLOCK_BYTES:
        raise ValueError(f"must be between 4KiB and 1GiB, got {_short(value)} ({size} bytes)")
    return size


def _parse_shard_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be a byte count or size like '2GiB', got {_short(value)}")
    size = _bytes_detail(value)
    if size < MIN_BLOCK_BYTES:
        raise ValueError(f"must be at least 4KiB, got {_short(value)} ({size} bytes)")
    return size


def _parse_budget_field(value: Any) -> Budget:
    if not isinstance(value, Budget | str | int | float) or isinstance(value, bool):
        raise ValueError(f"must be 'full', a percentage, a fraction or a size, got {_short(value)}")
    try:
        return parse_budget(value)
    except UnitError as err:
        raise ValueError(err.detail) from None


_PATH_SCHEMA = {"type": "string", "minLength": 1}
_SIZE_SCHEMA = {"type": "string", "pattern": _SIZE_PATTERN}

Name = Annotated[str, Field(strict=True), AfterValidator(_check_name),
                 WithJsonSchema({"type": "string", "pattern": NAME_PATTERN})]
ConfigPath = Annotated[Path, BeforeValidator(_check_path), WithJsonSchema(_PATH_SCHEMA),
                       PlainSerializer(str)]
Weight = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Density = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(_check_density),
                    WithJsonSchema({"type": "number", "exclusiveMinimum": 0, "maximum": 1})]
Gamma = Annotated[float, Field(strict=True, allow_inf_nan=False), AfterValidator(_check_gamma),
                  WithJsonSchema({"type": "number", "minimum": 0, "exclusiveMaximum": 1})]
BlockBytes = Annotated[int, PlainValidator(_parse_block_bytes), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": MIN_BLOCK_BYTES, "maximum": MAX_BLOCK_BYTES}, _SIZE_SCHEMA]})]
ShardBytes = Annotated[int, PlainValidator(_parse_shard_bytes), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": MIN_BLOCK_BYTES}, _SIZE_SCHEMA]})]
BudgetField = Annotated[Budget, PlainValidator(_parse_budget_field), PlainSerializer(str),
                        WithJsonSchema({"anyOf": [
                            {"type": "string", "pattern": _BUDGET_PATTERN},
                            {"type": "integer", "minimum": 1},
                            {"type": "number", "exclusiveMinimum": 0, "maximum": 1}]})]

_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- models

class ExpertConfig(BaseModel):
    """One expert checkpoint. density/gamma override the method's parameters."""

    model_config = _MODEL_CONFIG
    name: Name = Field(description="unique, filename-safe label (letters, digits, . _ -)")
    path: ConfigPath = Field(description="Hugging Face model folder, relative to params.yaml")
    weight: Weight = Field(description="w_k; finite, may be negative")
    density: Density | None = Field(None, description="per-expert density in (0, 1]")
    gamma: Gamma | None = Field(None, description="per-expert gamma in [0, 1) (breadcrumbs)")

    @model_validator(mode="after")
    def _density_plus_gamma(self) -> ExpertConfig:
        if self.density is not None and self.gamma is not None:
            _check_density_gamma(self.density, self.gamma, "")
        return self


class OutputConfig(BaseModel):
    model_config = _MODEL_CONFIG
    dir: ConfigPath = Field(Path(DEFAULT_OUTPUT_DIR),
                            description="output model folder, relative to params.yaml")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="output dtype; null keeps the base's dtypes")
    shard_bytes: ShardBytes | None = Field(
        None, description="shard size; null mirrors the base's sharding")


class MergeConfig(BaseModel):
    """A validated params.yaml.

    After `load_config`/`config_from_dict`, `base`, `experts[i].path`,
    `output.dir` and `cache_dir` are absolute; `normalized()` shows them as
    written. `parameters` is what the user wrote; `method_params` is the typed,
    defaults-filled parameters object of the method.
    """

    model_config = _MODEL_CONFIG
    base: ConfigPath = Field(description="base model folder (W0), relative to params.yaml")
    experts: list[ExpertConfig] = Field(min_length=1, description="the experts W1..WK")
    method: Annotated[str, Field(strict=True)] = Field(description="registered merge method")
    parameters: Annotated[dict[str, Any], Field(strict=True)] = Field(
        default_factory=dict, description="method parameters (checked by the method)")
    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] = Field(
        0, description="seed for randomized methods (DARE)")
    budget: BudgetField = Field("full", validate_default=True,
                                description="most expert bytes to read: 'full', a "
                                "percentage or fraction of what a full merge reads (the "
                                "expert blocks that differ from the base), or a size")
    block_bytes: BlockBytes = Field(DEFAULT_BLOCK_BYTES, description="target block size")
    output: OutputConfig = Field(default_factory=OutputConfig)
    cache_dir: ConfigPath = Field(Path(DEFAULT_CACHE_DIR),
                                  description="indexes, plans and store, relative to params.yaml")
    nonfinite: Literal["error", "allow"] = Field(
        "error", description="what to do with NaN/Inf in an expert")

    _method_params: BaseModel | None = PrivateAttr(None)
    _written: dict[str, str] = PrivateAttr(default_factory=dict)
    _source: str = PrivateAttr("<dict>")

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in METHODS:
            raise ValueError(f"unknown merge method {method!r}; known: {', '.join(sorted(METHODS))}")
        return method

    @model_validator(mode="after")
    def _cross_checks(self) -> MergeConfig:
        _check_unique_names(self.experts)
        method = METHODS[self.method]
        try:
            params = method.params.model_validate(self.parameters)
        except ValidationError as err:
            raise ValueError(_describe(err, method.params, ("parameters",))) from None
        self._method_params = params
        if method.max_experts is not None and len(self.experts) > method.max_experts:
            limit = "exactly 1 expert" if method.max_experts == 1 else \
                f"at most {method.max_experts} experts"
            raise ValueError(f"experts: method {self.method!r} takes {limit}, "
                             f"got {len(self.experts)}")
        _check_expert_overrides(self.experts, self.method, method.params, params)
        _check_weight_sum(self.experts, self.method, params)
        return self

    # -------------------------------------------------------- derived values

    @property
    def method_params(self) -> BaseModel:
        """The method's typed parameters, defaults filled (e.g. `.lambda_`)."""
        if self._method_params is None:  # built by model_construct, never validated
            self._method_params = METHODS[self.method].params.model_validate(self.parameters)
        return self._method_params

    @property
    def source(self) -> str:
        """The file (or "<dict>") this config came from, for error messages."""
        return self._source

    def expert_density(self, expert: ExpertConfig) -> float | None:
        """The expert's density, else the method's; None if the method has none."""
        return _effective(expert, "density", self.method_params)

    def expert_gamma(self, expert: ExpertConfig) -> float | None:
        """The expert's gamma, else the method's; None if the method has none."""
        return _effective(expert, "gamma", self.method_params)

    def normalized(self) -> dict[str, Any]:
        """Canonical JSON-able form for plan hashes and manifests.

        Defaults filled, paths as written (relative to params.yaml), budget in
        its canonical string, sizes as ints, method parameters under their
        canonical (alias) names with defaults, each expert's effective density
        and gamma. Feeding it back to `config_from_dict` gives the same form.
        """
        def written(key: str, path: Path) -> str:
            return self._written.get(key, path.as_posix())

        experts = [{
            "name": e.name,
            "path": written(f"experts[{i}].path", e.path),
            "weight": e.weight,
            "density": self.expert_density(e),
            "gamma": self.expert_gamma(e),
        } for i, e in enumerate(self.experts)]
        return {
            "base": written("base", self.base),
            "experts": experts,
            "method": self.method,
            "parameters": self.method_params.model_dump(mode="json", by_alias=True),
            "seed": self.seed,
            "budget": str(self.budget),
            "block_bytes": self.block_bytes,
            "output": {
                "dir": written("output.dir", self.output.dir),
                "dtype": self.output.dtype,
                "shard_bytes": self.output.shard_bytes,
            },
            "cache_dir": written("cache_dir", self.cache_dir),
            "nonfinite": self.nonfinite,
        }


# ---------------------------------------------------------------- cross-field checks

def _decimal(value: float) -> Decimal:
    # Sums of user-written decimals: 0.8 + 0.2 must be 1, not 1 + 2**-53.
    return Decimal(repr(float(value)))


def _check_density_gamma(density: float, gamma: float, where: str) -> None:
    # density 1 keeps the delta untouched and gamma is unused (as in mergekit),
    # so breadcrumbs' defaults (1.0, 0.01) stay valid.
    if density < 1 and _decimal(density) + _decimal(gamma) > 1:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}density + gamma must be <= 1, got {density!r} + {gamma!r}; "
                         "lower one of them")


def _check_unique_names(experts: list[ExpertConfig]) -> None:
    # Case-insensitive: names become file names, and some file systems fold case.
    seen: dict[str, int] = {}
    for i, expert in enumerate(experts):
        key = expert.name.lower()
        if key in seen:
            raise ValueError(f"experts[{i}].name: duplicate expert name {expert.name!r} "
                             f"(experts[{seen[key]}] is {experts[seen[key]].name!r}); "
                             "names must be unique, ignoring case")
        seen[key] = i


def _has_param(params_cls: type[BaseModel], key: str) -> bool:
    return any(name == key or field.alias == key
               for name, field in params_cls.model_fields.items())


def _effective(expert: ExpertConfig, key: str, params: BaseModel) -> float | None:
    own = getattr(expert, key)
    if own is not None:
        return own
    if not _has_param(type(params), key):
        return None
    value = getattr(params, key, None)
    return None if value is None else float(value)


def _check_expert_overrides(experts: list[ExpertConfig], method: str,
                            params_cls: type[BaseModel], params: BaseModel) -> None:
    for key in ("density", "gamma"):
        if _has_param(params_cls, key):
            continue
        for i, expert in enumerate(experts):
            if getattr(expert, key) is not None:
                raise ValueError(f"experts[{i}].{key}: method {method!r} takes no {key}; "
                                 "remove it")
    # The method's own defaults must be valid per-expert values too, because
    # normalized() writes them onto every expert.
    for key, check in (("density", _check_density), ("gamma", _check_gamma)):
        value = getattr(params, key, None) if _has_param(params_cls, key) else None
        if value is not None:
            try:
                check(float(value))
            except ValueError as err:
                raise ValueError(f"parameters.{key}: {err}") from None
    for i, expert in enumerate(experts):
        density = _effective(expert, "density", params)
        gamma = _effective(expert, "gamma", params)
        if density is not None and gamma is not None:
            # blame the key the user has to change
            own = expert.density is not None or expert.gamma is not None
            _check_density_gamma(density, gamma, f"experts[{i}]" if own else "parameters")


def _check_weight_sum(experts: list[ExpertConfig], method: str, params: BaseModel) -> None:
    if not getattr(params, "normalize", False):
        return
    base_weight = getattr(params, "base_weight", None) or 0.0
    weights = [e.weight for e in experts] + [float(base_weight)]
    total = math.fsum(weights)
    scale = math.fsum(abs(w) for w in weights)
    if scale == 0 or abs(total) <= 1e-9 * scale:
        raise ValueError(f"experts: weights sum to {total!r} but method {method!r} normalizes "
                         "by their sum; change the weights or set parameters.normalize: false")


# ---------------------------------------------------------------- error rendering

def _loc_text(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _is_internal_loc(part: Any) -> bool:
    # pydantic adds tags like "function-after[...]" or "str" for union members
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "none",
                                                              "bool", "list", "dict"})


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # list[X], X | None, Annotated[X, ...]
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _allowed_keys(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str] | None:
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        model = _inner_model(field.annotation)
    if model is None:
        return None
    return [f.alias or n for n, f in model.model_fields.items()]


def _error_text(error: dict[str, Any], model: type[BaseModel] | None,
                loc: tuple[Any, ...]) -> str:
    kind = error["type"]
    message = str(error["msg"])
    value = error.get("input")
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"unknown key{hint}"
    if kind == "value_error" and message.startswith("Value error, "):
        return message[len("Value error, "):]
    if kind == "too_short" and loc and loc[-1] == "experts":
        return "must list at least one expert"
    if message.startswith("Input should be "):
        message = "must be " + message[len("Input should be "):]
    elif message[:1].isupper() and not message[1:2].isupper():
        message = message[0].lower() + message[1:]
    if kind in {"model_type", "dict_type"}:
        return f"must be a mapping, got {type(value).__name__}"
    if kind == "list_type":
        return f"must be a list, got {type(value).__name__}"
    if value is None or isinstance(value, str | int | float | bool):
        message += f", got {_short(value)}"
    elif not isinstance(value, dict | list):
        message += f", got {type(value).__name__}"
    return message


def _describe(err: ValidationError, model: type[BaseModel] | None,
              prefix: tuple[Any, ...] = ()) -> str:
    """One line for a whole ValidationError: first error's key path and message."""
    errors = err.errors()
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not _is_internal_loc(p))
    text = _error_text(first, model, loc)
    where = _loc_text(prefix + loc)
    line = f"{where}: {text}" if where else text
    more = len(errors) - 1
    if more:
        line += f" (and {more} more error{'s' if more > 1 else ''})"
    return line


# ---------------------------------------------------------------- loading

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (plain safe_load keeps the last)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode,
                              deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


def parse_yaml(text: str, *, source: str) -> Any:
    """YAML safe_load that rejects duplicate keys; errors are one-line ConfigErrors."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or "syntax error"
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: invalid YAML: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Read and parse a YAML file; every failure is a one-line ConfigError."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read: {err.strerror}") from None
    return parse_yaml(text, source=source)


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any],
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


def _absolute(root: Path, path: Path) -> Path:
    return Path(os.path.normpath(root / path.expanduser()))


def _overlaps(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _resolve_paths(cfg: MergeConfig, root: Path, source: str) -> MergeConfig:
    written = {"base": cfg.base.as_posix(), "output.dir": cfg.output.dir.as_posix(),
               "cache_dir": cfg.cache_dir.as_posix()}
    experts = []
    for i, expert in enumerate(cfg.experts):
        written[f"experts[{i}].path"] = expert.path.as_posix()
        experts.append(expert.model_copy(update={"path": _absolute(root, expert.path)}))
    resolved = cfg.model_copy(update={
        "base": _absolute(root, cfg.base),
        "experts": experts,
        "output": cfg.output.model_copy(update={"dir": _absolute(root, cfg.output.dir)}),
        "cache_dir": _absolute(root, cfg.cache_dir),
    })
    resolved._written = written
    resolved._source = source
    resolved._method_params = cfg._method_params

    inputs = [("base", resolved.base)] + [
        (f"experts[{i}].path", e.path) for i, e in enumerate(resolved.experts)]
    out = resolved.output.dir
    for key, path in inputs:
        if _overlaps(out, path):
            raise ConfigError(
                f"{source}: output.dir: {written['output.dir']!r} overlaps the input model "
                f"{key} ({written[key]!r}); write the merge to a separate folder")
    if _overlaps(resolved.cache_dir, out):
        raise ConfigError(
            f"{source}: cache_dir: {written['cache_dir']!r} overlaps output.dir "
            f"({written['output.dir']!r}); publishing the output would replace the cache")
    return resolved


def config_from_dict(data: Any, *, source: str = "<dict>",
                     root: str | os.PathLike[str] | None = None,
                     overrides: dict[str, Any] | None = None) -> MergeConfig:
    """Validate a params dict.

    Args:
        data: the parsed params.yaml (a mapping).
        source: how to name it in error messages (the file path).
        root: folder that relative paths are relative to (default: the CWD).
        overrides: keys to replace before validation, e.g. {"budget": "10%"} or
            {"output.dir": "out"}; see `_apply_overrides`.
    Returns:
        The config, with absolute paths.
    Raises:
        ConfigError: one line naming `source` and the key path.
    """
    if data is None:
        raise ConfigError(f"{source}: empty; expected a mapping with base, experts and method")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with base, experts and method, "
                          f"got {type(data).__name__}")
    if overrides:
        data = _apply_overrides(data, overrides, source)
    try:
        cfg = MergeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_describe(err, MergeConfig)}") from None
    base_dir = Path(os.path.abspath(root if root is not None else os.getcwd()))
    return _resolve_paths(cfg, base_dir, source)


def load_config(path: str | os.PathLike[str], *,
                overrides: dict[str, Any] | None = None) -> MergeConfig:
    """Read and validate params.yaml; relative paths are relative to its folder.

    Raises:
        ConfigError: unreadable file, invalid YAML or invalid config (one line,
            naming the file and the key path).
    """
    data = read_yaml(path)
    return config_from_dict(data, source=os.fspath(path), root=Path(path).parent,
                            overrides=overrides)


# ---------------------------------------------------------------- JSON schema

def _drop_titles(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_titles(v) for k, v in node.items()
                if not (k == "title" and isinstance(v, str))}
    if isinstance(node, list):
        return [_drop_titles(v) for v in node]
    return node


def json_schema() -> dict[str, Any]:
    """JSON schema (draft 2020-12) of params.yaml, for Snakemake and editors.

    Built from the pydantic models plus, per registered method, an if/then
    rule that checks `parameters` against that method's params model. Checks
    across fields (unique names, weight sums, path overlaps) are only in
    `load_config`, which the CLI runs.
    """
    schema = MergeConfig.model_json_schema(mode="validation", by_alias=True)
    defs = schema.setdefault("$defs", {})
    rules = []
    for name in sorted(METHODS):
        params_cls = METHODS[name].params
        params_schema = params_cls.model_json_schema(
            mode="validation", by_alias=True, ref_template="#/$defs/{model}")
        for key, sub in params_schema.pop("$defs", {}).items():
            if defs.setdefault(key, sub) != sub:
                raise RuntimeError(f"schema name clash on {key!r} (method {name!r})")
        key = params_cls.__name__
        if defs.setdefault(key, params_schema) != params_schema:
            raise RuntimeError(f"schema name clash on {key!r} (method {name!r})")
        rules.append({
            "if": {"properties": {"method": {"const": name}}, "required": ["method"]},
            "then": {"properties": {"parameters": {"$ref": f"#/$defs/{key}"}}},
        })
    schema["properties"]["method"]["enum"] = sorted(METHODS)
    if rules:
        schema["allOf"] = rules
    schema = _drop_titles(schema)
    schema = {"$schema": SCHEMA_URI, **schema,
              "description": "mergepipe params.yaml (generated from mergepipe.config.params; "
                             "regenerate with scripts/gen_schema.py)"}
    schema["$defs"] = dict(sorted(schema["$defs"].items()))
    return schema


SCHEMA_HEADER = ("# Generated by scripts/gen_schema.py from mergepipe.config.params.json_schema();\n"
                 "# do not edit. tests/test_config.py fails when it is stale.\n")


def render_schema_yaml() -> str:
    """The text of schemas/params.schema.yaml."""
    body = yaml.safe_dump(json_schema(), sort_keys=False, default_flow_style=False, width=100)
    return SCHEMA_HEADER + body
