"""Unplanned output regions copied file to file, and output hashes composed from block
hashes (issue 13; docs/design.md "Outputs and manifest"):

- where no expert block is planned (dtype unchanged) the output holds exactly the base's
  bytes, copied in the kernel (copy_file_range) or, where refused, by pread/pwrite, with
  the same output and manifest either way;
- the composed hashes the merge records (copied blocks from the base index, written
  blocks hashed once) equal the ones recomputed from the files (`treehash.hash_weight_file`,
  `verify --deep`), whatever the chunking.
"""
from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import pytest
from blake3 import blake3

from mergepipe.checkpoint import treehash
from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.cli import main
from mergepipe.index.store import Store
from mergepipe.output.manifest import load_manifest
from mergepipe.util import fs
from tests.corpus.procs import params

BB = 16 << 10


def _family(tiny_family) -> dict:
    root = Path(tiny_family["root"])
    return {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}


def _merge(tmp_path: Path, family: dict, name: str, **kw) -> Path:
    out = tmp_path / name
    cfg = params(tmp_path / f"{name}.yaml", family, out, tmp_path / f"cache-{name}", **kw)
    assert main(["run", str(cfg), "-q"]) == 0
    return out


@pytest.mark.parametrize("method,budget", [("task_arithmetic", "10%"), ("ties", "30%"), ("task_arithmetic", "full")])
def test_copied_regions_are_the_base_bytes_and_hashes_compose(tiny_family, tmp_path, method, budget):
    family = _family(tiny_family)
    extra = {"parameters": {"density": 0.5}} if method == "ties" else {}
    out = _merge(tmp_path, family, "out", method=method, budget=budget, **extra)
    man = load_manifest(out)
    plan = man["plan"]
    base = open_checkpoint(family["base"])
    _, bi = Store(tmp_path / "cache-out").model_index(family["base"], block_bytes=BB)
    merged = open_checkpoint(out)
    copied = 0
    with open(base.files[0].path, "rb") as fb, open(merged.files[0].path, "rb") as fo:
        for name, t in base.tensors.items():
            sketched = (plan.get("strategy") or {}).get("sketch", {}).get("blocks", {})  # merged, not copied
            planned = set().union(*(r.get(name, ()) for r in [*plan["reads"].values(), *sketched.values()]))
            o = merged.tensors[name]
            for b, (r0, r1) in enumerate(bi.tensors[name].ranges):
                if b in planned:
                    continue
                n = (r1 - r0) * t.row_bytes()
                fb.seek(t.begin + r0 * t.row_bytes())
                fo.seek(o.begin + r0 * t.row_bytes())
                assert fb.read(n) == fo.read(n), (name, b)
                copied += n
    assert man["bytes"]["base_bytes_copied"] == copied
    assert man["bytes"]["base_bytes_read"] + copied == base.total_bytes
    digest, tensors = treehash.hash_weight_file(out / "model.safetensors", plan["block_bytes"])
    assert man["outputs"]["files"]["model.safetensors"]["tree"] == digest
    assert man["outputs"]["tensors"] == tensors
    assert main(["verify", str(out), "--deep"]) == 0


def test_fallback_copy_gives_the_same_output_and_manifest(tiny_family, tmp_path, monkeypatch):
    family = _family(tiny_family)
    first = _merge(tmp_path, family, "kernel", budget="25%")

    def refused(*a, **kw):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refused)
    second = _merge(tmp_path, family, "fallback", budget="25%")
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    a, b = load_manifest(first), load_manifest(second)
    assert a["outputs"] == b["outputs"] and a["bytes"] == b["bytes"]


