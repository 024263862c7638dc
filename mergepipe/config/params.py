"""params.yaml: the public entry point of the typed merge configuration.

`load_config` / `config_from_dict` read, override, validate and resolve a config;
the pieces live beside this module, one concern each:

  fields.py     field types and validators (sizes and budgets via mergepipe.units)
  models.py     ExpertConfig, OutputConfig, MergeConfig and `normalized()`
  checks.py     checks across fields
  messages.py   ValidationError -> one line with the key path
  yaml_io.py    YAML reading (duplicate keys and alias bombs refused)
  overrides.py  dotted overrides
  paths.py      path resolution and overlap checks
  schema.py     JSON schema and schemas/params.schema.yaml

It reads the YAML file it is given and nothing else: it never opens a model, never
checks that paths exist (the index and plan layers do), never writes. Method
parameters are validated by the registered method's own params model, so the
config knows no method by name.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mergepipe.config.fields import DEFAULT_CACHE_DIR, DEFAULT_OUTPUT_DIR, MAX_SEED, NAME_PATTERN
from mergepipe.config.messages import describe
from mergepipe.config.models import ExpertConfig, MergeConfig, OutputConfig
from mergepipe.config.overrides import apply_overrides
from mergepipe.config.paths import resolve_paths
from mergepipe.config.schema import SCHEMA_HEADER, SCHEMA_URI, json_schema, render_schema_yaml
from mergepipe.config.yaml_io import parse_yaml, read_yaml
from mergepipe.errors import ConfigError

__all__ = [
    "DEFAULT_CACHE_DIR", "DEFAULT_OUTPUT_DIR", "MAX_SEED", "NAME_PATTERN", "SCHEMA_HEADER", "SCHEMA_URI",
    "ExpertConfig", "MergeConfig", "OutputConfig", "config_from_dict", "json_schema", "load_config",
    "parse_yaml", "read_yaml", "render_schema_yaml",
]


def config_from_dict(data: Any, *, source: str = "<dict>",
                     root: str | os.PathLike[str] | None = None,
                     overrides: dict[str, Any] | None = None) -> MergeConfig:
    """Validate a params dict.

    Args:
        data: the parsed params.yaml (a mapping).
        source: how to name it in error messages (the file path).
        root: folder that relative paths are relative to (default: the CWD).
        overrides: keys to replace before validation, e.g. {"budget": "10%"} or
            {"output.dir": "out"}; see `overrides.apply_overrides`.
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
        data = apply_overrides(data, overrides, source)
    try:
        cfg = MergeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {describe(err, MergeConfig)}") from None
    base_dir = Path(os.path.abspath(root if root is not None else os.getcwd()))
    return resolve_paths(cfg, base_dir, source)


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
