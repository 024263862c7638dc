"""The output's file layout is a function of the plan: the same plan gives the same files
(names, shard split, tensor order, header bytes) however the base is laid out on disk when
it is merged, and a plan made from a base laid out otherwise records that layout (so it has
another hash) and mirrors it (engine/layout.py)."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.cli import main
from mergepipe.engine.layout import canonical_layout, layout_record, plan_layout
from mergepipe.errors import ConfigError
from mergepipe.plan.planner import plan_hash
from mergepipe.util.fs import canonical_json

SHAPES = {"model.embed_tokens.weight": (256, 32), "model.norm.weight": (32,), "lm_head.weight": (256, 32),
          **{f"model.layers.{i}.{part}": shape for i in range(2) for part, shape in [
              ("mlp.up_proj.weight", (64, 32)), ("mlp.down_proj.weight", (32, 64)),
              ("input_layernorm.weight", (32,))]}}
NAMES = sorted(SHAPES)


def _write_file(path: Path, tensors: dict[str, np.ndarray], order: list[str], metadata: dict | None) -> None:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for n in order:
        header[n] = {"dtype": "F32", "shape": list(tensors[n].shape),
                     "data_offsets": [offset, offset + tensors[n].nbytes]}
        offset += tensors[n].nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n in order:
            f.write(tensors[n].astype("<f4").tobytes())


def write_model(folder: Path, tensors: dict[str, np.ndarray], files: list[list[str]] | None = None, *,
                metadata: dict | None = None, shard_names: list[str] | None = None) -> None:
    """A model folder of `tensors`: one file in name order unless `files` (tensor names per file)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    files = files or [sorted(tensors)]
    if len(files) == 1 and shard_names is None:
        _write_file(folder / "model.safetensors", tensors, files[0], metadata)
        return
    names = shard_names or [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map = {}
    for fname, part in zip(names, files):
        _write_file(folder / fname, tensors, part, metadata)
        weight_map |= dict.fromkeys(part, fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ways to lay out the same tensors (the same content hash): files of tensor names, header metadata
LAYOUTS = {
    "two-files": dict(files=[NAMES[::2], NAMES[1::2]]),
    "three-files-by-layer": dict(files=[NAMES[:3], NAMES[3:6], NAMES[6:]]),
    "one-file-reversed": dict(files=[NAMES[::-1]]),
    "one-file-with-metadata": dict(metadata={"format": "pt"}),
    "one-file-longer-header": dict(metadata={"note": "x" * 900}),
    "one-shard-named-otherwise": dict(files=[NAMES], shard_names=["weights.safetensors"]),
}
# the canonical layout under another file name: a single-file output is always model.safetensors
CANONICAL = {"one-shard-named-otherwise"}


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layout")
    rng = np.random.default_rng(0)
    base = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    for k in range(2):
        write_model(root / f"e{k}", {n: v + np.float32(0.01) * rng.standard_normal(v.shape).astype(np.float32)
                                     for n, v in base.items()})
    return {"root": root, "base": base}


def _params(tmp: Path, family: dict, **output) -> Path:
    root = family["root"]
    cfg = {"base": str(tmp / "base"), "method": "task_arithmetic", "budget": "full", "block_bytes": "4KiB",
           "experts": [{"name": f"e{k}", "path": str(root / f"e{k}"), "weight": 0.5} for k in range(2)],
           "output": {"dir": str(tmp / "out"), **output}, "cache_dir": str(tmp / "cache")}
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plan(tmp: Path, cfg: Path, name: str) -> Path:
    out = tmp / name
    assert main(["plan", str(cfg), "-o", str(out), "-q"]) == 0
    return out


def _merge(tmp: Path, plan: Path, name: str) -> Path:
    out = tmp / name  # a cache of its own: no merge restored from the store
    assert main(["merge", str(plan), "-o", str(out), "-q", "--cache-dir", str(tmp / f"cache-{name}")]) == 0
    return out


def _files(out: Path) -> dict[str, bytes]:
    """The published weight files, index json, config, card and manifest: name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "run.json"}


@pytest.mark.parametrize("how", list(LAYOUTS))
def test_the_same_plan_gives_the_same_files_whatever_the_base_layout(family, tmp_path, how, capsys):
    write_model(tmp_path / "base", family["base"])
    cfg = _params(tmp_path, family)
    plan = _plan(tmp_path, cfg, "plan.json")
    assert "layout" not in json.loads(plan.read_text())["output"]  # canonical: the plan hash it always had
    first = _merge(tmp_path, plan, "first")
    assert sorted(_files(first)) == ["README.md", "config.json", "manifest.json", "model.safetensors"]

    write_model(tmp_path / "base", family["base"], **LAYOUTS[how])  # re-laid-out: same tensors and bytes
    assert _files(_merge(tmp_path, plan, "again")) == _files(first)
    capsys.readouterr()
    assert main(["verify", str(first), "--inputs", "--replay"]) == 0
    assert "replay identical" in capsys.readouterr().out


@pytest.mark.parametrize("how", list(LAYOUTS))
def test_a_plan_of_another_layout_records_it_and_keeps_it(family, tmp_path, how, capsys):
    write_model(tmp_path / "base", family["base"])
    cfg = _params(tmp_path, family)
    canonical = json.loads(_plan(tmp_path, cfg, "canonical.json").read_text())
    write_model(tmp_path / "base", family["base"], **LAYOUTS[how])
    plan_path = _plan(tmp_path, cfg, "plan.json")
    plan = json.loads(plan_path.read_text())
    if how in CANONICAL:
        assert plan == canonical
        return
    assert "layout" in plan["output"] and plan["plan_hash"] != canonical["plan_hash"]
    mirrored = _merge(tmp_path, plan_path, "mirrored")
    base = open_checkpoint(tmp_path / "base")
    out = open_checkpoint(mirrored)
    if how.startswith("one-file"):
        assert [h.path.name for h in out.files] == ["model.safetensors"]
    else:  # the base's shard names and split
        assert [h.path.name for h in out.files] == [h.path.name for h in base.files]
    assert list(out.tensors.names) == list(base.tensors.names)  # and its tensor order
    assert all(o.data_start % 4096 == b.data_start % 4096 for o, b in zip(out.files, base.files))  # reflinkable

    write_model(tmp_path / "base", family["base"])  # back to the canonical layout: still this plan's files
    assert _files(_merge(tmp_path, plan_path, "again")) == _files(mirrored)
    capsys.readouterr()
    assert main(["verify", str(mirrored), "--inputs", "--replay"]) == 0


def test_shard_bytes_cut_the_name_order_not_the_base_order(family, tmp_path):
    write_model(tmp_path / "base", family["base"])
    cfg = _params(tmp_path, family, shard_bytes="40KiB")
    plan = _plan(tmp_path, cfg, "plan.json")
    assert "layout" not in json.loads(plan.read_text())["output"]
    first = _merge(tmp_path, plan, "first")
    assert "model.safetensors.index.json" in _files(first) and len(open_checkpoint(first).files) > 1
    write_model(tmp_path / "base", family["base"], files=[NAMES[::-1]])
    assert _files(_merge(tmp_path, plan, "again")) == _files(first)


def test_a_split_merge_writes_the_plan_layout_too(family, tmp_path):
    write_model(tmp_path / "base", family["base"], files=[NAMES[::2], NAMES[1::2]])
    plan = _plan(tmp_path, _params(tmp_path, family), "plan.json")
    whole = _merge(tmp_path, plan, "whole")
    write_model(tmp_path / "base", family["base"])  # the part jobs see another layout of the base
    cache = str(tmp_path / "cache-parts")
    for i in (1, 2):
        assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(tmp_path / "parts"), "-q",
                     "--cache-dir", cache]) == 0
    assert main(["gather", str(plan), str(tmp_path / "parts"), "--parts", "2", "-o", str(tmp_path / "gathered"),
                 "-q", "--cache-dir", cache]) == 0
    assert _files(tmp_path / "gathered") == _files(whole)


def test_a_layout_that_does_not_name_the_base_tensors_is_refused(family, tmp_path):
    write_model(tmp_path / "base", family["base"], files=[NAMES[::-1]])
    tensors = open_checkpoint(tmp_path / "base").tensors
    record = layout_record(open_checkpoint(tmp_path / "base"), dtype=None, shard_bytes=None)
    assert record["order"] == NAMES[::-1] and record["files"][0]["name"] == "model.safetensors"
    plan = {"output": {"dtype": None, "shard_bytes": None, "layout": record}}
    layout, _ = plan_layout(plan, tensors)
    assert [t.name for t in layout["model.safetensors"]] == NAMES[::-1]
    for bad, what in [({**record, "order": NAMES[1:]}, NAMES[0]), ({**record, "order": [*NAMES[1:], "x"]}, "x"),
                      ({**record, "files": [{**record["files"][0], "tensors": 3}]}, "tensors")]:
        with pytest.raises(ConfigError, match=what):
            plan_layout({"output": {**plan["output"], "layout": bad}}, tensors, where="p.json")


@pytest.mark.parametrize("edit, key", [
    (lambda rec: rec["files"][0].update(name="manifest.json"), "output.layout.files.0.name"),
    (lambda rec: rec["files"][0].update(data_start=5), "output.layout.files.0.data_start"),
    (lambda rec: rec["files"][0].update(tensors=-1), "output.layout.files.0.tensors"),
    (lambda rec: rec.update(order=[*rec["order"][1:], "model.norm.weightx"]), "output.layout.order"),
])
def test_an_edited_layout_in_a_plan_file_is_refused_in_one_line(family, tmp_path, capsys, edit, key):
    write_model(tmp_path / "base", family["base"], files=[NAMES[::-1]])
    path = _plan(tmp_path, _params(tmp_path, family), "plan.json")
    plan = json.loads(path.read_text())
    edit(plan["output"]["layout"])
    plan["plan_hash"] = plan_hash(plan)  # the hash has no key: an edit can recompute it
    path.write_bytes(canonical_json(plan))
    capsys.readouterr()
    assert main(["merge", str(path), "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and key in err, err
    assert not (tmp_path / "out").exists()


def test_the_canonical_layout_is_the_name_order_in_one_file(family, tmp_path):
    write_model(tmp_path / "base", family["base"], files=[NAMES[::2], NAMES[1::2]])
    tensors = open_checkpoint(tmp_path / "base").tensors
    layout, starts = canonical_layout(tensors, dtype=None, shard_bytes=None)
    assert list(layout) == ["model.safetensors"] and [t.name for t in layout["model.safetensors"]] == NAMES
    write_model(tmp_path / "base", family["base"])  # written so: the data start it mirrors
    assert starts == {"model.safetensors": open_checkpoint(tmp_path / "base").files[0].data_start % 4096}
    layout, starts = canonical_layout(tensors, dtype="bfloat16", shard_bytes=None)
    assert starts == {} and {t.dtype for t in layout["model.safetensors"]} == {"BF16"}  # cast: mirrors nothing
