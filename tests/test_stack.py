"""Layer stacking (mergekit passthrough `slices`): commands/stack.py builds the stacked model
folder; import-mergekit builds it and writes a passthrough of it; run publishes it."""
from __future__ import annotations

import json

import pytest
import yaml

from mergepipe.cli import main
from mergepipe.commands.stack import STACK_FILE, build_stack
from mergepipe.errors import ConfigError, OutputError
from tests.helpers import stacked_project, load_model
from pathlib import Path
import os
import shutil


def _slices(root):
    return [{"model": "base", "layer_range": [0, 2]}, {"model": "expert_0", "layer_range": [1, 4]}], \
        {"base": root / "base", "expert_0": root / "expert_0"}


def test_stacked_folder_layers_config_and_sources(tmp_path, tiny_family):
    root = tiny_family["root"]
    slices, folders = _slices(root)
    out = build_stack(slices, folders, tmp_path / "stacked")
    stacked, base, expert = load_model(out), load_model(root / "base"), load_model(root / "expert_0")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 5
    record = json.loads((out / STACK_FILE).read_text())
    assert record["layers"] == 5 and sorted(record["sources"]) == sorted(stacked)
    for name, tensor in stacked.items():
        model, src = record["sources"][name]
        assert (base if model == "base" else expert)[src].equal(tensor), name
    # layers 0-1 from the base's 0-1, 2-4 from the expert's 1-3; embeddings first model, head last
    assert record["sources"]["model.layers.1.mlp.up_proj.weight"] == ["base", "model.layers.1.mlp.up_proj.weight"]
    assert record["sources"]["model.layers.2.mlp.up_proj.weight"] == ["expert_0", "model.layers.1.mlp.up_proj.weight"]
    assert record["sources"]["model.layers.4.mlp.up_proj.weight"] == ["expert_0", "model.layers.3.mlp.up_proj.weight"]
    assert record["sources"]["model.embed_tokens.weight"][0] == "base"
    assert record["sources"]["lm_head.weight"][0] == "expert_0"
    assert record["sources"]["model.norm.weight"][0] == "expert_0"
    assert not any(name.startswith("model.layers.5.") for name in stacked)
    before = (out / "model.safetensors").read_bytes()
    assert build_stack(slices, folders, tmp_path / "stacked") == out  # rebuilt: the same bytes
    assert (out / "model.safetensors").read_bytes() == before
    build_stack(slices[:1], folders, tmp_path / "stacked")  # a previous stack is replaced
    assert json.loads((out / STACK_FILE).read_text())["layers"] == 2
    (tmp_path / "other-model").mkdir()
    with pytest.raises(OutputError, match="exists and is not a stacked model"):
        build_stack(slices, folders, tmp_path / "other-model")
    with pytest.raises(ConfigError, match=r"slices\[1\]\.layer_range: \[1, 9\] is not inside 'expert_0''s 4 layers"):
        build_stack([slices[0], {"model": "expert_0", "layer_range": [1, 9]}], folders, tmp_path / "other")
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.tmp-*"))


def test_import_builds_the_stack_and_run_publishes_it(tmp_path, tiny_family):
    root = tiny_family["root"]
    mk = tmp_path / "frankenmerge.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(root / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(root / "expert_1"), "layer_range": [2, 4]}]}]}))
    params = tmp_path / "params.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    data = yaml.safe_load(params.read_text())
    assert data["base"] == "params.stacked" and data["experts"][0]["path"] == "params.stacked"
    data["cache_dir"] = str(tmp_path / "cache")
    params.write_text(yaml.safe_dump(data))
    assert main(["run", str(params), "-q"]) == 0
    merged, stacked = load_model(tmp_path / "merged-params"), load_model(tmp_path / "params.stacked")
    assert sorted(merged) == sorted(stacked)
    assert all(merged[n].dtype.is_floating_point and merged[n].equal(stacked[n].float()) for n in merged)
    assert json.loads((tmp_path / "merged-params" / "config.json").read_text())["num_hidden_layers"] == 5
    manifest = json.loads((tmp_path / "merged-params" / "manifest.json").read_text())
    assert STACK_FILE in manifest["outputs"]["files"]
    stacked = (tmp_path / "params.stacked" / STACK_FILE).read_bytes()
    assert (tmp_path / "merged-params" / STACK_FILE).read_bytes() == stacked


def test_stacking_refusals(tmp_path):
    mk = tmp_path / "mk.yml"
    mk.write_text("merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [0, 2]}, "
                  "{model: b, layer_range: [0, 2]}]\n  - sources: [{model: a, layer_range: [2, 4]}]\n")
    assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml"), "-q"]) == 2
    mk.write_text("merge_method: passthrough\nslices:\n  - sources: [{model: a+lora, layer_range: [0, 2]}]\n"
                  "  - sources: [{model: a, layer_range: [2, 4]}]\n")
    assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml"), "-q"]) == 2
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "p.stacked").exists()


