"""The folders import-mergekit builds beside params.yaml (`P.stacked/`, the views in `P.slices/`)
under a user who edits, replaces or already owns what is there: nothing of the user's is
replaced, and a merge never reads a view that is no longer the one the import wrote."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from mergepipe.cli import main


def _sliced_project(family: dict, tmp_path: Path) -> tuple[Path, Path]:
    """A mergekit task_arithmetic config whose two slices merge base and expert_1, imported as p.yaml
    (views in p.slices/base and p.slices/expert_1)."""
    root = Path(family["root"])
    for m in ("base", "expert_1"):
        shutil.copytree(root / m, tmp_path / m)
    mk = tmp_path / "mk.yml"
    src = [str(tmp_path / m) for m in ("base", "expert_1")]
    mk.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": src[0],
                                  "parameters": {"weight": 0.5}, "slices": [
                                      {"sources": [{"model": s, "layer_range": [0, 2]} for s in src]},
                                      {"sources": [{"model": s, "layer_range": [2, 4]} for s in src]}]}))
    params = tmp_path / "p.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    data = yaml.safe_load(params.read_text())
    data["cache_dir"] = str(tmp_path / "cache")
    params.write_text(yaml.safe_dump(data))
    return mk, params


def _views(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "p.slices").iterdir() if p.is_dir())


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_users_folder_under_a_views_name_is_never_replaced_even_with_force(tiny_family, tmp_path, capsys):
    """`P.slices/base` the user made (their notes, a model of theirs): the import said "remove it or
    pass --force", and --force (which rewriting params.yaml needs anyway) deleted it."""
    mk = tmp_path / "mk.yml"
    _sliced_project(tiny_family, tmp_path)
    shutil.rmtree(tmp_path / "p.slices" / "base")
    mine = tmp_path / "p.slices" / "base"
    mine.mkdir()
    (mine / "notes.md").write_text("mine\n")
    capsys.readouterr()
    for force in ([], ["--force"]):
        assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml"), "-q", "--force", *force]) == 7
        err = _one_line(capsys)
        assert str(mine) in err and "not a stacked model" in err
        assert sorted(p.name for p in mine.iterdir()) == ["notes.md"] and (mine / "notes.md").read_text() == "mine\n"


@pytest.mark.parametrize("name", ["config.json", "stack.json"])
def test_a_reimport_never_replaces_a_view_file_the_user_edited(name, tiny_family, tmp_path, capsys):
    """A view's config.json edited by hand (rope settings, a dtype) was replaced by the next
    `import-mergekit --force` without a word: only its weights' blake3 was recorded."""
    mk, params = _sliced_project(tiny_family, tmp_path)
    edited = _views(tmp_path)[1] / name
    text = edited.read_text().replace("\n}", ',\n "edited_by_user": 1\n}', 1) if name == "config.json" \
        else edited.read_text() + " "
    edited.write_text(text)
    capsys.readouterr()
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 7
    err = _one_line(capsys)
    assert str(edited) in err and "changed since the import wrote it" in err
    assert edited.read_text() == text


def test_an_untouched_view_is_replaced_by_a_reimport(tiny_family, tmp_path):
    mk, params = _sliced_project(tiny_family, tmp_path)
    before = {p.name: (p / "model.safetensors").read_bytes() for p in _views(tmp_path)}
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 0
    assert {p.name: (p / "model.safetensors").read_bytes() for p in _views(tmp_path)} == before


@pytest.mark.parametrize("edit", ["weights_replaced_same_size", "config_edited"])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_view_changed_after_the_import_is_refused_naming_it(edit, command, tiny_family, tmp_path, capsys):
    """A view whose weights were replaced by another view's (same size, timestamps kept) was merged
    as if it were the mergekit recipe's input: exit 0, `verify --inputs` OK, the recipe in the
    output's mergekit_config.yml and card. A view is checked against what the import wrote (stat
    keys, then blake3) like its source models."""
    _, params = _sliced_project(tiny_family, tmp_path)
    base_view, expert_view = _views(tmp_path)
    target = expert_view / ("config.json" if edit == "config_edited" else "model.safetensors")
    if edit == "weights_replaced_same_size":
        shutil.copy2(base_view / "model.safetensors", target)
    else:
        config = json.loads(target.read_text())
        target.write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    capsys.readouterr()
    argv = ["run", str(params), "-q"] if command == "run" else ["plan", str(params), "-o", str(tmp_path / "plan.json")]
    assert main(argv) == 6
    err = _one_line(capsys)
    assert str(target) in err and "import-mergekit" in err, err
    assert not (tmp_path / "merged-p").exists() and not (tmp_path / "plan.json").exists()


def test_a_view_moved_with_its_project_is_still_fresh(tiny_family, tmp_path):
    """Stat keys change when files are copied (new inodes); the view's recorded blake3 decides."""
    _, params = _sliced_project(tiny_family, tmp_path)
    for view in _views(tmp_path):  # what `cp -r` does to the view's files: new inodes, times
        for f in view.iterdir():
            data = f.read_bytes()
            f.unlink()
            f.write_bytes(data)
    assert main(["run", str(params), "-q"]) == 0


def test_a_layer_range_outside_a_later_view_writes_no_view(tiny_family, tmp_path, capsys):
    """The base view was built, then the expert's out-of-range slice refused: a views folder
    was left beside a params.yaml that was never written."""
    root = Path(tiny_family["root"])
    mk = tmp_path / "mk.yml"
    src = [str(root / m) for m in ("base", "expert_1")]
    mk.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": src[0],
                                  "parameters": {"weight": 0.5}, "slices": [
        {"sources": [{"model": src[0], "layer_range": [0, 2]}, {"model": src[1], "layer_range": [0, 2]}]},
        {"sources": [{"model": src[0], "layer_range": [2, 4]}, {"model": src[1], "layer_range": [3, 5]}]}]}))
    capsys.readouterr()
    assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml"), "-q"]) == 2
    assert "layer_range" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mk.yml"]
