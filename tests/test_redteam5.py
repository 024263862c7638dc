"""Red-team pass 5 (issue 15, final): ordinary but hostile use of the command line. Each test
used to lose data (an index record written over the model's own weights with --force), publish
a NaN model that `verify` calls OK (weights past float32's range), read a whole model or
/dev/zero into memory (given as params.yaml or a plan) or end in a traceback."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from mergepipe.cli import main
from tests.helpers import write_config


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(capsys, *want: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and "Traceback" not in err, err
    for w in want:
        assert w in err, (w, err)
    return err


@pytest.mark.parametrize("argv", [["index", "M", "-o", "M/model.safetensors", "--force"],
                                  ["index", "M/model.safetensors", "-o", "M/model.safetensors", "--force"],
                                  ["index", "E", "--base", "M", "-o", "M/config.json", "--force"]])
def test_index_o_never_replaces_a_file_of_the_models_it_indexes(argv, tiny_family, tmp_path, capsys):
    """`index M -o M/model.safetensors --force` wrote the JSON record over the model's weights
    (plan -o and import-mergekit -o already refused an input even with --force)."""
    root = Path(tiny_family["root"])
    model = tmp_path / "M"
    shutil.copytree(root / "expert_1", model)
    before = _tree(tmp_path)
    argv = [a.replace("M", str(model), 1) if a.startswith("M") else a for a in argv]
    argv = [str(root / "expert_2") if a == "E" else a for a in argv]
    capsys.readouterr()
    assert main([*argv, "-q", "--cache-dir", str(tmp_path / "cache")]) == 7
    _one_line_error(capsys, "-o is", "even with --force")
    assert {k: v for k, v in _tree(tmp_path).items() if not k.startswith("cache")} == before


_HUGE = {  # (method, expert weights, parameters): each past float32's range, as written or combined
    "weight_1e308": ("task_arithmetic", [1.0, 1e308], {"lambda": 1.0}),
    "lambda_1e39": ("task_arithmetic", [1.0, 0.5], {"lambda": 1e39}),
    "weight_times_lambda": ("task_arithmetic", [1e20, 0.5], {"lambda": 1e20}),
    "ties_per_tensor_weight": ("ties", [[{"filter": "mlp", "value": 1e200}, {"value": 1.0}], 1.0], {"density": 0.5}),
    "linear_normalized_sum": ("linear", [1e308, 1e308], {}),  # a finite float64 sum no more
    "linear_per_tensor_sum": ("linear", [[{"filter": "mlp", "value": 1e308}, {"value": 1.0}], 1e308], {}),
}


@pytest.mark.parametrize("name", sorted(_HUGE))
def test_weights_past_float32_are_refused_not_merged_to_nan(name, tiny_family, tmp_path, capsys):
    """The merge computes in float32: `weight: 1.0e+308` ended in a traceback (the plan's bound
    overflowed), and linear weights past float32's range published a model of NaN that `verify`
    called OK. Now plan refuses them in one line naming the key."""
    method, weights, params = _HUGE[name]
    cfg = write_config(tmp_path, tiny_family, method=method, parameters=params, budget="full")
    data = yaml.safe_load(cfg.read_text())
    data["experts"] = [{**e, "weight": w} for e, w in zip(data["experts"][:2], weights)]
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) == 2
    _one_line_error(capsys, "lambda" if name == "lambda_1e39" else "weight")
    assert not (tmp_path / "out").exists()


def test_a_plan_edited_past_float32_is_refused(tiny_family, tmp_path, capsys):
    """A plan from disk is untrusted: a weight edited to 1e39 with plan_hash recomputed merged
    to inf/NaN and verified OK."""
    from mergepipe.plan.planner import plan_hash
    cfg = write_config(tmp_path, tiny_family)
    plan_file = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan_file)]) == 0
    plan = json.loads(plan_file.read_text())
    plan["experts"][0]["weight"] = 1e39
    plan["plan_hash"] = plan_hash(plan)
    plan_file.write_text(json.dumps(plan))
    capsys.readouterr()
    assert main(["merge", str(plan_file), "-o", str(tmp_path / "m"), "--cache-dir", str(tmp_path / "cache"), "-q"]) == 2
    _one_line_error(capsys, str(plan_file), "weight", "float32")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("text", ["", "[1, 2]\n", "just a string\n"])
def test_import_mergekit_of_an_empty_or_non_mapping_file(text, tmp_path, capsys):
    """An empty mergekit YAML (or a list) ended in AttributeError's traceback."""
    mk = tmp_path / "mergekit.yml"
    mk.write_text(text)
    capsys.readouterr()
    assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "params.yaml"), "-q"]) == 2
    _one_line_error(capsys, str(mk), "mapping")
    assert not (tmp_path / "params.yaml").exists()


