"""Scale in tensor count (issue 15): runs of small tensors are merged, copied, written and
hashed as packs (engine/packs.py). The packed engine must give the bytes and the manifest
of the tensor-by-tensor engine, for every kind of run a pack can meet (merged and copied,
bf16 and fp32, 0-d, int, zero-size, large multi-block tensors in between, two shards, a
budget that reads only some tensors, a method whose kernel is not elementwise), and it must
need a bounded number of writes, not one per tensor."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.checkpoint.safetensors import SafetensorsWriter
from mergepipe.cli import main
from mergepipe.engine import merge as engine

N_SMALL = 600  # small tensors per shard


def _tensors(g: torch.Generator, shift: float, shard: int) -> dict[str, torch.Tensor]:
    """A shard of mostly tiny tensors: every 7th identical to the base (a copied run inside a
    merged one), some fp32, 0-d and int ones, and a 3-block tensor and an empty one between runs."""
    out: dict[str, torch.Tensor] = {}
    for i in range(N_SMALL):
        name = f"s{shard}.t{i:04d}"
        x = torch.randn(1 + i % 5, generator=g)
        if i % 7 and shift:
            x = x + shift * (1 + i % 3)
        if i % 50 == 17:
            out[name] = x.float()
        elif i % 97 == 3:
            out[name] = torch.tensor(float(i % 11) + shift).bfloat16()  # 0-d
        elif i % 89 == 5:
            out[name] = torch.tensor([i, i + 1], dtype=torch.int64)
        else:
            out[name] = x.bfloat16()
        if i == 300:
            out[f"s{shard}.big"] = (torch.randn(3, 2048, generator=g) + shift).bfloat16()  # 3 blocks of 4 KiB
            out[f"s{shard}.empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return out


def _write_model(folder: Path, shift: float) -> None:
    """Two shards and their index json; each model draws the same base values."""
    folder.mkdir(parents=True)
    weight_map = {}
    for shard in (1, 2):
        g = torch.Generator().manual_seed(shard)
        tensors = _tensors(g, shift, shard)
        fname = f"model-{shard:05d}-of-00002.safetensors"
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many")
    for name, shift in (("base", 0.0), ("e1", 0.25), ("e2", -0.125)):
        _write_model(root / name, shift)
    return root


def _run(family: Path, tmp: Path, method: str, parameters: dict, budget: str) -> Path:
    cfg = {"base": str(family / "base"), "method": method, "parameters": parameters, "seed": 0,
           "experts": [{"name": "e1", "path": str(family / "e1"), "weight": 1.0},
                       {"name": "e2", "path": str(family / "e2"), "weight": 0.5}],
           "budget": budget, "block_bytes": "4KiB", "output": {"dir": str(tmp / "out")},
           "cache_dir": str(tmp / "cache")}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / "params.yaml"), "-q"]) == 0
    assert main(["verify", str(tmp / "out")]) == 0
    return tmp / "out"


@pytest.mark.parametrize(("method", "parameters", "budget"), [
    ("task_arithmetic", {}, "full"),
    ("task_arithmetic", {"lambda": 0.7, "normalize": True}, "40%"),
    ("ties", {"density": 0.5}, "full"),
    ("dare_linear", {"density": 0.8}, "60%"),
])
def test_packed_engine_gives_the_per_tensor_bytes(family, tmp_path, monkeypatch, method, parameters, budget):
    packed = _run(family, tmp_path / "packed", method, parameters, budget)
    with monkeypatch.context() as mp:
        mp.setattr(engine, "packable", lambda t, ranges: False)  # every tensor on its own
        plain = _run(family, tmp_path / "plain", method, parameters, budget)
    names = sorted(p.name for p in plain.iterdir())
    assert names == sorted(p.name for p in packed.iterdir())
    for name in names:
        if name != "run.json":  # timings
            assert (packed / name).read_bytes() == (plain / name).read_bytes(), name


def test_small_tensors_are_written_in_packs(family, tmp_path, monkeypatch):
    writes = []
    real = SafetensorsWriter.write_rows

    def counted(self, name, row_start, data):
        writes.append(name)
        return real(self, name, row_start, data)

    monkeypatch.setattr(SafetensorsWriter, "write_rows", counted)
    _run(family, tmp_path, "task_arithmetic", {}, "full")
    # 2 x 600 small tensors; packs break at the copied ones, the fp32 and int ones, and
    # the big tensor: a few hundred writes at most, against one per tensor (1,200+)
    assert 0 < len(writes) < 600


def test_batched_index_equals_tensor_by_tensor(family, monkeypatch):
    """Index batches (index/build.py: small tensors read in few preads, one task per batch)
    give the records and the read counts of one task per tensor."""
    from mergepipe.checkpoint.safetensors import ReadCounter, open_checkpoint
    from mergepipe.index import build

    def index(batched: bool):
        with monkeypatch.context() as mp:
            if not batched:
                mp.setattr(build, "SMALL_TENSOR_BYTES", -1)
            base, e1 = open_checkpoint(family / "base"), open_checkpoint(family / "e1")
            counter = ReadCounter()
            bi = build.build_model_index(base, block_bytes=4096, counter=counter)
            ei, delta = build.build_expert_index(base, e1, bi, block_bytes=4096, counter=counter)
            again = build.build_delta_index(base, e1, bi, ei, counter=counter)
            return bi, ei, delta, again, counter.by_file

    batched, plain = index(True), index(False)
    assert batched == plain
    assert batched[2] == batched[3]


def test_truncated_file_in_a_batch_names_the_tensor(tmp_path):
    from mergepipe.checkpoint.safetensors import open_checkpoint
    from mergepipe.errors import CheckpointError
    from mergepipe.index import build

    tensors = {f"t{i}": torch.full((3,), float(i)).bfloat16() for i in range(10)}
    (tmp_path / "m").mkdir()
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    ckpt = open_checkpoint(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])  # t9 loses its last two elements
    with pytest.raises(CheckpointError, match="'t9'.*truncated"):
        build.build_model_index(ckpt, block_bytes=4096)


@pytest.mark.parametrize("row", [("a", "BF16", (1,), ("ab" * 32,)), ('we"ird\\näme\u2028\x00', "F32", (), ()),
                                 ("x", "I64", (3, 0, 5), ("00" * 32, "ff" * 32)), ("\U0001f600", "BF16", (2**50, 0), ("h",)),
                                 ("t", "BF16", (True, 2), ("h",))])
def test_content_hash_rows_are_the_json_text(row):
    """index/records.py builds each content-hash row without json.dumps (it dominated cached
    loads of 100k tensors): the text must be json.dumps's, odd names and types included."""
    from mergepipe.index.records import TensorEntry, _row_json
    name, dtype, shape, hashes = row
    entry = TensorEntry(name, dtype, shape, tuple((0, 1) for _ in hashes), hashes)
    assert _row_json(name, entry) == json.dumps([name, dtype, list(shape), list(hashes)])
