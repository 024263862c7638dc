"""Property tests of the safetensors header parser (issue 5): whatever the bytes, parsing
either succeeds with every documented invariant holding, or raises CheckpointError;
never another exception. The long run of the same properties is fuzz/fuzz_header.py."""
from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mergepipe.errors import CheckpointError
from mergepipe.checkpoint.safetensors import DTYPES, INDEX_JSON, MAX_HEADER_BYTES, open_checkpoint, parse_header

SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
names = st.text(min_size=0, max_size=16)


@st.composite
def valid_files(draw) -> tuple[dict, bytes]:
    """A well-formed safetensors file: header dict and the whole file's bytes."""
    tensors = draw(st.dictionaries(names.filter(lambda n: n != "__metadata__"),
                                   st.tuples(st.sampled_from(sorted(DTYPES)),
                                             st.lists(st.integers(0, 5), max_size=3)),
                                   max_size=5))
    header: dict = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))
    offset = 0
    order = draw(st.permutations(sorted(tensors)))  # JSON order need not be offset order
    for name in order:
        dtype, shape = tensors[name]
        n = prod(shape) * DTYPES[dtype][0]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * draw(st.integers(0, 7))
    return header, struct.pack("<Q", len(blob)) + blob + draw(st.binary(min_size=offset, max_size=offset))


def _write(folder: Path, data: bytes) -> Path:
    path = folder / "model.safetensors"
    path.write_bytes(data)
    return path


def check(path: Path):
    """parse_header: CheckpointError, or a result whose invariants hold."""
    try:
        h = parse_header(path)
    except CheckpointError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return None
    size = path.stat().st_size
    assert h.size == size and h.data_start == len(h.header_bytes) <= 8 + MAX_HEADER_BYTES
    pos = h.data_start
    seen = set()
    for t in h.tensors:  # tile the data region exactly, sizes match shapes, names unique and valid
        assert t.begin == pos and t.end - t.begin == prod(t.shape) * DTYPES[t.dtype][0]
        assert t.name not in seen and t.name != "__metadata__"
        t.name.encode("utf-8")
        seen.add(t.name)
        pos = t.end
    assert pos == size
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.metadata.items())
    return h


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-header")


@SETTINGS
@given(data=st.binary(max_size=256))
@example(data=b"")
@example(data=struct.pack("<Q", 2) + b"{}")
@example(data=struct.pack("<Q", 2**64 - 1) + b"{}")
def test_arbitrary_bytes(scratch, data):
    check(_write(scratch, data))


@SETTINGS
@given(header=json_values, pad=st.binary(max_size=32))
def test_arbitrary_json_header(scratch, header, pad):
    blob = json.dumps(header).encode()
    check(_write(scratch, struct.pack("<Q", len(blob)) + blob + pad))


@SETTINGS
@given(f=valid_files())
def test_valid_files_round_trip(scratch, f):
    header, data = f
    h = check(_write(scratch, data))
    assert h is not None
    want = {k: v for k, v in header.items() if k != "__metadata__"}
    assert {t.name: {"dtype": t.dtype, "shape": list(t.shape),
                     "data_offsets": [t.begin - h.data_start, t.end - h.data_start]} for t in h.tensors} == want
    assert h.metadata == header.get("__metadata__", {})


@st.composite
def mutations(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "delete", "insert", "truncate", "length", "splice"]))
    buf = bytearray(data)
    if kind == "flip" and buf:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= draw(st.integers(1, 255))
    elif kind == "delete" and buf:
        i = draw(st.integers(0, len(buf) - 1))
        del buf[i:i + draw(st.integers(1, 16))]
    elif kind == "insert":
        i = draw(st.integers(0, len(buf)))
        buf[i:i] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "truncate":
        del buf[draw(st.integers(0, len(buf))):]
    elif kind == "length" and len(buf) >= 8:
        buf[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    elif kind == "splice" and len(buf) > 8:  # a JSON token where one was
        i = draw(st.integers(8, len(buf) - 1))
        buf[i:i] = draw(st.sampled_from([b'"dtype"', b'"shape"', b'"data_offsets"', b"[", b"]", b"{", b"}",
                                         b",", b":", b"-1", b"1e999", b"NaN", b'"\\ud800"', b'"__metadata__"']))
    return bytes(buf)


@SETTINGS
@given(data=st.data(), f=valid_files())
def test_mutated_valid_files(scratch, data, f):
    _, raw = f
    check(_write(scratch, data.draw(mutations(raw))))


@SETTINGS
@given(f=valid_files(), path=st.data(), value=json_values)
def test_one_field_replaced_by_any_json(scratch, f, path, value):
    header, _ = f
    names_ = [k for k in header if k != "__metadata__"]
    if not names_:
        return
    name = path.draw(st.sampled_from(names_))
    field = path.draw(st.sampled_from(["dtype", "shape", "data_offsets", "__extra__", None]))
    if field is None:
        header[name] = value
    else:
        header[name][field] = value
    blob = json.dumps(header).encode()
    data_len = max((e["data_offsets"][1] for e in header.values() if isinstance(e, dict)
                    and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                    and isinstance(e["data_offsets"][1], int) and 0 <= e["data_offsets"][1] < 4096), default=0)
    check(_write(scratch, struct.pack("<Q", len(blob)) + blob + bytes(data_len)))


@SETTINGS
@given(index=json_values)
def test_arbitrary_index_json(scratch, index):
    """A sharded folder whose model.safetensors.index.json is any JSON value."""
    folder = scratch / "sharded"
    folder.mkdir(exist_ok=True)
    blob = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "s1.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(4))
    (folder / INDEX_JSON).write_text(json.dumps(index))
    try:
        open_checkpoint(folder)
    except CheckpointError as e:
        assert "\n" not in str(e)


@SETTINGS
@given(weight_map=st.dictionaries(st.sampled_from(["a", "b", ""]),
                                  st.sampled_from(["s1.safetensors", "../s1.safetensors", "/s1.safetensors",
                                                   "s1.safetensors/", "./s1.safetensors", "s2.safetensors",
                                                   "", ".", "..", "sub/../s1.safetensors", "s1.bin"]),
                                  max_size=3))
def test_weight_maps_with_hostile_names(scratch, weight_map):
    folder = scratch / "wm"
    folder.mkdir(exist_ok=True)
    blob = json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "s1.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(4))
    (folder / INDEX_JSON).write_text(json.dumps({"weight_map": weight_map}))
    try:
        ckpt = open_checkpoint(folder)
    except CheckpointError:
        return
    for h in ckpt.files:  # whatever opened lies inside the folder
        assert folder.resolve() in h.path.resolve().parents
