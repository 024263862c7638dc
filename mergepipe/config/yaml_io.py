"""Reading params.yaml: a YAML safe loader that refuses duplicate keys, with one-line ConfigErrors."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from mergepipe.errors import ConfigError


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


MAX_YAML_BYTES = 16 << 20  # a config is kilobytes; more is a model file, a log or /dev/zero given by mistake


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Read and parse a YAML file; every failure is a one-line ConfigError."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:  # at most MAX_YAML_BYTES + 1: never a whole model in memory
            data = f.read(MAX_YAML_BYTES + 1)
        if len(data) > MAX_YAML_BYTES:
            raise ConfigError(f"{source}: over {MAX_YAML_BYTES >> 20} MiB, not a config file (a model file "
                              "or a log given by mistake?)")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read: {err.strerror}") from None
    return parse_yaml(text, source=source)
