"""Property tests of the config loader (issue 5): any params.yaml text, any parsed value,
any single-field edit of a valid config, any command-line override: a config whose
normalized form is canonical JSON, or a one-line ConfigError; never another exception."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mergepipe.cli import one_line
from mergepipe.config.params import config_from_dict, load_config
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS
from mergepipe.util.fs import canonical_json

SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=10)
           | st.sampled_from(["full", "10%", "0", "-1", "1e400", "NaN", "1MiB", "0.5", "../x", "", "ties"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)

VALID = {
    "base": "models/base",
    "experts": [{"name": "a", "path": "models/a", "weight": 1.0},
                {"name": "b", "path": "models/b", "weight": 0.5, "density": 0.5}],
    "method": "ties",
    "parameters": {"lambda": 1.0, "density": 0.5},
    "seed": 0, "budget": "25%", "block_bytes": "1MiB",
    "output": {"dir": "merged", "dtype": None, "shard_bytes": None},
    "cache_dir": ".mergepipe", "nonfinite": "error",
}


def check(fn, *args, **kwargs):
    try:
        cfg = fn(*args, **kwargs)
    except ConfigError as e:
        assert "\n" not in one_line(str(e)) and len(str(e)) < 20_000, str(e)[:300]
        return None
    canonical_json(cfg.normalized())  # plans hash it: finite, JSON-able
    assert cfg.method in METHODS and cfg.experts
    assert 0 <= cfg.budget.resolve(10**12) <= 10**12 or cfg.budget.kind == "bytes"
    return cfg


def _paths(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*path, i))


def test_the_valid_config_is_valid(tmp_path):
    assert check(config_from_dict, copy.deepcopy(VALID), root=tmp_path) is not None


@SETTINGS
@given(text=st.text(max_size=300))
@example(text="")
@example(text="!!python/object/apply:os.system ['touch /tmp/mergepipe-yaml-rce']")
@example(text="base: &a [*a]")
@example(text="a: 1\na: 2\n")
def test_any_yaml_text(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    check(load_config, p)
    assert not Path("/tmp/mergepipe-yaml-rce").exists()


@SETTINGS
@given(value=json_values)
def test_any_parsed_value(tmp_path, value):
    check(config_from_dict, value, root=tmp_path)


@SETTINGS
@given(data=st.data(), value=json_values)
def test_one_field_of_a_valid_config_edited(tmp_path, data, value):
    cfg = copy.deepcopy(VALID)
    cfg["method"] = data.draw(st.sampled_from(sorted(METHODS)))
    path = data.draw(st.sampled_from([p for p in _paths(cfg) if p]))
    node = cfg
    for k in path[:-1]:
        node = node[k]
    action = data.draw(st.sampled_from(["set", "delete", "add"]))
    if action == "set":
        node[path[-1]] = value
    elif action == "delete":
        del node[path[-1]]
    elif isinstance(node, dict):
        node[data.draw(st.text(max_size=8))] = value
    check(config_from_dict, cfg, root=tmp_path)


@SETTINGS
@given(text=st.text(max_size=300), method=st.sampled_from(sorted(METHODS)))
def test_yaml_dump_of_an_edited_config(tmp_path, text, method):
    """Valid YAML around a valid config, with one value replaced by arbitrary text."""
    cfg = copy.deepcopy(VALID)
    cfg["method"] = method
    cfg["parameters"] = {"density": text} if method != "slerp" else {"t": text}
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(cfg))
    check(load_config, p)


@SETTINGS
@given(budget=st.text(max_size=20) | st.sampled_from(["0", "-5%", "0%", "100.0001%", "1e999", "nan", "full"]),
       out=st.text(max_size=20))
def test_command_line_overrides(tmp_path, budget, out):
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(VALID))
    check(load_config, p, overrides={"budget": budget})
    if out and "\0" not in out:
        check(load_config, p, overrides={"output": {"dir": str(tmp_path / out)}})


# Config-loader bugs this suite found (deep nesting, alias bombs), kept as regressions.

@pytest.mark.parametrize("text", ["base: " + "[" * 5000 + "]" * 5000, "base: " + "{a: " * 3000 + "1" + "}" * 3000])
def test_deeply_nested_yaml(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    check(load_config, p)


def test_alias_bomb_gives_a_short_error(tmp_path):
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 5):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    lines += ["base: *a4", "experts: []", "method: ties"]
    p = tmp_path / "params.yaml"
    p.write_text("\n".join(lines) + "\n")
    check(load_config, p)
