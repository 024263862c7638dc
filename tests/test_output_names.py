"""The output's own files never collide with weight shards (issue 15, reserved names).

A base may name its shards anything a weight_map allows: README.md, config.json,
run.json, or the same file name in two subfolders. The output then names its
shards `model-0000i-of-0000n.safetensors`; its model card, config and run record
stay what they are, and the merged tensors equal those of the same merge from an
ordinarily named base.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from mergepipe.cli import main
from mergepipe.engine.layout import usable_shard_names
from mergepipe.output.manifest import load_manifest
from mergepipe.output.run_record import record_path

INDEX_JSON = "model.safetensors.index.json"


def _reshard(src: Path, dst: Path, names: list[str]) -> None:
    """Copy the single-file model `src` into `dst` split over shard files called `names`."""
    dst.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    keys = list(tensors)
    groups = [keys[i::len(names)] for i in range(len(names))]
    weight_map = {}
    for name, group in zip(names, groups):
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: tensors[k] for k in group}, dst / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    (dst / INDEX_JSON).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _params(tmp: Path, family: dict, base: Path, out: Path) -> Path:
    root = Path(family["root"])
    cfg = {"base": str(base), "experts": [{"name": "a", "path": str(root / "expert_1"), "weight": 1.0},
                                          {"name": "b", "path": str(root / "expert_2"), "weight": 0.5}],
           "method": "ties", "parameters": {"density": 0.5}, "seed": 0, "budget": "full",
           "block_bytes": "16KiB", "output": {"dir": str(out)}, "cache_dir": str(tmp / "cache")}
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _tensors(out: Path) -> dict:
    got = {}
    for p in out.glob("*.safetensors"):
        got.update(load_file(p))
    return got


@pytest.fixture(scope="module")
def reference(tiny_family, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    out = tmp / "ref"
    base = Path(tiny_family["root"]) / "base"
    assert main(["run", str(_params(tmp, tiny_family, base, out)), "-q"]) == 0
    return out


@pytest.mark.parametrize("names", [["README.md", "config.json", "run.json"],
                                   ["manifest.json", "tokenizer.json", INDEX_JSON + ".bak"],
                                   ["a/model.safetensors", "b/model.safetensors"],
                                   ["x.safetensors", "sub/x.safetensors", ".hidden.safetensors"]])
def test_base_shards_with_reserved_or_duplicate_names(names, tiny_family, reference, tmp_path):
    base = tmp_path / "base"
    _reshard(Path(tiny_family["root"]) / "base", base, names)
    out = tmp_path / "out"
    assert main(["run", str(_params(tmp_path, tiny_family, base, out)), "-q"]) == 0
    assert main(["verify", str(out)]) == 0
    n = len(names)
    shards = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    man = load_manifest(out)
    assert sorted(man["outputs"]["files"]) == sorted([*shards, INDEX_JSON, "README.md"])
    assert (out / "README.md").read_text().startswith("---")  # the model card, not a shard
    assert not (out / "run.json").exists() and "seconds" in json.loads(record_path(out).read_text())
    assert not (out / "config.json").exists()  # the base's "config.json" is weights, never copied as config
    index = json.loads((out / INDEX_JSON).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    got, want = _tensors(out), _tensors(reference)
    assert sorted(got) == sorted(want)
    assert all(got[k].equal(want[k]) for k in want)
    assert man["outputs"]["tensors"] == load_manifest(reference)["outputs"]["tensors"]


def test_usual_shard_names_are_kept():
    assert usable_shard_names(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    assert usable_shard_names(["pytorch_model-1.safetensors", "extra.safetensors"])
    for bad in (["README.md", "x.safetensors"], ["x.safetensors", "x.safetensors"], ["config.json"],
                [".x.safetensors"], ["run.json"], ["model.safetensors.index.json"]):
        assert not usable_shard_names(bad), bad


def test_base_aux_files_still_copied_when_not_weights(tiny_family, tmp_path):
    """An ordinary sharded base keeps its shard names, and its config.json is copied."""
    base = tmp_path / "base"
    _reshard(Path(tiny_family["root"]) / "base", base, ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"])
    shutil.copyfile(Path(tiny_family["root"]) / "base" / "config.json", base / "config.json")
    out = tmp_path / "out"
    assert main(["run", str(_params(tmp_path, tiny_family, base, out)), "-q"]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                  "model-00002-of-00002.safetensors"]
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
