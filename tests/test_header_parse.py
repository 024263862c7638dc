"""The safetensors header parser's two passes (checkpoint/safetensors.py): one column pass
accepts or refuses a header; a refused one is read again entry by entry only to name what
is wrong. Both must apply the same checks: a header the column pass refuses always gets a
named error, and one the column pass accepts never reaches the entry checks."""
from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergepipe.checkpoint import safetensors as sf
from mergepipe.errors import CheckpointError

SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
                    max_examples=300)
_NO_REASON = "no check names why"

# entries near the valid ones: each field drawn from good values and a few wrong ones
fields = st.fixed_dictionaries({
    "dtype": st.sampled_from(["BF16", "F32", "I8", "BF17", 3, None]),
    "shape": st.one_of(st.lists(st.integers(-1, 3), max_size=2), st.just([True]), st.just((2,)), st.just("2")),
    "data_offsets": st.one_of(st.lists(st.integers(-2, 12), min_size=2, max_size=2),
                              st.just([0]), st.just([0, 1.5]), st.just([False, 2])),
}, optional={"extra": st.just(1)})
headers = st.dictionaries(st.sampled_from(["a", "b", "c", "\ud800", "__metadata__"]),
                          fields | st.just([1]), max_size=4)
metadata = st.none() | st.just({"format": "pt"}) | st.just({"k": 1}) | st.just(0) | st.just([])


def _file(tmp_path, body: dict, data_len: int, *, compact: bool):
    raw = json.dumps(body, separators=(",", ":") if compact else None).encode("utf-8", "surrogatepass")
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    return path


@SETTINGS
@given(header=headers, meta=metadata, data_len=st.integers(0, 12), compact=st.booleans())
def test_a_refused_header_gets_a_named_error(tmp_path, header, meta, data_len, compact):
    body = header if meta is None else {"__metadata__": meta, **header}
    sf._LAST.clear()  # this file's parse, not the last header's entries
    try:
        h = sf.parse_header(_file(tmp_path, body, data_len, compact=compact))
    except CheckpointError as e:
        assert _NO_REASON not in str(e), str(e)
        return
    # accepted: the entry checks agree, tensor by tensor
    for t in h.tensors:
        assert sf._entry_span(h.path, t.name, body[t.name], data_len) == (t.begin - h.data_start,
                                                                           t.end - h.data_start, t.name)


def test_no_tensors(tmp_path):
    """An empty header is a valid file only with no data after it."""
    assert sf.parse_header(_file(tmp_path, {}, 0, compact=True)).tensors == ()
    sf._LAST.clear()
    with pytest.raises(CheckpointError, match="3 bytes after the last tensor are not described by the header"):
        sf.parse_header(_file(tmp_path, {"__metadata__": {}}, 3, compact=True))


def test_ties_name_the_later_entry(tmp_path):
    """Two entries at the same offsets: the overlap names the one later in the header."""
    entry = {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}
    for first, second in (("a", "b"), ("b", "a")):
        sf._LAST.clear()
        with pytest.raises(CheckpointError, match=f"tensor '{second}': data_offsets overlaps the previous tensor"):
            sf.parse_header(_file(tmp_path, {first: entry, second: entry}, 2, compact=True))
