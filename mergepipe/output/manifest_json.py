"""The manifest's pretty-printed JSON, byte for byte what util.fs.canonical_json(obj,
indent=N) writes (json.dumps with sort_keys, ASCII, no NaN, that indent, a final newline),
made faster for large documents.

With an indent, json.dumps runs its pure-Python encoder: a generator per container and
several Python calls per value. A manifest of 100k tensors (their hashes, and the plan's
reads) took a second that way. Here, containers whose items are all strings or all
integers (the big ones: outputs.tensors, plan.reads) are joined in one comprehension
with the C string escaper, and everything else recurses. Anything unusual (a non-str
key, a float that is not finite, a subclass of a JSON type) goes to json.dumps itself,
which then gives its own output or error.
"""
from __future__ import annotations

import json
from itertools import chain
from json.encoder import encode_basestring_ascii as _esc

from mergepipe.util.gcpause import paused_gc


class _Unusual(Exception):
    """A value json.dumps should handle itself."""


def pretty_json(obj, *, indent: int = 1) -> bytes:
    """json.dumps(obj, sort_keys=True, indent=indent, allow_nan=False) + "\\n", encoded."""
    try:
        with paused_gc():  # lists and tuples per item, no cycles (util/gcpause.py)
            text = _value(obj, 0, indent)
    except _Unusual:
        text = json.dumps(obj, sort_keys=True, indent=indent, allow_nan=False)
    return (text + "\n").encode()


def _value(o, level: int, indent: int) -> str:
    t = type(o)
    if t is str:
        return _esc(o)
    if t is dict:
        return _dict(o, level, indent)
    if t is list or t is tuple:
        return _list(o, level, indent)
    if t is int:
        return int.__repr__(o)
    if o is True:
        return "true"
    if o is False:
        return "false"
    if o is None:
        return "null"
    if t is float and o - o == 0.0:  # finite (nan - nan and inf - inf are nan)
        return float.__repr__(o)
    raise _Unusual


def _dict(d: dict, level: int, indent: int) -> str:
    if not d:
        return "{}"
    if set(map(type, d)) != {str}:
        raise _Unusual
    pad = "\n" + " " * (indent * (level + 1))
    items = sorted(d.items())  # as json's sort_keys (keys are distinct: only they are compared)
    kinds = set(map(type, d.values()))
    if kinds == {str}:
        body = ",".join([f"{pad}{_esc(k)}: {_esc(v)}" for k, v in items])
    elif kinds == {list} and set(map(type, chain.from_iterable(d.values()))) <= {int}:  # e.g. plan.reads
        inner, close = pad + " " * indent, pad + "]"
        body = ",".join([f"{pad}{_esc(k)}: " + ("[" + ",".join([inner + int.__repr__(x) for x in v]) + close
                                                 if v else "[]") for k, v in items])
    else:
        body = ",".join([f"{pad}{_esc(k)}: {_value(v, level + 1, indent)}" for k, v in items])
    return "{" + body + "\n" + " " * (indent * level) + "}"


def _list(items, level: int, indent: int) -> str:
    if not items:
        return "[]"
    pad = "\n" + " " * (indent * (level + 1))
    kinds = set(map(type, items))
    if kinds == {int}:
        body = ",".join([pad + int.__repr__(x) for x in items])
    elif kinds == {str}:
        body = ",".join([pad + _esc(x) for x in items])
    else:
        body = ",".join([pad + _value(x, level + 1, indent) for x in items])
    return "[" + body + "\n" + " " * (indent * level) + "]"
