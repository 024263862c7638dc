"""The columns of a safetensors header in its usual spelling, without a JSON object per tensor.

Headers written by safetensors (serde_json), by mergepipe and by most tools are compact JSON
with each entry's keys in one order: `"name":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}`.
For such a header, a regular expression yields the entries' fields as columns in a few
C-speed passes; json.loads of a 100k-tensor header (8.5 MB) made 100k dicts and 200k lists
(~0.3 s and ~50 MB a header) only to have them taken apart again.

`scan` answers only when the regular expression provably read the whole header as JSON
would: the matches tile the text after `__metadata__` exactly, names have no escapes or
control characters (so they are the JSON strings themselves), numbers have JSON's spelling,
no name repeats or is `__metadata__`. Anything else (whitespace between tokens, another key
order, escapes, duplicates) returns None and the caller parses with json.loads, whose
entry-by-entry checks name what is wrong.
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable

_INT = r"(?:0|[1-9][0-9]{0,19})"  # longer numbers: json.loads decides (int() has a digit limit)
# one entry and the character after it ("," or the object's closing "}")
_ENTRY = re.compile(r'"([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]*)","shape":\[((?:' + _INT + r'(?:,' + _INT
                    + r')*)?)\],"data_offsets":\[(' + _INT + r'),(' + _INT + r')\]\}([,}])')
# the characters of an entry outside its groups: '"":{"dtype":"","shape":[],"data_offsets":[,]}'
_FIXED = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')
_CHUNK = 1 << 20  # characters per findall: its tuples (one per entry) stay a few MB at a time
_META = '{"__metadata__":'
_SPACE = " \t\n\r"  # JSON whitespace, allowed after the closing brace (headers are padded with spaces)


class Columns(tuple):
    """(metadata, names, dtypes, shapes, begins, ends): the header's entries in its order."""


def scan(text: str, pairs_hook: Callable) -> Columns | None:
    """The header's metadata (or None) and its entries as columns, or None when `text` is not
    in the spelling above (then json.loads decides). `pairs_hook` is json's object_pairs_hook
    for the metadata object (duplicate keys)."""
    metadata, start = None, 1
    if text.startswith(_META):
        try:
            metadata, start = json.JSONDecoder(object_pairs_hook=pairs_hook).raw_decode(text, len(_META))
        except (ValueError, RecursionError):
            return None
        if not text.startswith(',"', start):
            return None
        start += 1
    elif not text.startswith('{"'):
        return None
    end = len(text.rstrip(_SPACE))
    rows: list[tuple[str, ...]] = []
    pos = start
    while pos < end:  # chunks cut after an entry: ']},"' occurs nowhere else (names have no quote)
        cut = text.find(']},"', pos + _CHUNK, end)
        cut = end if cut < 0 else cut + 3
        rows += _ENTRY.findall(text, pos, cut)
        pos = cut
    if not rows:
        return None
    names, dtypes, shapes, begins, ends, seps = (list(c) for c in zip(*rows))
    del rows
    names = list(map(sys.intern, names))  # one string with the plan's tensor names (plan/record.plan_object)
    # matches come in order and never overlap, so they tile [start, end) iff their lengths add up
    covered = (_FIXED + 1) * len(names) + sum(map(len, names)) + sum(map(len, dtypes)) \
        + sum(map(len, shapes)) + sum(map(len, begins)) + sum(map(len, ends))
    if covered != end - start or seps[-1] != "}" or seps.count("}") != 1:
        return None
    if len(set(names)) != len(names) or "__metadata__" in names:  # json.loads' errors, not ours
        return None
    # one object per distinct dtype and shape (a few dozen), not one per tensor
    dtype_of = {d: d for d in set(dtypes)}
    shape_of = {s: tuple(map(int, s.split(","))) if s else () for s in set(shapes)}
    return Columns((metadata, names, list(map(dtype_of.__getitem__, dtypes)), list(map(shape_of.__getitem__, shapes)),
                    list(map(int, begins)), list(map(int, ends))))
