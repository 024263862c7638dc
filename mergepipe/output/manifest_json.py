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


CHUNK = 4096  # items joined at a time; their text is encoded into the output every FLUSH parts
FLUSH = 1 << 14


def pretty_json(obj, *, indent: int = 1) -> bytes:
    """json.dumps(obj, sort_keys=True, indent=indent, allow_nan=False) + "\\n", encoded.

    The text is made in pieces, encoded a batch at a time (not a string per container
    joined into its parent's: at 100k tensors the nested copies were ~100 MB at the merge's
    peak of memory)."""
    out = _Out()
    try:
        with paused_gc():  # lists and tuples per item, no cycles (util/gcpause.py)
            _value(out, obj, 0, indent)
            out.add("\n")
            return out.result()
    except _Unusual:
        return (json.dumps(obj, sort_keys=True, indent=indent, allow_nan=False) + "\n").encode()


def write_pretty_json(path, obj, *, indent: int = 1) -> None:
    """pretty_json(obj, indent=indent) written to the file `path`, a batch at a time: the whole
    text is never in memory (a manifest of 100k tensors is 18 MB, twice that joined)."""
    with open(path, "wb") as f:
        try:
            with paused_gc():
                out = _Out(f.write)
                _value(out, obj, 0, indent)
                out.add("\n")
                out.result()
                return
        except _Unusual:
            pass
        f.seek(0)
        f.truncate()
        f.write((json.dumps(obj, sort_keys=True, indent=indent, allow_nan=False) + "\n").encode())


class _Out:
    """Text pieces in order, encoded to bytes a batch at a time, kept or given to `sink`."""

    def __init__(self, sink=None) -> None:
        self.parts: list[str] = []
        self.chunks: list[bytes] = []
        self.sink = sink if sink is not None else self.chunks.append

    def add(self, text: str) -> None:
        self.parts.append(text)
        if len(self.parts) >= FLUSH:
            self.sink("".join(self.parts).encode())
            self.parts = []

    def result(self) -> bytes:
        """The bytes (kept), or b"" once the last batch went to the sink."""
        self.sink("".join(self.parts).encode())
        self.parts = []
        return b"".join(self.chunks)


def _value(out: _Out, o, level: int, indent: int) -> None:
    t = type(o)
    if t is str:
        out.add(_esc(o))
    elif t is dict:
        _dict(out, o, level, indent)
    elif t is list or t is tuple:
        _list(out, o, level, indent)
    elif t is int:
        out.add(int.__repr__(o))
    elif o is True:
        out.add("true")
    elif o is False:
        out.add("false")
    elif o is None:
        out.add("null")
    elif t is float and o - o == 0.0:  # finite (nan - nan and inf - inf are nan)
        out.add(float.__repr__(o))
    else:
        raise _Unusual


def _joined(out: _Out, items: list, piece) -> None:
    """`piece(item)` of each item, comma-separated, CHUNK items per joined text."""
    for i in range(0, len(items), CHUNK):
        out.add(("," if i else "") + ",".join(map(piece, items[i:i + CHUNK])))


def _joined_pairs(out: _Out, keys: list[str], texts, fmt: str) -> None:
    """`fmt.format(escaped key, value text)` of each key, comma-separated, CHUNK at a time;
    `texts(keys)` gives a chunk's value texts. Maps over C methods: no Python call per
    item (a manifest has 100k tensor hashes and 100k reads per expert)."""
    piece = fmt.format
    for i in range(0, len(keys), CHUNK):
        chunk = keys[i:i + CHUNK]
        out.add(("," if i else "") + ",".join(map(piece, map(_esc, chunk), texts(chunk))))


def _dict(out: _Out, d: dict, level: int, indent: int) -> None:
    if not d:
        out.add("{}")
        return
    if set(map(type, d)) != {str}:
        raise _Unusual
    pad = "\n" + " " * (indent * (level + 1))
    keys = sorted(d)  # as json's sort_keys (keys are distinct: only they are compared)
    kinds = set(map(type, d.values()))
    out.add("{")
    if kinds == {str}:
        _joined_pairs(out, keys, lambda ks: map(_esc, map(d.__getitem__, ks)), pad + "{}: {}")
    elif kinds == {list} and set(map(type, chain.from_iterable(d.values()))) <= {int}:  # e.g. plan.reads
        # each distinct list's text once: a loaded plan shares its one-block lists (plan/record.plan_object)
        inner, close = pad + " " * indent, pad + "]"
        text = {i: "[" + ",".join([inner + int.__repr__(x) for x in v]) + close if v else "[]"
                for i, v in dict(zip(map(id, d.values()), d.values())).items()}
        _joined_pairs(out, keys, lambda ks: map(text.__getitem__, map(id, map(d.__getitem__, ks))),
                      pad + "{}: {}")
    else:
        for i, k in enumerate(keys):
            out.add(f"{',' if i else ''}{pad}{_esc(k)}: ")
            _value(out, d[k], level + 1, indent)
    out.add("\n" + " " * (indent * level) + "}")


def _list(out: _Out, items, level: int, indent: int) -> None:
    if not items:
        out.add("[]")
        return
    pad = "\n" + " " * (indent * (level + 1))
    kinds = set(map(type, items))
    out.add("[")
    if kinds == {int}:
        _joined(out, items, lambda x: pad + int.__repr__(x))
    elif kinds == {str}:
        _joined(out, items, lambda x: pad + _esc(x))
    else:
        for i, x in enumerate(items):
            out.add(("," if i else "") + pad)
            _value(out, x, level + 1, indent)
    out.add("\n" + " " * (indent * level) + "]")
