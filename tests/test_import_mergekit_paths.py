"""import-mergekit reads model paths as mergekit does (against the working directory only) and
writes a params file whose paths name the same folders wherever -o puts it; each imported
recipe publishes into a folder of its own; the recipe's YAML travels with the params."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from mergepipe.cli import main
from mergepipe.config.mergekit import import_mergekit
from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError

RECIPE = """\
merge_method: task_arithmetic
base_model: models/demo/base
models:
  - model: models/demo/expert_0
    parameters: {weight: 1.0}
  - model: models/demo/expert_1
    parameters: {weight: 0.5}
dtype: bfloat16
"""


@pytest.fixture()
def project(tiny_family, tmp_path, monkeypatch) -> Path:
    """A project folder holding models/demo/{base, expert_0, expert_1}, the working directory."""
    root = Path(tiny_family["root"])
    for name in ("base", "expert_0", "expert_1"):
        shutil.copytree(root / name, tmp_path / "proj" / "models" / "demo" / name)
    monkeypatch.chdir(tmp_path / "proj")
    return tmp_path / "proj"


def _recipe(folder: Path, text: str = RECIPE, name: str = "x.yml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def _models_of(params_file: Path) -> list[Path]:
    cfg = load_config(params_file)
    return [Path(os.path.realpath(p)) for p in (cfg.base, *(e.path for e in cfg.experts))]


def test_a_params_file_beside_a_nested_recipe_runs_the_recipes_models(project, capsys):
    """`import-mergekit mk/sub/x.yml -o mk/sub/x.params.yaml` wrote the YAML's paths as they
    were (relative to the working directory, as mergekit reads them) into a file that reads
    them against its own folder: `run` failed with mk/sub/models/demo/base missing."""
    _recipe(project / "mk" / "sub")
    params = Path("mk/sub/x.params.yaml")
    assert main(["import-mergekit", "mk/sub/x.yml", "-o", str(params), "-q"]) == 0
    want = [(project / "models" / "demo" / m).resolve() for m in ("base", "expert_0", "expert_1")]
    assert _models_of(params) == want
    data = yaml.safe_load(params.read_text())
    assert data["base"] == "../../models/demo/base"  # relative: the project can move as a whole
    data["cache_dir"] = str(project / "cache")
    params.write_text(yaml.safe_dump(data))
    assert main(["run", str(params), "-q"]) == 0, capsys.readouterr().err
    assert (project / "mk" / "sub" / "merged-x.params" / "model.safetensors").is_file()


@pytest.mark.parametrize("out", ["p.yaml", "elsewhere/deeper/p.yaml", "mk/p.yaml"])
def test_the_written_paths_name_the_same_folders_wherever_o_puts_them(project, out):
    _recipe(project / "mk")
    (project / "elsewhere" / "deeper").mkdir(parents=True)
    absolute = project / "models" / "demo" / "expert_1"
    _recipe(project / "mk", RECIPE.replace("models/demo/expert_1", str(absolute)))
    assert main(["import-mergekit", "mk/x.yml", "-o", out, "-q"]) == 0
    want = [(project / "models" / "demo" / m).resolve() for m in ("base", "expert_0", "expert_1")]
    assert _models_of(Path(out)) == want
    assert yaml.safe_load(Path(out).read_text())["experts"][1]["path"] == str(absolute)  # absolute stays absolute


def test_the_params_file_still_works_after_the_project_moves(project, tmp_path, monkeypatch):
    _recipe(project / "mk" / "sub")
    assert main(["import-mergekit", "mk/sub/x.yml", "-o", "mk/sub/x.params.yaml", "-q"]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(project, moved)
    monkeypatch.chdir(tmp_path)
    assert _models_of(moved / "mk" / "sub" / "x.params.yaml") == [
        (moved / "models" / "demo" / m).resolve() for m in ("base", "expert_0", "expert_1")]
    assert str(project) not in (moved / "mk" / "sub" / "x.params.yaml").read_text()


def test_models_beside_the_recipe_are_not_looked_up(project, tiny_family):
    """mergekit reads model paths from its working directory only; the import looked beside
    the YAML first, so a models/ folder there holding other models of the same names was
    merged instead, exit 0."""
    recipe = _recipe(project / "mk")
    decoy = project / "mk" / "models" / "demo"
    for name in ("base", "expert_0", "expert_1"):  # other models under the recipe's names
        shutil.copytree(Path(tiny_family["root"]) / "expert_2", decoy / name)
    params = import_mergekit(recipe, params_path=project / "p.yaml")
    assert params["base"] == "models/demo/base"
    assert main(["import-mergekit", str(recipe), "-o", "mk/p.yaml", "-q"]) == 0
    assert _models_of(Path("mk/p.yaml")) == [
        (project / "models" / "demo" / m).resolve() for m in ("base", "expert_0", "expert_1")]


def test_a_model_only_beside_the_recipe_is_not_found(project):
    """A path that exists only beside the YAML is not mergekit's model: an `org/name` one is a
    Hugging Face id (refused when not in the cache), any other is written for the working
    directory's folder, where the plan names it missing."""
    for ref in ("local/expert", "local/sub/expert"):
        shutil.copytree(project / "models" / "demo" / "expert_1", project / "mk" / ref)
    recipe = _recipe(project / "mk", RECIPE.replace("models/demo/expert_1", "local/expert"))
    with pytest.raises(ConfigError, match="Hugging Face model 'local/expert' is neither a local folder"):
        import_mergekit(recipe, params_path=project / "p.yaml")
    recipe = _recipe(project / "mk", RECIPE.replace("models/demo/expert_1", "local/sub/expert"))
    params = import_mergekit(recipe, params_path=project / "mk" / "p.yaml")
    assert params["experts"][1]["path"] == "../local/sub/expert"  # the working directory's, not mk/'s


