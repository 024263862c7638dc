"""Reading params.yaml and mergekit YAML: a YAML safe loader that refuses duplicate keys and
documents whose aliases expand past MAX_YAML_VALUES (an "alias bomb": later code that walks
the values, a validator or an error message's repr, would take exponential time and memory),
with one-line ConfigErrors."""
from __future__ import annotations

import os
from typing import Any

import yaml

from mergepipe.errors import ConfigError
from mergepipe.units import clip, short_repr


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
                None, None, f"unhashable key {short_repr(key)}", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {short_repr(key)}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)


MAX_YAML_VALUES = 100_000  # a config holds hundreds of values, counted with every alias expanded


class _AliasBomb(Exception):
    def __init__(self, values: int | None) -> None:
        self.values = values  # None: an alias inside its own anchor (a cycle)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node, limit: int) -> None:
    """Count the values of the composed document with every alias expanded, in time linear in
    its distinct nodes (an alias is the same node object, so each node is counted once);
    raise _AliasBomb past `limit` or on a cycle."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > limit:
                raise _AliasBomb(sizes[key])
        elif key in on_path:
            raise _AliasBomb(None)
        elif key not in sizes:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def parse_yaml(text: str, *, source: str) -> Any:
    """YAML safe_load that rejects duplicate keys and alias bombs; errors are one-line ConfigErrors."""
    loader = None
    try:
        loader = _UniqueKeyLoader(text)  # reads the stream: a control character is refused here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, MAX_YAML_VALUES)
        return loader.construct_document(node)
    except _AliasBomb as err:
        what = "an alias refers to its own anchor" if err.values is None else \
            f"over {MAX_YAML_VALUES:,} values once its aliases are expanded"
        raise ConfigError(f"{source}: refused YAML: {what} (an alias bomb?); a config holds hundreds "
                          "of values: write them out") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or "syntax error"
        raise ConfigError(f"{source}: invalid YAML{where}: {clip(problem)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: invalid YAML: {clip(str(err).splitlines()[0])}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
    except ValueError as err:  # a scalar the safe constructor cannot build: a 5,000-digit int, month 13
        raise ConfigError(f"{source}: invalid YAML value: {clip(str(err))}") from None
    finally:
        if loader is not None:
            loader.dispose()


MAX_YAML_BYTES = 16 << 20  # a config is kilobytes; more is a model file, a log or /dev/zero given by mistake


def read_yaml_text(path: str | os.PathLike[str]) -> str:
    """The text of a YAML file (at most MAX_YAML_BYTES); every failure is a one-line ConfigError."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:  # at most MAX_YAML_BYTES + 1: never a whole model in memory
            data = f.read(MAX_YAML_BYTES + 1)
        if len(data) > MAX_YAML_BYTES:
            raise ConfigError(f"{source}: over {MAX_YAML_BYTES >> 20} MiB, not a config file (a model file "
                              "or a log given by mistake?)")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read: {err.strerror}") from None


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Read and parse a YAML file; every failure is a one-line ConfigError."""
    return parse_yaml(read_yaml_text(path), source=os.fspath(path))
