"""Byte sizes and budgets as users write them ("1MiB", "25%", "full").

Owns the one size and budget grammar: parsing, the regex patterns the JSON schema
publishes, budget lists, canonical printing, and the bounded repr of one-line
errors. The canonical budget string goes into plan hashes, so equal budgets must
print the same ("25%", 0.25 and "25.0%" all print "25%"). Pure functions; no I/O.

Errors are `UnitError`, a `ConfigError` that is also a `ValueError`, so the
same functions serve the CLI (which prints MergepipeErrors) and pydantic
validators (which turn ValueErrors into field errors).
"""
from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Literal

from mergepipe.errors import ConfigError


class UnitError(ConfigError, ValueError):
    """A size or budget that cannot be parsed: "<what>: <detail>".

    `detail` alone reads well after a key path ("block_bytes: <detail>")."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.detail = detail


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


MAX_QUOTE_CHARS = 200  # what an error message quotes of the user's input, at most


def clip(text: str, limit: int = MAX_QUOTE_CHARS) -> str:
    """`text` cut to `limit` characters ("..." ending a cut one)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def short_repr(value: object) -> str:
    """A bounded repr: an error line must stay one short line whatever the user wrote. reprlib
    visits at most maxlist items of at most maxlevel levels, so a structure that YAML aliases
    made exponentially large costs what a small one does; the text is clipped."""
    return clip(_REPR.repr(value))


_BINARY = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_UNITS: dict[str, int] = {"": 1, "b": 1, **_BINARY, **_DECIMAL}
# The grammar, written once. The patterns are plain enough for JSON schema (ECMA-262)
# too: config/schema.py publishes SIZE_PATTERN and BUDGET_PATTERN in
# schemas/params.schema.yaml, so Snakemake's check and this parser read the same text.
_NUMBER = r"(\d+(\.\d*)?|\.\d+)"  # group 1: the number (group 2: its fraction part)
SIZE_PATTERN = rf"^\s*{_NUMBER}\s*[A-Za-z]*\s*$"
BUDGET_PATTERN = rf"^\s*([Ff][Uu][Ll][Ll]|{_NUMBER}\s*(%|[A-Za-z]*))\s*$"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z]*)\s*$")  # group 3: the unit
_PLAIN_INT_RE = re.compile(r"^\s*\d+\s*$")
_PLAIN_DECIMAL_RE = re.compile(r"^\s*(\d+\.\d*|\.\d+)\s*$")
_PERCENT_RE = re.compile(rf"^\s*{_NUMBER}\s*%\s*$")
_SIZE_HELP = "use a byte count (4096) or a size like '512KiB', '1MiB', '2GiB', '500MB'"


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Parse a byte count: an int, or a string with an optional unit.

    Binary units KiB, MiB, GiB, TiB, PiB (powers of 1024) and decimal units KB,
    MB, GB, TB, PB (powers of 1000) are accepted, case-insensitively, as is a
    trailing "B" or no unit (bytes). Fractions are allowed if the result is a
    whole number of bytes ("1.5KiB" is 1536). Bare "K", "M", "G" are refused
    because they are ambiguous.

    Args:
        value: what the user wrote.
        what: how to name the value in error messages.
    Returns:
        The number of bytes, >= 0.
    Raises:
        UnitError: for bools, negative or non-integral counts, unknown units.
    """
    if isinstance(value, bool):
        raise UnitError(what, f"must be a byte count, got {value!r}; {_SIZE_HELP}")
    if isinstance(value, int):
        if value < 0:
            raise UnitError(what, f"must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer() or value < 0:
            raise UnitError(what, f"must be a whole, non-negative number of bytes, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise UnitError(what, f"must be a byte count, got {type(value).__name__} {value!r}; "
                              f"{_SIZE_HELP}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise UnitError(what, f"cannot parse {value!r}; {_SIZE_HELP}")
    number, unit = match.group(1), match.group(3).lower()
    if unit not in _UNITS:
        raise UnitError(what, f"unknown unit {match.group(3)!r} in {value!r}; use B, KiB, MiB, "
                              "GiB, TiB, PiB (x1024) or KB, MB, GB, TB, PB (x1000)")
    exact = Fraction(Decimal(number)) * _UNITS[unit]
    if exact.denominator != 1:
        raise UnitError(what, f"{value!r} is not a whole number of bytes ({float(exact)})")
    return int(exact)


_HUMAN_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """Human-readable size in binary units: 512 -> "512 B", 1536 -> "1.5 KiB".

    At most two decimals, trailing zeros dropped; for display only (lossy)."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n} B"
    value = float(n)
    unit = "B"
    for unit in _HUMAN_UNITS:
        value /= 1024
        if value < 1024:
            break
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


