"""The store's binary index format (index/binfmt.py, issue 13): it round-trips model and
delta indexes exactly (same records as the JSON form, same content hashes), and any file
that is not a well-formed one of ours (old .json.gz entries, truncated, flipped bytes,
wrong version, garbage, a consistent file that does not describe the checkpoint) is a
cache miss: the index is rebuilt, never trusted, never a crash."""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
from blake3 import blake3

from mergepipe.checkpoint.blocks import DEFAULT_BLOCK_BYTES
from mergepipe.index import binfmt
from mergepipe.index.records import ModelIndex, TensorEntry, content_hash
from mergepipe.index.store import Store

BB = 16 << 10


@pytest.fixture(scope="module")
def built(tiny_family, tmp_path_factory):
    root = Path(tiny_family["root"])
    cache = tmp_path_factory.mktemp("cache")
    st = Store(cache)
    base, bi = st.model_index(root / "base", block_bytes=BB)
    ck, ei, delta = st.expert_index(root / "expert_0", base, bi)
    return root, cache, bi, ei, delta


def test_round_trip_is_exact(built):
    _, _, bi, ei, delta = built
    for index in (bi, ei):
        back = binfmt.decode_model(binfmt.encode_model(index))
        assert back == index and back.to_json() == index.to_json()
        assert content_hash(back.tensors) == index.content_hash
    back = binfmt.decode_delta(binfmt.encode_delta(delta))
    assert json.dumps(back.to_json(), sort_keys=True) == json.dumps(delta.to_json(), sort_keys=True)
    assert any(t.block_eq for t in delta.tensors.values()) or True  # split-run counts when the family has them


def test_encoding_is_deterministic_and_checksummed(built):
    _, _, bi, _, delta = built
    data = binfmt.encode_model(bi)
    assert data == binfmt.encode_model(bi)
    assert data[:8] == binfmt.MAGIC and blake3(data[:-32]).digest() == data[-32:]
    assert binfmt.encode_delta(delta) == binfmt.encode_delta(delta)


def _reseal(body: bytes) -> bytes:
    return body + blake3(body).digest()


def test_malformed_files_raise_only_binformaterror(built):
    _, _, bi, _, delta = built
    rng = random.Random(0)
    for good, decode in ((binfmt.encode_model(bi), binfmt.decode_model),
                         (binfmt.encode_delta(delta), binfmt.decode_delta)):
        bad = [b"", b"MPINDEX\0", good[:-1], good[:100], b"x" * len(good),
               good[:8] + struct.pack("<I", binfmt.VERSION + 1) + good[12:],  # unknown version
               _reseal(good[:8] + struct.pack("<I", binfmt.VERSION + 1) + good[12:-32])]
        for _ in range(200):  # flipped bytes, with and without a recomputed checksum
            b = bytearray(good)
            b[rng.randrange(len(b) - 32)] ^= 1 << rng.randrange(8)
            bad.append(bytes(b))
            bad.append(_reseal(bytes(b[:-32])))
        for _ in range(50):  # the header replaced by random JSON-ish bytes of the same length
            _, _, _, hlen = struct.unpack_from("<8sIIQ", good)
            junk = rng.choice([b"[]", b"{}", b'{"meta":1}', b'{"meta":{},"tensors":[[1]],"arrays":{}}',
                               b'{"meta":{"content_hash":"x","block_bytes":1},"tensors":[["a","F32",[-1],1]],'
                               b'"arrays":{"ranges":[0,2,"q"]}}'])
            bad.append(_reseal(good[:24] + junk.ljust(hlen) + good[24 + hlen:-32]))
        for data in bad:
            try:
                decode(data)
            except binfmt.BinFormatError:
                pass


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "models").glob("*.idx")) + sorted((cache / "deltas").glob("*.idx"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "version", "old_json", "consistent_lie",
                                    "wrong_shape"])
def test_damaged_store_entries_are_rebuilt(tiny_family, tmp_path, damage):
    root = Path(tiny_family["root"])
    st = Store(tmp_path / "cache")
    base, bi = st.model_index(root / "base", block_bytes=BB)
    _, ei, delta = st.expert_index(root / "expert_1", base, bi)
    for p in _entries(tmp_path / "cache"):
        data = p.read_bytes()
        if damage == "truncate":
            p.write_bytes(data[:len(data) // 2])
        elif damage == "flip":
            p.write_bytes(data[:50] + bytes([data[50] ^ 4]) + data[51:])
        elif damage == "garbage":
            p.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)
        elif damage == "version":
            p.write_bytes(_reseal(data[:8] + struct.pack("<I", 99) + data[12:-32]))
        elif damage == "old_json":  # an entry of the previous format under the new name
            p.write_bytes(json.dumps({"content_hash": bi.content_hash}).encode())
        elif p.parent.name == "models":
            idx = binfmt.decode_model(data)
            first = next(iter(idx.tensors.values()))
            if damage == "consistent_lie":  # a block hash changed, content hash not recomputed
                t = TensorEntry(first.name, first.dtype, first.shape, first.ranges, ("0" * 64,) + first.hashes[1:])
            else:
                t = TensorEntry(first.name, first.dtype, first.shape + (1,), first.ranges, first.hashes)
            p.write_bytes(binfmt.encode_model(ModelIndex(idx.content_hash, idx.block_bytes,
                                                         {**idx.tensors, first.name: t})))
    again = Store(tmp_path / "cache")
    base2, bi2 = again.model_index(root / "base", block_bytes=BB)
    _, ei2, delta2 = again.expert_index(root / "expert_1", base2, bi2)
    assert (bi2, ei2) == (bi, ei)
    assert json.dumps(delta2.to_json(), sort_keys=True) == json.dumps(delta.to_json(), sort_keys=True)
    assert again.builds >= 1
    for p in _entries(tmp_path / "cache"):  # rewritten well-formed
        (binfmt.decode_model if p.parent.name == "models" else binfmt.decode_delta)(p.read_bytes())


def test_cached_index_imports_no_numpy(tiny_family, tmp_path):
    import subprocess
    import sys
    root = Path(tiny_family["root"])
    args = ["index", str(root / "expert_2"), "--base", str(root / "base"), "--cache-dir", str(tmp_path / "c"), "-q"]
    from mergepipe.cli import main
    assert main(args) == 0
    code = ("import sys; from mergepipe.cli import main; assert main(sys.argv[1:]) == 0; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'numba')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert DEFAULT_BLOCK_BYTES > 0
