"""Ordinary mistakes that must not lose data (issue 15, second red-team pass): a cache folder
that is really a project folder, an -o that names the config or a file of the user's."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mergepipe.cli import main
from tests.helpers import write_config


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_gc_on_a_project_folder_removes_only_mergepipe_entries(tiny_family, tmp_path):
    """`gc --cache-dir .` (or cache_dir: .) in a project whose models/, parts/ and merges/ are the user's."""
    project = tmp_path / "project"
    for rel, data in {"models/llama/model.safetensors": b"weights", "models/notes.md": b"n",
                      "parts/chapter.tex": b"t", "merges/best/model.safetensors": b"m",
                      "stat/data.csv": b"1,2", "deltas/x.json.gz": b"z"}.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(data)
    before = _tree(project)
    cfg = write_config(tmp_path, tiny_family, cache_dir=str(project), budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    ours = set(_tree(project)) - set(before)
    assert any(p.startswith("merges/") for p in ours) and any(p.startswith("models/") for p in ours)
    assert main(["gc", "--cache-dir", str(project), "--indexes", "-q"]) == 0
    after = _tree(project)
    assert {k: v for k, v in after.items() if k in before} == before  # every file of the user's kept
    assert not set(after) - set(before)  # every cache entry of ours removed


def test_plan_never_overwrites_its_config_or_a_users_file(tiny_family, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_family)
    text = cfg.read_text()
    assert main(["plan", str(cfg), "-q", "-o", str(cfg)]) == 7
    assert cfg.read_text() == text
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    capsys.readouterr()
    assert main(["plan", str(cfg), "-q", "-o", str(notes)]) == 7
    err = capsys.readouterr().err
    assert str(notes) in err and "--force" in err and err.count("\n") == 1
    assert notes.read_text() == '{"mine": 1}'
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan)]) == 0
    assert main(["plan", str(cfg), "-q", "-o", str(plan), "--budget", "50%"]) == 0  # a plan replaces a plan
    assert main(["plan", str(cfg), "-q", "-o", str(notes), "--force"]) == 0
    assert "plan_hash" in notes.read_text()


def test_import_mergekit_does_not_overwrite_an_existing_file(tmp_path):
    mk = tmp_path / "mergekit.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "base",
                                  "models": [{"model": "a", "parameters": {"weight": 1.0}}]}))
    params = tmp_path / "params.yaml"
    params.write_text("base: mine\n")
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 7
    assert params.read_text() == "base: mine\n"
    assert main(["import-mergekit", str(mk), "-o", str(mk), "-q", "--force"]) == 7  # never the input itself
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 0
    assert "task_arithmetic" in params.read_text()


@pytest.mark.parametrize("argv", [["sweep", "CFG", "-o", ""], ["index", "MODEL", "-o", "MODEL/model.safetensors"]])
def test_other_outputs_refuse_empty_paths_and_inputs(argv, tiny_family, tmp_path):
    cfg = write_config(tmp_path, tiny_family)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes((Path(tiny_family["root"]) / "base" / "model.safetensors").read_bytes())
    before = _tree(tmp_path)
    argv = [a.replace("CFG", str(cfg)).replace("MODEL", str(model)) for a in argv]
    assert main([*argv, "-q"]) == 7
    assert _tree(tmp_path) == before


def test_demo_never_overwrites_a_users_model_folder(tmp_path):
    """`mergepipe demo models` where models/base is the user's own model: refused, weights kept;
    a folder demo wrote before is rewritten as always."""
    from mergepipe.commands.demo import main as demo_main
    real = tmp_path / "models" / "base"
    real.mkdir(parents=True)
    (real / "model.safetensors").write_bytes(b"the user's weights")
    assert demo_main([str(tmp_path / "models"), "--quiet", "--experts", "1"]) == 7
    assert (real / "model.safetensors").read_bytes() == b"the user's weights"
    assert demo_main([str(tmp_path / "demo"), "--quiet", "--experts", "1"]) == 0
    assert demo_main([str(tmp_path / "demo"), "--quiet", "--experts", "1"]) == 0  # a rerun rewrites its own


def test_a_publish_killed_between_its_renames_keeps_the_previous_output(tmp_path, monkeypatch):
    """Without renameat2's exchange (NFS, Lustre), commit renames the previous version away and
    then the new one in. A kill between the two used to leave only `.out.old-*`, which the next
    run removed as a leftover: the previous output was lost even if that run then failed."""
    from mergepipe.output import publish
    from mergepipe.output.publish import Publisher
    target = tmp_path / "out"
    pub = Publisher(target)
    with pub as tmp:
        (tmp / "model.safetensors").write_bytes(b"version 1")
        pub.commit()
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    real_rename = publish.os.rename

    def killed_after_first(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
            raise KeyboardInterrupt("killed between the renames")

    monkeypatch.setattr(publish.os, "rename", killed_after_first)
    pub = Publisher(target, force=True)  # (these folders hold no manifest: ownership is not what is tested)
    with pytest.raises(KeyboardInterrupt):
        with pub as tmp:
            (tmp / "model.safetensors").write_bytes(b"version 2")
            pub.commit()
    monkeypatch.setattr(publish.os, "rename", real_rename)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()][0].startswith(".out.old-")
    with pytest.raises(RuntimeError):  # the next run fails before publishing: version 1 is back anyway
        with Publisher(target, force=True):
            raise RuntimeError("the next merge fails")
    assert (target / "model.safetensors").read_bytes() == b"version 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
