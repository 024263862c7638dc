"""One-line config errors: a pydantic ValidationError rendered as "<key path>: <message>".

Only the first error is shown (with a count of the others); unknown keys list the
allowed ones and the closest ("did you mean"); values are shown with a bounded repr
(units.short_repr) and the whole line is clipped, so it stays short whatever the user wrote.
"""
from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from mergepipe.units import clip, short_repr

MAX_LINE_CHARS = 600  # a message quotes at most a few bounded values; longer is a bug's or the user's text


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """" (did you mean 'ties'?)" for the choice closest to `word` (difflib), else ""."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word[:100], list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
        if not allowed:
            return "unknown key"
        return f"unknown key{did_you_mean(loc[-1] if loc else None, allowed)}; allowed keys: {', '.join(allowed)}"
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
        message += f", got {short_repr(value)}"
    elif not isinstance(value, dict | list):
        message += f", got {type(value).__name__}"
    return message


def describe(err: ValidationError, model: type[BaseModel] | None,
              prefix: tuple[Any, ...] = ()) -> str:
    """One line for a whole ValidationError: first error's key path and message."""
    errors = err.errors()
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not _is_internal_loc(p))
    text = _error_text(first, model, loc)
    where = clip(_loc_text(prefix + loc))  # a key path holds the user's own key names
    line = f"{where}: {text}" if where else text
    more = len(errors) - 1
    if more:
        line += f" (and {more} more error{'s' if more > 1 else ''})"
    return clip(line, MAX_LINE_CHARS)
