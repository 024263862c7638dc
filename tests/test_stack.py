"""Layer stacking (mergekit passthrough `slices`): commands/stack.py builds the stacked model
folder; import-mergekit builds it and writes a passthrough of it; run publishes it."""
from __future__ import annotations

import json

import pytest
import yaml

from mergepipe.cli import main
from mergepipe.commands.stack import STACK_FILE, build_stack
from mergepipe.errors import ConfigError, OutputError
from tests.helpers import load_model
from pathlib import Path


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