@dataclass(frozen=True, slots=True)
class Budget:
    """The most expert bytes a merge may read.

    Relative budgets are relative to what a full-budget merge reads: the expert
    blocks that differ from the base (blocks identical to the base are never
    read, so counting them would make "10%" read more than a tenth of a full
    merge). kind "full": everything a full merge reads; "fraction": a share of
    it, 0 < fraction < 1, kept exact as a Fraction; "bytes": an absolute count
    > 0. A 100% fraction is stored as "full", so the canonical form (`str`) is
    one per meaning.
    """

    kind: Literal["full", "fraction", "bytes"]
    fraction: Fraction | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "full":
            ok = self.fraction is None and self.budget_bytes is None
        elif self.kind == "fraction":
            ok = (isinstance(self.fraction, Fraction) and 0 < self.fraction < 1
                  and self.budget_bytes is None)
        elif self.kind == "bytes":
            ok = (type(self.budget_bytes) is int and self.budget_bytes > 0
                  and self.fraction is None)
        else:
            ok = False
        if not ok:
            raise UnitError("budget", f"inconsistent Budget({self.kind!r}, "
                            f"fraction={self.fraction}, budget_bytes={self.budget_bytes}); "
                            "build budgets with parse_budget()")

    def resolve(self, full_read_bytes: int) -> int:
        """Budget in bytes, given the expert bytes a full-budget merge reads.

        `full_read_bytes` is the plan's candidate bytes (expert blocks that differ
        from the base), not the experts' file sizes; absolute budgets ignore it."""
        if full_read_bytes < 0:
            raise ValueError(f"full_read_bytes must be >= 0, got {full_read_bytes}")
        if self.kind == "full":
            return full_read_bytes
        if self.kind == "fraction":
            assert self.fraction is not None
            return math.floor(self.fraction * full_read_bytes)
        assert self.budget_bytes is not None
        return self.budget_bytes

    def __str__(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "fraction":
            assert self.fraction is not None
            return f"{_fraction_to_decimal(self.fraction * 100)}%"
        return f"{self.budget_bytes}B"


def _fraction_to_decimal(value: Fraction) -> str:
    """Plain decimal text of a fraction that came from a finite decimal."""
    text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


_BUDGET_HELP = "use 'full', a percentage ('25%'), a fraction (0.25) or a size ('2GiB', 1234)"


def _fraction_budget(exact: Fraction, written: object) -> Budget:
    if exact <= 0:
        raise UnitError("budget", f"must be > 0, got {written!r}; {_BUDGET_HELP}")
    if exact > 1:
        raise UnitError("budget", f"must not exceed 100% (a full merge's reads), got {written!r}; "
                                  f"{_BUDGET_HELP}")
    if exact == 1:
        return Budget("full")
    return Budget("fraction", fraction=exact)


def parse_budget(value: Budget | str | int | float) -> Budget:
    """Parse a budget as written in params.yaml or on the command line.

    "full" (any case); "25%" or "12.5%"; a float or decimal string in (0, 1]
    ("0.25", 0.25: a fraction of the expert bytes a full-budget merge reads,
    i.e. of the blocks that differ from the base; 1.0 is "full"); an int, an
    integer string or a size with a unit ("2GiB", "500MB", 1234: bytes).

    Raises:
        UnitError: bools, NaN, infinities, values <= 0 or above 100%, garbage.
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise UnitError("budget", f"must not be a boolean, got {value!r}; {_BUDGET_HELP}")
    if isinstance(value, int | float):
        return _number_budget(value)
    if not isinstance(value, str):
        raise UnitError("budget", f"must be a string or number, got {type(value).__name__} "
                                  f"{value!r}; {_BUDGET_HELP}")
    return _text_budget(value)


def _number_budget(value: int | float) -> Budget:
    """An int is bytes; a float is a fraction of the full merge's reads."""
    if isinstance(value, int):
        if value <= 0:
            raise UnitError("budget", f"must be > 0 bytes, got {value}; {_BUDGET_HELP}")
        return Budget("bytes", budget_bytes=value)
    if not math.isfinite(value):
        raise UnitError("budget", f"must be finite, got {value!r}; {_BUDGET_HELP}")
    # repr() is the shortest text that round-trips, so 0.1 means 1/10 exactly.
    return _fraction_budget(Fraction(Decimal(repr(value))), value)


def _text_budget(value: str) -> Budget:
    """"full", a percentage, a plain decimal fraction, or bytes (an integer or a size with a unit)."""
    text = value.strip()
    if text.lower() == "full":
        return Budget("full")
    percent = _PERCENT_RE.match(text)
    if percent is not None:
        return _fraction_budget(Fraction(Decimal(percent.group(1))) / 100, value)
    if _PLAIN_DECIMAL_RE.match(text):
        return _fraction_budget(Fraction(Decimal(text)), value)
    if _PLAIN_INT_RE.match(text) or _SIZE_RE.match(text):
        try:
            size = parse_bytes(text, what="budget")
        except UnitError as err:
            raise UnitError("budget", f"{err.detail}; or {_BUDGET_HELP}") from None
        if size <= 0:
            raise UnitError("budget", f"must be > 0 bytes, got {value!r}; {_BUDGET_HELP}")
        return Budget("bytes", budget_bytes=size)
    if text.startswith("-"):
        raise UnitError("budget", f"must be > 0, got {value!r}; {_BUDGET_HELP}")
    try:
        numeric = Decimal(text).is_finite()
    except InvalidOperation:
        numeric = False
    hint = " (write it without an exponent)" if numeric else ""
    raise UnitError("budget", f"cannot parse {value!r}{hint}; {_BUDGET_HELP}")


def parse_budget_list(text: str) -> list[Budget]:
    """'5%,10%,full' -> budgets, deduplicated by meaning, in the order given; empty items skipped.

    Raises:
        UnitError: a budget that does not parse (names it).
    """
    out: list[Budget] = []
    for part in text.split(","):
        if part.strip():
            b = parse_budget(part.strip())
            if b not in out:
                out.append(b)
    return out
