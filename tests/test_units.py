"""Byte sizes and budgets: parsing tables, canonical strings, resolution."""
from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.errors import ConfigError
from mergepipe.units import Budget, UnitError, format_bytes, parse_budget, parse_bytes

GIB = 1 << 30


@pytest.mark.parametrize("value, expected", [
    (0, 0),
    (4096, 4096),
    ("4096", 4096),
    (" 4096 ", 4096),
    ("4096B", 4096),
    ("1KiB", 1024),
    ("1kib", 1024),
    ("1MiB", 1 << 20),
    ("2GiB", 2 * GIB),
    ("1TiB", 1 << 40),
    ("1PiB", 1 << 50),
    ("500MB", 500_000_000),
    ("1KB", 1000),
    ("3GB", 3_000_000_000),
    ("1 MiB", 1 << 20),
    ("1.5KiB", 1536),
    ("0.5MiB", 1 << 19),
    (".5KiB", 512),
    (1024.0, 1024),
])
def test_parse_bytes_table(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value, fragment", [
    (True, "byte count"),
    (-1, ">= 0"),
    (1.5, "whole"),
    (float("nan"), "whole"),
    ("", "cannot parse"),
    ("abc", "cannot parse"),
    ("-1KiB", "cannot parse"),
    ("1K", "unknown unit 'K'"),
    ("1M", "unknown unit"),
    ("2GiBs", "unknown unit"),
    ("1.5B", "not a whole number of bytes"),
    ("1e6", "cannot parse"),
    (None, "byte count"),
    ([1], "byte count"),
])
def test_parse_bytes_errors(value, fragment):
    with pytest.raises(UnitError) as info:
        parse_bytes(value, what="block_bytes")
    message = str(info.value)
    assert message.startswith("block_bytes: ")
    assert fragment in message
    assert "\n" not in message


def test_unit_error_is_config_error_and_value_error():
    with pytest.raises(ConfigError):
        parse_bytes("garbage")
    with pytest.raises(ValueError):
        parse_bytes("garbage")
    assert UnitError("x", "y").exit_code == ConfigError.exit_code


@pytest.mark.parametrize("n, text", [
    (0, "0 B"),
    (1, "1 B"),
    (1023, "1023 B"),
    (1024, "1 KiB"),
    (1536, "1.5 KiB"),
    (1 << 20, "1 MiB"),
    (2 * GIB, "2 GiB"),
    (int(2.25 * GIB), "2.25 GiB"),
    (1 << 50, "1 PiB"),
    (-2048, "-2 KiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("value, canonical, resolved", [
    ("full", "full", 1000),
    ("FULL", "full", 1000),
    (" full ", "full", 1000),
    ("100%", "full", 1000),
    (1.0, "full", 1000),
    ("1.0", "full", 1000),
    ("25%", "25%", 250),
    ("25.0%", "25%", 250),
    ("25 %", "25%", 250),
    (0.25, "25%", 250),
    ("0.25", "25%", 250),
    (".25", "25%", 250),
    ("12.5%", "12.5%", 125),
    (0.1, "10%", 100),
    ("33.3%", "33.3%", 333),
    (0.333, "33.3%", 333),
    ("0.05%", "0.05%", 0),
    ("2GiB", "2147483648B", 2 * GIB),
    (1234, "1234B", 1234),
    ("1234", "1234B", 1234),
    ("1234B", "1234B", 1234),
    ("1KB", "1000B", 1000),
])
def test_parse_budget_table(value, canonical, resolved):
    budget = parse_budget(value)
    assert str(budget) == canonical
    assert budget.resolve(1000) == resolved
    assert parse_budget(str(budget)) == budget  # canonical form round-trips


@pytest.mark.parametrize("value, fragment", [
    (0, "> 0"),
    (-5, "> 0"),
    ("0", "> 0"),
    ("0B", "> 0"),
    ("0%", "> 0"),
    (0.0, "> 0"),
    ("-5%", "> 0"),
    ("-1", "> 0"),
    ("101%", "100%"),
    ("100.01%", "100%"),
    (1.5, "100%"),
    ("1.5", "100%"),
    (float("nan"), "finite"),
    (float("inf"), "finite"),
    (True, "boolean"),
    (False, "boolean"),
    ("garbage", "cannot parse"),
    ("", "cannot parse"),
    ("nan", "cannot parse"),
    ("1e9", "exponent"),
    ("25%%", "cannot parse"),
    ("1K", "unknown unit"),
    ("1.5B", "whole number"),
    (None, "string or number"),
    ([25], "string or number"),
])
def test_parse_budget_errors(value, fragment):
    with pytest.raises(UnitError) as info:
        parse_budget(value)
    message = str(info.value)
    assert message.startswith("budget: ")
    assert fragment in message
    assert "\n" not in message


def test_equal_budgets_have_one_canonical_form():
    assert str(parse_budget("25%")) == str(parse_budget(0.25)) == str(parse_budget("0.250"))
    assert parse_budget("25%") == parse_budget(0.25)
    assert parse_budget("100%") == parse_budget("full") == Budget("full")
    assert hash(parse_budget("10%")) == hash(parse_budget(0.1))


def test_budget_kinds_and_fields():
    assert parse_budget("full").kind == "full"
    fraction = parse_budget("25%")
    assert (fraction.kind, fraction.fraction, fraction.budget_bytes) == ("fraction", Fraction(1, 4), None)
    size = parse_budget("1KiB")
    assert (size.kind, size.fraction, size.budget_bytes) == ("bytes", None, 1024)
    assert parse_budget(size) is size


def test_budget_resolve():
    assert Budget("full").resolve(0) == 0
    assert parse_budget("25%").resolve(10) == 2  # floor
    assert parse_budget("99.9%").resolve(1000) == 999
    assert parse_budget("2GiB").resolve(10) == 2 * GIB  # bytes as given; the plan caps it
    # exact arithmetic: no float rounding at large totals
    total = (1 << 53) + 3
    assert parse_budget("50%").resolve(total) == total // 2
    with pytest.raises(ValueError):
        Budget("full").resolve(-1)


@pytest.mark.parametrize("kwargs", [
    {"kind": "fraction"},
    {"kind": "fraction", "fraction": Fraction(1)},
    {"kind": "fraction", "fraction": Fraction(0)},
    {"kind": "bytes", "budget_bytes": 0},
    {"kind": "bytes", "budget_bytes": True},
    {"kind": "full", "budget_bytes": 5},
    {"kind": "nope"},
])
def test_inconsistent_budget_is_refused(kwargs):
    with pytest.raises(UnitError):
        Budget(**kwargs)


@given(st.integers(min_value=1, max_value=99_999))
def test_percent_thousandths_round_trip(thousandths):
    percent = f"{thousandths / 1000:.3f}%"
    budget = parse_budget(percent)
    assert parse_budget(str(budget)) == budget
    assert budget.fraction == Fraction(thousandths, 100_000)
    assert budget.resolve(10**9) == thousandths * 10**4


@given(st.floats(min_value=1e-9, max_value=1.0, allow_nan=False))
def test_float_budget_never_exceeds_total(value):
    budget = parse_budget(value)
    for total in (0, 1, 1000, 10**12 + 7):
        assert 0 <= budget.resolve(total) <= total
    assert parse_budget(str(budget)) == budget
