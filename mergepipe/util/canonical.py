"""blake3 of util.fs.canonical_json(obj) without the whole text in memory at once.

json.dumps builds every piece of a document before joining them: for a manifest of 100k
tensors (the plan's reads, the output hashes) that was ~100 MB at the merge's peak of
memory. Here the top levels of dicts of dicts are walked in json's order (sorted keys,
compact separators) and each value below is dumped on its own, so the same bytes are hashed a
few megabytes at a time. A dict with a key that is not a str is dumped whole, as json
itself would (its errors and key conversions included).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import chain
from json.encoder import encode_basestring_ascii as _esc

from blake3 import blake3


def _dumps(obj) -> str:
    if type(obj) is dict and len(obj) > 64:
        lists = list(obj.values())
        if set(map(type, obj)) == {str} and set(map(type, lists)) == {list} \
                and set(map(type, chain.from_iterable(lists))) <= {int}:
            return _int_lists(obj)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _int_lists(d: dict[str, list[int]]) -> str:
    """_dumps of a dict of lists of ints (a plan's reads: 100k tensors), the same text: each
    distinct list's text once (a loaded plan shares its equal lists: plan/record.loads_plan),
    the pairs joined in C-speed passes."""
    distinct = dict(zip(map(id, d.values()), d.values()))
    text = {i: "[" + ",".join(map(int.__repr__, v)) + "]" for i, v in distinct.items()}
    keys = sorted(d)  # as sort_keys: the keys are distinct str
    values = map(text.__getitem__, map(id, map(d.__getitem__, keys)))
    return "{" + ",".join(map(":".join, zip(map(_esc, keys), values))) + "}"


def _pieces(obj, depth: int) -> Iterator[str]:
    # a dict of dicts is walked (the big ones: plan.reads, the manifest's plan and outputs),
    # anything else is one json.dumps (a flat dict of 100k hashes dumps fastest whole)
    if depth == 0 or type(obj) is not dict or not obj or set(map(type, obj)) != {str} \
            or dict not in set(map(type, obj.values())):
        yield _dumps(obj)
        return
    for i, (k, v) in enumerate(sorted(obj.items())):  # sort_keys: keys are distinct str
        yield ("{" if i == 0 else ",") + json.encoder.encode_basestring_ascii(k) + ":"
        yield from _pieces(v, depth - 1)
    yield "}"


def canonical_blake3(obj, *, depth: int = 3) -> str:
    """blake3(canonical_json(obj)).hexdigest(), the same digest."""
    h = blake3()
    for piece in _pieces(obj, depth):
        h.update(piece.encode())
    return h.hexdigest()