def test_two_imported_recipes_never_share_an_output_folder(project):
    """Every import wrote `output: {dir: merged}`: a second recipe's run replaced the first's
    merge (and the demo's, which params.yaml publishes to merged/)."""
    _recipe(project / "mk", name="a.yml")
    _recipe(project / "mk", RECIPE.replace("weight: 0.5", "weight: 0.25"), name="b.yml")
    assert main(["import-mergekit", "mk/a.yml", "-o", "a.yaml", "-q"]) == 0
    assert main(["import-mergekit", "mk/b.yml", "-o", "b.yaml", "-q"]) == 0
    dirs = {load_config(p).output.dir for p in ("a.yaml", "b.yaml")}
    assert dirs == {project / "merged-a", project / "merged-b"}


def test_a_yaml_yml_twin_naming_the_same_output_folder_is_refused(project, capsys):
    _recipe(project / "mk")
    assert main(["import-mergekit", "mk/x.yml", "-o", "p.yaml", "-q"]) == 0
    assert main(["import-mergekit", "mk/x.yml", "-o", "p.yml", "-q"]) == 2
    err = capsys.readouterr().err
    assert "p.yml: output.dir 'merged-p' is also p.yaml's (beside it)" in err and len(err.splitlines()) == 1
    assert not Path("p.yml").exists()
    (project / "p.yml").write_text(RECIPE)  # a mergekit recipe beside it publishes nothing: no clash
    (project / "p.yaml").unlink()
    assert main(["import-mergekit", "mk/x.yml", "-o", "p.yaml", "-q"]) == 0


def test_the_recipe_yaml_is_kept_for_the_output(project):
    """mergekit writes mergekit_config.yml into the output and quotes the YAML in the card; the
    import kept nothing of it."""
    text = "# my recipe\n" + RECIPE
    _recipe(project / "mk", text)
    assert main(["import-mergekit", "mk/x.yml", "-o", "p.yaml", "-q"]) == 0
    assert load_config("p.yaml").output.mergekit_config == text
    assert "mergekit_config: |" in Path("p.yaml").read_text()  # readable in the params file
    assert load_config("p.yaml").normalized()["output"]["mergekit_config"] == text
    _recipe(project / "mk", text + "#" * (64 << 10))
    with pytest.raises(ConfigError, match="over 64 KiB"):
        import_mergekit("mk/x.yml", params_path="q.yaml")


def test_a_missing_expert_path_names_the_expert_and_the_folder(project, capsys):
    """`expert_3` for `expert_2`: the error named the folder but not which expert it was."""
    _recipe(project / "mk", RECIPE.replace("models/demo/expert_1", "models/demo/expert_3"))
    assert main(["import-mergekit", "mk/x.yml", "-o", "p.yaml", "-q"]) == 0
    assert main(["plan", "p.yaml", "-q", "-o", "plan.json"]) == 3
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "experts[1].path (expert 'expert_3'): 'models/demo/expert_3' is no model folder" in err, err
    assert str(project / "models" / "demo" / "expert_3") in err
    assert not Path("plan.json").exists()


def test_the_hub_cache_hint_names_the_hf_cli(project, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(project / "hub"))
    _recipe(project / "mk", RECIPE.replace("models/demo/expert_1", "org/not-downloaded"))
    assert main(["import-mergekit", "mk/x.yml", "-o", "p.yaml", "-q"]) == 2
    err = capsys.readouterr().err
    assert "(hf download org/not-downloaded)" in err and "huggingface-cli" not in err


def test_a_missing_adapter_names_its_key(project, capsys):
    Path("p.yaml").write_text("base: models/demo/base\n"
                              "experts:\n  - {name: mine, adapter: adapters/typo, weight: 1.0}\n"
                              "method: task_arithmetic\ncache_dir: cache\n")
    assert main(["plan", "p.yaml", "-q"]) == 3
    err = capsys.readouterr().err
    assert "experts[0].adapter (expert 'mine'): 'adapters/typo' is no model folder" in err, err