def test_sharded_base_and_dtype_change(tiny_family, tmp_path):
    """expert_0 is sharded in the tiny family: merging with it as the base gives a sharded
    output; a dtype change copies nothing (every block is cast)."""
    root = Path(tiny_family["root"])
    family = {"base": root / "expert_0", "experts": [root / "base", root / "expert_1"]}
    out = _merge(tmp_path, family, "sharded", budget="20%")
    man = load_manifest(out)
    assert man["bytes"]["base_bytes_copied"] > 0
    assert main(["verify", str(out), "--deep"]) == 0
    cast = _merge(tmp_path, _family(tiny_family), "cast", budget="20%", output={"dir": str(tmp_path / "cast"),
                                                                                  "dtype": "float32"})
    assert load_manifest(cast)["bytes"]["base_bytes_copied"] == 0
    assert main(["verify", str(cast), "--deep"]) == 0


def test_copy_range_kernel_and_fallback(tmp_path, monkeypatch):
    rng = random.Random(3)
    data = bytes(rng.randrange(256) for _ in range(300_000))
    src = tmp_path / "src"
    src.write_bytes(data)
    for refuse in (None, errno.EXDEV, errno.ENOSYS, errno.EINVAL):
        if refuse is not None:
            def refused(*a, _e=refuse, **kw):
                raise OSError(_e, os.strerror(_e))
            monkeypatch.setattr(os, "copy_file_range", refused)
        dst = tmp_path / f"dst-{refuse}"
        dst.write_bytes(b"\0" * 200_000)
        with open(src, "rb") as s, open(dst, "r+b") as d:
            kernel = fs.copy_range(s.fileno(), 1234, d.fileno(), 777, 150_001, chunk_bytes=4096)
        assert kernel == (150_001 if refuse is None else 0)
        got = dst.read_bytes()
        assert got[777:777 + 150_001] == data[1234:1234 + 150_001]
        assert got[:777] == b"\0" * 777 and got[777 + 150_001:] == b"\0" * (200_000 - 777 - 150_001)
        with open(src, "rb") as s, open(dst, "r+b") as d, pytest.raises(OSError):
            fs.copy_range(s.fileno(), len(data) - 10, d.fileno(), 0, 100)  # the source ends first
    monkeypatch.undo()

    def broken(*a, **kw):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "copy_file_range", broken)
    with open(src, "rb") as s, open(tmp_path / "x", "wb") as d, pytest.raises(OSError):
        fs.copy_range(s.fileno(), 0, d.fileno(), 0, 100)  # a real error is not papered over


def test_tensor_hasher_any_chunking_and_known_digests():
    rng = random.Random(5)
    for sizes in ([0], [], [5], [4096, 4096, 100], [0, 0], [1, 2, 3, 4, 5, 6, 7], [70_000, 70_000]):
        data = bytes(rng.randrange(256) for _ in range(sum(sizes)))
        blocks, pos = [], 0
        for n in sizes:
            blocks.append(blake3(data[pos:pos + n]).digest())
            pos += n
        want = treehash.tensor_digest(blocks)
        for _ in range(5):
            h = treehash.TensorHasher(sizes)
            pos = 0
            while pos < len(data):
                n = rng.randrange(1, 9000)
                h.update(data[pos:pos + n])
                pos += n
            assert h.digest() == want, sizes
        if len(sizes) >= 2:  # the first block from its digest, the rest from bytes
            h = treehash.TensorHasher(sizes)
            h.add_digests(blocks[:1])
            h.update(data[sizes[0]:])
            assert h.digest() == want
    h = treehash.TensorHasher([10, 10])
    h.update(b"x" * 5)
    with pytest.raises(ValueError):
        h.add_digests([b"\0" * 32])  # not at a block boundary
    with pytest.raises(ValueError):
        treehash.TensorHasher([3]).update(b"abcd")
    with pytest.raises(ValueError):
        treehash.TensorHasher([3]).digest()


def test_manifest_documents_its_schema(tiny_family, tmp_path):
    out = _merge(tmp_path, _family(tiny_family), "m", budget="50%")
    man = json.loads((out / "manifest.json").read_text())
    assert man["schema"] == 2
    assert set(man["outputs"]["files"]["model.safetensors"]) == {"tree", "size"}
    assert all("blake3" in r for n, r in man["outputs"]["files"].items() if not n.endswith(".safetensors"))
