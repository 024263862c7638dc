import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.errors import CheckpointError
from mergepipe.checkpoint.safetensors import (CheckpointReader, OutTensor, SafetensorsWriter, as_tensor,
                                              open_checkpoint, parse_header, tensor_bytes)


def _raw(path, header: dict | bytes, data: bytes = b"") -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_header_round_trip_against_safetensors(tmp_path):
    tensors = {"w": torch.randn(7, 3).bfloat16(), "b": torch.arange(5, dtype=torch.int64),
               "s": torch.tensor(2.5), "h": torch.randn(4, 2, 2).half(), "d": torch.randn(3).double()}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"k": "v"})
    h = parse_header(tmp_path / "m.safetensors")
    assert h.metadata == {"k": "v"}
    ckpt = open_checkpoint(tmp_path / "m.safetensors")
    with CheckpointReader(ckpt) as r:
        for name, t in ckpt.tensors.items():
            got = as_tensor(r.read_range(t, t.begin, t.end), t.dtype, t.shape)
            assert torch.equal(got, tensors[name]), name


@pytest.mark.parametrize("header,data,match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "out of range"),
    ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
    ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "not described"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    (b"[1, 2]", b"", "JSON object"),
    (b"{\"a\": ", b"", "not valid JSON"),
    (b"\xff\xfe", b"", "UTF-8"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4, "duplicate"),
])
def test_malformed_headers_name_the_file(tmp_path, header, data, match):
    path = tmp_path / "bad.safetensors"
    _raw(path, header, data)
    with pytest.raises(CheckpointError, match=match) as e:
        parse_header(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_header_length_checks(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match="past the end"):
        parse_header(p)
    p.write_bytes(struct.pack("<Q", 200 * 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="limit"):
        parse_header(p)
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="8-byte"):
        parse_header(p)


def test_folder_rules(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors"):
        open_checkpoint(tmp_path / "empty")
    (tmp_path / "pick").mkdir()
    (tmp_path / "pick" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="pickle"):
        open_checkpoint(tmp_path / "pick")
    shard = tmp_path / "shard"
    shard.mkdir()
    save_file({"a": torch.zeros(2)}, shard / "s1.safetensors")
    for wm, match in [({"a": "../s1.safetensors"}, "leaves"), ({"a": "/etc/passwd"}, "invalid"),
                      ({"a": "missing.safetensors"}, "missing file"), ({"b": "s1.safetensors"}, "not in")]:
        (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        with pytest.raises(CheckpointError, match=match):
            open_checkpoint(shard)
    os.symlink(tmp_path / "pick" / "pytorch_model.bin", shard / "link.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "link.safetensors"}}))
    with pytest.raises(CheckpointError, match="leaves"):
        open_checkpoint(shard)


def test_a_hub_snapshot_of_a_sharded_model_opens(tmp_path):
    """Its shards link into the repo's blob store; a link anywhere else still leaves the folder."""
    repo = tmp_path / "models--org--name"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    weight_map = {}
    for i, name in enumerate(("a", "b")):
        save_file({name: torch.full((3,), float(i))}, blobs / f"h{i}")
        os.symlink(f"../../blobs/h{i}", snap / f"s{i}.safetensors")
        weight_map[name] = f"s{i}.safetensors"
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert sorted(open_checkpoint(snap).names) == ["a", "b"]
    (tmp_path / "elsewhere").mkdir()
    save_file({"b": torch.zeros(3)}, tmp_path / "elsewhere" / "x")
    (snap / "s1.safetensors").unlink()
    os.symlink(tmp_path / "elsewhere" / "x", snap / "s1.safetensors")
    with pytest.raises(CheckpointError, match="leaves the model folder"):
        open_checkpoint(snap)


def _rchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError


def test_partial_read_reads_only_the_block(tmp_path):
    """One 1 MiB block of a 100 MiB file: the counters and the kernel's rchar agree."""
    path = tmp_path / "big.safetensors"
    rows = 100
    save_file({"w": torch.zeros(rows, 1 << 18)}, path)  # 100 rows x 1 MiB
    ckpt = open_checkpoint(path)
    with CheckpointReader(ckpt) as r:
        before = _rchar()
        buf = r.read_rows("w", 40, 41)
        delta = _rchar() - before
    assert len(buf) == 1 << 20
    assert r.counter.total == 1 << 20
    assert 1 << 20 <= delta < (1 << 20) + 64 * 1024  # the block, plus at most a little of python's own reading
    os.unlink(path)


def test_coalesced_reads(tmp_path):
    save_file({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4)}, tmp_path / "m.safetensors")
    ckpt = open_checkpoint(tmp_path / "m.safetensors")
    with CheckpointReader(ckpt) as r:
        bufs = r.read_blocks("w", [(0, 2), (2, 3), (5, 7)])
        assert r.counter.total == 7 * 16 - 2 * 16
    assert [as_tensor(b, "F32", (len(b) // 16, 4))[0, 0].item() for b in bufs] == [0.0, 8.0, 20.0]


def test_writer_any_order_loads_with_safetensors(tmp_path):
    a, b = torch.randn(6, 4).bfloat16(), torch.randn(3).float()
    w = SafetensorsWriter(tmp_path / "o.safetensors", [OutTensor("a", "BF16", (6, 4)), OutTensor("b", "F32", (3,))])
    w.write_rows("b", 0, tensor_bytes(b))
    w.write_rows("a", 3, tensor_bytes(a[3:]))
    w.write_rows("a", 0, tensor_bytes(a[:3]))
    w.close()
    with safe_open(tmp_path / "o.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("a"), a) and torch.equal(f.get_tensor("b"), b)
