"""Safetensors headers in the usual compact spelling are read as columns by a regular
expression (checkpoint/header_scan.py). Whatever the text, parse_header must give what the
json.loads path gives: the same FileHeader, or the same one-line error naming the file or
tensor; anything not provably in that spelling goes to json.loads."""
from __future__ import annotations

import json
import struct

import pytest

from mergepipe.checkpoint import header_scan
from mergepipe.checkpoint import safetensors as st

E = '{"dtype":"BF16","shape":[1],"data_offsets":[%d,%d]}'


def _body(names, *, meta='{"format":"pt"}') -> str:
    entries = ",".join(f"{json.dumps(n, ensure_ascii=False)}:" + E % (2 * i, 2 * i + 2) for i, n in enumerate(names))
    return "{" + (f'"__metadata__":{meta},' if meta is not None else "") + entries + "}"


CANONICAL = [
    _body(["a", "b", "c"]),
    _body(["a", "b"], meta=None),
    _body(["a", "b"], meta='{"x":"]},\\"y\\":{","z":"}"}'),  # the chunk cut's marker inside metadata
    _body(["é", "日本", "a b/c.weight"]),
    _body(["a"], meta="null"),
    '{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"z":{"dtype":"BF16","shape":[0,3],'
    '"data_offsets":[4,4]},"b":{"dtype":"I8","shape":[2,2],"data_offsets":[4,8]}}   ',
    _body(["b", "a"]).replace("[0,2]", "[9,9]").replace("[2,4]", "[0,2]").replace("[9,9]", "[2,4]"),  # offsets unsorted
]
ODD = [  # json.loads decides: the same result or the same error
    _body(["a\\u00e9", "b"]),  # an escape in a name
    _body(["a", "b"]).replace('"dtype":"BF16","shape":[1]', '"shape":[1],"dtype":"BF16"', 1),  # key order
    _body(["a", "b"]).replace(",", ", "),  # whitespace
    _body(["a", "a"]),  # duplicate
    _body(["__metadata__", "b"], meta=None),
    _body(["a", "b"]).replace('"b":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]}',
                              '"__metadata__":{"q":"r"}').replace(',"__metadata__":{"format":"pt"}', ""),
    _body(["a", "b"]).replace("[1]", "[01]", 1),  # not JSON
    _body(["a", "b"]).replace("[1]", "[1.0]", 1),
    _body(["a", "b"]).replace("[0,2]", "[0,2,]", 1),
    _body(["a", "b"]) + "}",
    _body(["a", "b"])[:-1] + ",}",
    _body(["a", "b"]).replace("[2,4]", "[2,00000000000000000000000004]"),
    _body(["a", "b"], meta='{"format":1}'),
    _body(["a", "b"], meta='""'),
    _body(["a", "b"], meta='{"a":"b","a":"c"}'),
    _body(["a", "b"]).replace("BF16", "BF17", 1),
    _body(["a", "b"]).replace("[2,4]", "[4,6]"),  # a gap
    _body(["a", "b"]).replace("[1]", "[2]", 1),  # size
    '{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"b":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]},'
    '"__metadata__":{"format":"pt"}}',  # metadata last
    '{}', '[]', '{"__metadata__":{}}', ' ' + _body(["a"]),
]


def _parse(tmp_path, body: str, data_len: int):
    raw = body.encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    st._LAST.clear()  # not the last header's entries: this parse
    try:
        return st.parse_header(path)
    except st.CheckpointError as e:
        return str(e)


@pytest.mark.parametrize("body", CANONICAL + ODD)
def test_scan_gives_the_json_parse(tmp_path, monkeypatch, body):
    data_len = 8 if '"I8"' in body else 6 if '"c"' in body or "日本" in body else 4 if body.count("dtype") > 1 else 2
    fast = _parse(tmp_path, body, data_len)
    seen = []
    real = header_scan.scan
    monkeypatch.setattr(header_scan, "scan", lambda *a: seen.append(real(*a)))  # records, then json.loads
    slow = _parse(tmp_path, body, data_len)
    assert fast == slow
    if body in CANONICAL:
        assert seen[0] is not None and not isinstance(fast, str)


def test_scan_in_chunks(tmp_path, monkeypatch):
    """A header longer than a chunk is cut between entries; the columns are the same."""
    body = _body([f"model.layers.{i}.w" for i in range(500)])
    whole = _parse(tmp_path, body, 1000)
    monkeypatch.setattr(header_scan, "_CHUNK", 97)
    cols = header_scan.scan(body, st._reject_duplicates)
    assert cols is not None and len(cols[1]) == 500
    assert _parse(tmp_path, body, 1000) == whole and not isinstance(whole, str)


def test_a_header_like_the_last_one_takes_its_entries(tmp_path):
    """An expert whose header is the base's, byte for byte, takes the base's checked entries
    with its own path; the same header on a file of another size is parsed (and refused)."""
    body = _body([f"t{i}" for i in range(10)]).encode()
    for name, extra in (("base", 0), ("e1", 0), ("e2", 2)):
        (tmp_path / name).write_bytes(struct.pack("<Q", len(body)) + body + bytes(20 + extra))
    st._LAST.clear()
    base, e1 = st.parse_header(tmp_path / "base"), st.parse_header(tmp_path / "e1")
    st._LAST.clear()
    assert e1 == st.parse_header(tmp_path / "e1") and e1.header_bytes is base.header_bytes
    assert {t.file for t in e1.tensors} == {tmp_path / "e1"} and e1.tensors[3].name == "t3"
    with pytest.raises(st.CheckpointError, match="2 bytes after the last tensor"):
        st.parse_header(tmp_path / "e2")