def test_two_imports_of_one_stacking_config_at_once(tiny_family, tmp_path):
    """Two `import-mergekit` of a stacking config at once (a shared folder, two terminals): both
    removed and renamed the stacked folder unlocked (a FileNotFoundError/ENOTEMPTY traceback,
    or no folder left). Now one builds, the other waits its turn or is refused by the lock."""
    import subprocess
    import sys
    import yaml
    root = Path(tiny_family["root"])
    mk = tmp_path / "mk.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(root / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(root / "expert_1"), "layer_range": [2, 4]}]}]}))
    argv = [sys.executable, "-m", "mergepipe", "import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml"),
            "--force", "-q"]
    assert main(argv[3:]) == 0

    def files() -> dict:  # stack-sources.json's stats are the written files' own stat keys: new each build
        got = {p.name: p.read_bytes() for p in (tmp_path / "p.stacked").iterdir()}
        record = json.loads(got.pop("stack-sources.json"))
        assert sorted(record.pop("stats")) == sorted(record["files"])
        return {**got, "stack-sources.json": record}
    want = files()
    for _ in range(3):
        procs = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for p in procs:
            err = p.communicate(timeout=120)[1]
            assert p.returncode in (0, 7), err
            assert "Traceback" not in err and (p.returncode == 0 or "locked by another" in err), err
        assert files() == want
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mk.yml", "p.stacked", "p.yaml"]


def _flip_in_place(path: Path) -> None:
    """One byte flipped near the end (tensor data), size and mtime restored."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 10)
        b = f.read(1)
        f.seek(st.st_size - 10)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _replace_with_other(path: Path) -> None:
    other = path.with_name("x.tmp")
    other.write_bytes(path.read_bytes())  # same bytes, another inode and ctime
    os.replace(other, path)


_SOURCE_EDITS = {
    "weights_flipped_mtime_restored": lambda m: _flip_in_place(m / "model.safetensors"),
    "config_replaced_by_a_copy": lambda m: _replace_with_other(m / "config.json"),
    "weights_gone": lambda m: (m / "model.safetensors").unlink(),
}


@pytest.mark.parametrize("command", ["run", "plan", "merge"])
@pytest.mark.parametrize("edit", sorted(_SOURCE_EDITS))
def test_a_stacked_folder_whose_source_changed_is_refused(edit, command, tiny_family, tmp_path, capsys):
    """`import-mergekit` of a slices config builds P.stacked once; a source model changed
    afterwards (retrained, re-downloaded, edited in place with its mtime restored) left the
    stacked folder stale, and `run` said "up to date", `plan`/`merge` merged the old layers:
    a model that is not the config's. Now each refuses (exit 6) naming the changed file and
    the import to rerun, and after the rerun the merge has the new bytes."""
    mk, params = stacked_project(tiny_family, tmp_path)
    assert main(["run", str(params), "-q"]) == 0
    assert main(["plan", str(params), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    out = tmp_path / "merged-p"  # named after p.yaml
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _SOURCE_EDITS[edit](tmp_path / "expert_1")
    capsys.readouterr()
    argv = {"run": ["run", str(params)], "plan": ["plan", str(params), "-o", str(tmp_path / "plan2.json")],
            "merge": ["merge", str(tmp_path / "plan.json"), "-o", str(out), "--root", str(tmp_path)]}[command]
    assert main([*argv, "-q"]) == 6
    err = capsys.readouterr().err
    assert "stale stacked model" in err and "expert_1" in err and "import-mergekit" in err, err
    assert len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not (tmp_path / "plan2.json").exists()
    if edit != "weights_gone":
        assert main(["import-mergekit", str(mk), "-o", str(params), "--force", "-q"]) == 0
        assert main(["run", str(params), "-q"]) == 0
        assert (out / "model.safetensors").read_bytes() != before["model.safetensors"] or edit.startswith("config")


@pytest.mark.parametrize("damage", ["truncated", "not_a_mapping", "sources_not_a_mapping"])
def test_a_damaged_record_of_a_stacks_sources_is_a_one_line_error(damage, tiny_family, tmp_path, capsys):
    """stack-sources.json half-written or edited: refused in one line (exit 6), never a traceback
    and never taken as "fresh"."""
    _, params = stacked_project(tiny_family, tmp_path)
    record = tmp_path / "p.stacked" / "stack-sources.json"
    record.write_text({"truncated": '{"sources": ', "not_a_mapping": "[1, 2]",
                       "sources_not_a_mapping": '{"sources": [1], "rerun": "x"}'}[damage])
    capsys.readouterr()
    assert main(["run", str(params), "-q"]) == 6
    err = capsys.readouterr().err
    assert "stack-sources.json" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


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
