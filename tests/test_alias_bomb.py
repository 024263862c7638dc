"""Every message that quotes the user's input quotes a bounded part of it: a YAML "alias bomb"
(nested aliases that expand exponentially) is refused when it is read, and no error line
grows with what the user wrote. Also the other one-line errors of reading YAML."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mergepipe.config.mergekit import mergekit_to_params
from mergepipe.config.params import parse_yaml
from mergepipe.config.yaml_io import MAX_YAML_VALUES
from mergepipe.errors import ConfigError
from mergepipe.units import MAX_QUOTE_CHARS, short_repr


def _bomb(levels: int) -> str:
    """An anchor list of nine values, then each level a list of nine aliases of the one below:
    9**levels values once expanded, in about 55 bytes a level."""
    expr = "&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for i in range(1, levels):
        expr = f"&a{i} [{expr}, " + ", ".join([f"*a{i - 1}"] * 8) + "]"
    return expr


def _mergekit_bomb(levels: int) -> str:
    return ("merge_method: task_arithmetic\nbase_model: b\nmodels:\n  - model: e\n"
            f"parameters:\n  weight: {_bomb(levels)}\n")


def _params_bomb(levels: int) -> str:
    return ("base: b\nexperts:\n  - {name: e, path: e, weight: 1.0}\nmethod: task_arithmetic\n"
            f"parameters:\n  lambda: {_bomb(levels)}\n")


def _cli(tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mergepipe", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=10)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("levels", [12, 22])
@pytest.mark.parametrize("kind", ["import-mergekit", "plan"])
def test_an_alias_bomb_is_one_short_line_fast(kind, levels, tmp_path):
    """An 835-byte mergekit YAML of nested aliases made import-mergekit print its error with the
    aliases expanded: a 135,000-character line at 12 levels, 3.8 GB of memory at 22."""
    (tmp_path / "b").mkdir()
    (tmp_path / "e").mkdir()
    if kind == "import-mergekit":
        (tmp_path / "bomb.yml").write_text(_mergekit_bomb(levels))
        argv = ["import-mergekit", "bomb.yml", "-o", "params.yaml"]
    else:
        (tmp_path / "bomb.yml").write_text(_params_bomb(levels))
        argv = ["plan", "bomb.yml", "-o", "plan.json"]
    assert len(_mergekit_bomb(levels)) < 1300
    proc, _ = _cli(tmp_path, *argv)  # subprocess.TimeoutExpired after 10 s fails the test
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and len(proc.stderr) < 400, proc.stderr[:1000]
    assert "bomb.yml: refused YAML: over 100,000 values once its aliases are expanded" in proc.stderr
    assert not (tmp_path / "params.yaml").exists() and not (tmp_path / "plan.json").exists()


def test_an_alias_inside_its_own_anchor_is_refused():
    with pytest.raises(ConfigError, match="an alias refers to its own anchor"):
        parse_yaml("models: &m [{model: a}, *m]\n", source="mk.yml")


def test_aliases_a_config_uses_still_load():
    text = ("shared: &p {weight: 0.5, density: 0.3}\nmodels:\n  - {model: a, parameters: *p}\n"
            "  - {model: b, parameters: *p}\nbig: " + _bomb(5) + "\n")  # 9**5 = 59,049 values: under the bound
    data = parse_yaml(text, source="mk.yml")
    assert data["models"][1]["parameters"] == {"weight": 0.5, "density": 0.3}
    assert 9 ** 5 < MAX_YAML_VALUES < 9 ** 6


def test_short_repr_is_bounded_in_time_and_length():
    node: list = [1] * 9
    for _ in range(40):  # 9**40 values if walked
        node = [node] * 9
    t0 = time.monotonic()
    text = short_repr(node)
    assert time.monotonic() - t0 < 0.1 and len(text) <= MAX_QUOTE_CHARS
    assert len(short_repr("x" * 10**6)) <= MAX_QUOTE_CHARS
    assert len(short_repr({f"k{i}" * 50: i for i in range(1000)})) <= MAX_QUOTE_CHARS


@pytest.mark.parametrize("doc", [
    {"merge_method": "x" * 10**6},
    {"merge_method": "ties", "base_model": "b", "models": [{"model": "e", "parameters": {"weight": [[1] * 99_000]}}]},
    {"merge_method": "ties", "base_model": "b", "models": [{"model": "e", "y" * 10**5: 1}]},
    {"merge_method": "ties", "base_model": "b", "models": [{"model": ["e"] * 99_000}]},
    {"x" * 10**6: 1},
    {"merge_method": ["ties"] * 1000},
    {"merge_method": "ties", "base_model": "b", "models": [{"model": "e", 1: 2, "a": 3}]},  # mixed key types
])
def test_mergekit_errors_quote_a_bounded_part_of_the_input(doc):
    with pytest.raises(ConfigError) as info:
        mergekit_to_params(doc, source="mk.yml")
    message = str(info.value)
    assert "\n" not in message and len(message) < 600, message[:1000]


@pytest.mark.parametrize("text, expected", [
    ("weight: " + "1" * 5000 + "\n", "mk.yml: invalid YAML value: Exceeds the limit (4300 digits)"),
    ("date: 2001-13-01\n", "mk.yml: invalid YAML value: month must be in 1..12"),
    (f"&{'a' * 5000} x: 1\n", "mk.yml: invalid YAML"),
])
def test_values_the_yaml_loader_cannot_build_are_one_line_errors(text, expected):
    """A 5,000-digit integer ended in ValueError's traceback."""
    with pytest.raises(ConfigError) as info:
        parse_yaml(text, source="mk.yml")
    assert str(info.value).startswith(expected) and len(str(info.value)) < 400, str(info.value)


def test_a_duplicate_long_key_is_quoted_bounded():
    key = "k" * 10**5
    with pytest.raises(ConfigError) as info:
        parse_yaml(f"? {key}\n: 1\n? {key}\n: 2\n", source="p.yaml")  # explicit keys: no 1024-char limit
    assert "duplicate key" in str(info.value) and len(str(info.value)) < 400


def test_a_control_character_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"^p.yaml: invalid YAML: unacceptable character #x0008"):
        parse_yaml("\x08", source="p.yaml")
