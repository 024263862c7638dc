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
from mergepipe.output.run_record import record_path
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
    assert json.loads(record_path(out).read_text())["index_builds"] >= 1


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


def test_merge_part_never_replaces_a_users_file_of_a_parts_name(tiny_family, tmp_path, capsys):
    """`merge --part 1/2 -o FOLDER` replaced FOLDER's part-1-of-2.safetensors (a user's download)
    and part-2-of-2.json whatever they were. Now refused (exit 7) unless --force; a part job's
    own files are still replaced by a rerun."""
    cfg = write_config(tmp_path, tiny_family)
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan)]) == 0
    folder = tmp_path / "downloads"
    folder.mkdir()
    mine = {"part-1-of-2.safetensors": (Path(tiny_family["root"]) / "expert_1" / "model.safetensors").read_bytes(),
            "part-2-of-2.json": b'{"notes": 1}\n'}
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    capsys.readouterr()
    for i in (1, 2):
        assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(folder), "-q"]) == 7
        err = capsys.readouterr().err
        assert "not a part file mergepipe wrote" in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == mine
    parts = tmp_path / "parts"
    for _ in range(2):  # a rerun replaces the part job's own files
        for i in (1, 2):
            assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(parts), "-q"]) == 0
    assert main(["gather", str(plan), str(parts), "--parts", "2", "-o", str(tmp_path / "out"), "-q"]) == 0
    assert main(["verify", str(tmp_path / "out")]) == 0
    assert main(["merge", str(plan), "--part", "1/2", "-o", str(folder), "-q", "--force"]) == 0


def test_reimporting_never_replaces_a_fine_tune_saved_into_the_stacked_folder(tiny_family, tmp_path, capsys):
    """A stacked folder (`params.stacked/`, from import-mergekit) was replaced whole by the next
    import as long as it held stack.json: a fine-tune saved into it (`save_pretrained` there)
    and the user's notes were lost. A previous stack is now replaced only while it holds only
    a stack's files and its model.safetensors holds the bytes the import wrote (their blake3)."""
    import yaml
    root = Path(tiny_family["root"])
    mk = tmp_path / "frankenmerge.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(root / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(root / "expert_1"), "layer_range": [2, 4]}]}]}))
    params = tmp_path / "params.yaml"
    stacked = tmp_path / "params.stacked"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 0  # a stack replaces a stack
    weights = stacked / "model.safetensors"
    fine_tune = weights.read_bytes()[:-4] + b"\x01\x02\x03\x04"  # the same size, written in place
    with open(weights, "r+b") as f:
        f.write(fine_tune)
    capsys.readouterr()
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 7
    assert weights.read_bytes() == fine_tune and "model.safetensors" in capsys.readouterr().err
    shutil.rmtree(stacked)
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 0
    (stacked / "notes.md").write_text("mine")
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 7
    assert (stacked / "notes.md").read_text() == "mine"