@pytest.mark.parametrize("argv, want", [
    (["run", "BIG"], "not a config file"),
    (["import-mergekit", "BIG", "-o", "OUT/params.yaml"], "not a config file"),
    (["merge", "BIG", "-o", "OUT/m"], "not a JSON object"),
    (["gc", "--cache-dir", "OUT/cache", "--keep", "BIG"], "not a JSON object"),
    (["explain", "BIG"], "not a JSON object"),
])
def test_a_model_file_or_dev_zero_given_as_config_or_plan_is_not_read_whole(argv, want, tmp_path, capsys):
    """`mergepipe run /dev/zero` was killed by the OOM killer after 20 GB, and a model file
    given as params.yaml or plan.json was read whole into memory before the error. A config is
    read up to 16 MiB, a plan only past its first bytes if it starts like a JSON object."""
    big = tmp_path / "model.safetensors"
    with open(big, "wb") as f:  # sparse: 17 MiB of zero bytes, like /dev/zero or a header's length
        f.truncate(17 << 20)
    argv = [a.replace("BIG", str(big)).replace("OUT", str(tmp_path)) for a in argv]
    before = _tree(tmp_path)
    capsys.readouterr()
    assert main([*argv, "-q"]) == 2
    _one_line_error(capsys, str(big), want)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("where", ["out_is_a_file", "parent_is_a_file", "base_is_a_file", "out_dangling_link"])
def test_demo_where_a_folder_must_go_is_a_one_line_error(where, tmp_path, capsys):
    """`mergepipe demo FILE` (or one under a file, or with base/ a file) ended in mkdir's traceback."""
    user = tmp_path / "notes.txt"
    user.write_text("mine")
    target = {"out_is_a_file": user, "parent_is_a_file": user / "demo", "base_is_a_file": tmp_path / "d",
              "out_dangling_link": tmp_path / "link"}[where]
    if where == "base_is_a_file":
        target.mkdir()
        (target / "base").write_text("mine")
    if where == "out_dangling_link":
        os.symlink(tmp_path / "nowhere", target)
    before = _tree(tmp_path)
    capsys.readouterr()
    assert main(["demo", str(target), "--experts", "1", "--quiet"]) == 7
    _one_line_error(capsys, str(target))
    assert _tree(tmp_path) == before


def test_the_workflow_never_lets_snakemake_delete_a_users_weights_at_output_dir(tiny_family, tmp_path):
    """`snakemake` with output.dir a folder of the user's (a model.safetensors and some
    manifest.json): Snakemake deletes a job's existing outputs before running it, so the user's
    weights were gone before `mergepipe merge` refused the folder. rules/common.smk now refuses
    such a folder at parse time (what mergepipe would not replace without --force)."""
    from tests.helpers.workflow import make_workspace, smk
    ws = make_workspace(tmp_path / "ws")
    root = Path(tiny_family["root"])
    cfg = yaml.safe_load((ws / "params.yaml").read_text())
    cfg.update(base=str(root / "base"), experts=[{"name": "e0", "path": str(root / "expert_1"), "weight": 1.0}],
               method="task_arithmetic", parameters={"lambda": 1.0}, budget="full",
               output={**cfg.get("output", {}), "dir": "mine"})
    cfg.pop("plan", None)
    (ws / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    mine = ws / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"the user's weights")
    (mine / "manifest.json").write_text('{"mine": 1}')
    proc = smk(ws, "-c1", "mine/model.safetensors", check=False)
    assert proc.returncode != 0 and "output.dir 'mine'" in proc.stdout + proc.stderr
    assert (mine / "model.safetensors").read_bytes() == b"the user's weights"
    assert (mine / "manifest.json").read_text() == '{"mine": 1}'
