"""Red-team pass 7 (issue 15): the cache as untrusted input, and gc on a shared folder. Each
test published a model that verify called OK, or lost a user's file, before its fix."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from mergepipe.cli import main
from mergepipe.index import binfmt, sketch
from mergepipe.util.fs import canonical_json
from tests.helpers import write_config


def _merge(cfg: Path, out: Path) -> bytes:
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["verify", str(out)]) == 0
    return (out / "model.safetensors").read_bytes()


def test_another_models_index_copied_under_this_key_is_rebuilt(tiny_family, tmp_path):
    """A model index (.idx) of another expert of the same shapes copied over this expert's
    entry is self-consistent (its block hashes give its content hash): at a budget where
    every block is sketched nothing was read to catch it, and a model of the other
    expert's sketches was published that plain verify called OK. The recorded file
    fingerprints are now checked against the index's block hashes: it is rebuilt."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, tiny_family, budget="3%")
    want = _merge(cfg, out)
    plan = json.loads((out / "manifest.json").read_text())["plan"]
    by_name = {e["name"]: e["content_hash"] for e in plan["experts"]}
    idx = {binfmt.decode_model(p.read_bytes()).content_hash: p for p in (tmp_path / "cache" / "models").glob("*.idx")}
    shutil.copyfile(idx[by_name["e2"]], idx[by_name["e1"]])  # two single-file experts, same shapes
    shutil.rmtree(out)
    shutil.rmtree(tmp_path / "cache" / "merges")
    assert _merge(cfg, out) == want
    assert json.loads((out / "run.json").read_text())["index_builds"] >= 1


def test_a_sketch_scale_edited_alone_is_rebuilt(tiny_family, tmp_path):
    """A sketch header's scales (alpha) are not covered by the codes' blake3: halved in place,
    the file passed every check and the merge used them. alpha must be float32(s1 / nnz)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, tiny_family, budget="3%")
    want = _merge(cfg, out)
    for f in (tmp_path / "cache" / "sketch").glob("*.sk"):
        raw = f.read_bytes()
        with open(f, "rb") as fh:
            off, hlen = sketch._trailer(fh, len(raw))
        head = json.loads(raw[off:off + hlen])
        for rows in head["tensors"].values():
            for r in rows:
                if r:
                    r[2] = r[2] / 2
        new = canonical_json(head)
        f.write_bytes(raw[:off] + new + struct.pack("<Q", len(new)) + sketch.MAGIC)
    shutil.rmtree(out)
    shutil.rmtree(tmp_path / "cache" / "merges")
    assert _merge(cfg, out) == want


def test_gc_keeps_a_users_part_named_files(tiny_family, tmp_path, capsys):
    """`gc --cache-dir` on a project folder removed a user's parts/part-1-of-2.safetensors (any
    file with a part's name). A part file is now removed only beside its sidecar (which
    records the .safetensors' size); the part jobs' own files still go."""
    project = tmp_path / "project"
    (project / "parts").mkdir(parents=True)
    mine = {"part-1-of-2.safetensors": (Path(tiny_family["root"]) / "expert_1" / "model.safetensors").read_bytes(),
            "part-2-of-2.json": b'{"notes": 1}\n', "part-2-of-2.safetensors": b"x"}
    for name, data in mine.items():
        (project / "parts" / name).write_bytes(data)
    assert main(["gc", "--cache-dir", str(project), "-q"]) == 0
    assert {p.name: p.read_bytes() for p in (project / "parts").iterdir()} == mine
    cfg = write_config(tmp_path, tiny_family)
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan)]) == 0
    parts = tmp_path / "cache" / "parts"
    for i in (1, 2):
        assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(parts), "-q"]) == 0
    assert len(list(parts.iterdir())) == 4
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "-q"]) == 0
    assert not list(parts.iterdir())
