"""import-mergekit drops what mergekit 0.1.5 accepts but never reads (config/mergekit_ignored.py):
a parameter the method does not read and a filter condition in no tensor name it is matched
against, each with one warning line naming the key and the model; the rest converts as before.
A hand-written params.yaml keeps the typo guard. The methods' facts (what mergekit reads) are
checked against mergekit's own method specs where the reference venv is installed.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.cli import main
from mergepipe.config.mergekit_ignored import without_ignored
from mergepipe.methods import get_method
from mergepipe.methods.registry import mergekit_names
from tests.helpers.equivalence import MERGEKIT_PYTHON

LAYERS, H = 2, 4


def _family(root: Path) -> Path:
    shapes = {"model.embed_tokens.weight": (8, H), "model.norm.weight": (H,), "lm_head.weight": (8, H)}
    for i in range(LAYERS):
        shapes.update({f"model.layers.{i}.self_attn.q_proj.weight": (H, H),
                       f"model.layers.{i}.mlp.up_proj.weight": (H, H)})
    g = torch.Generator().manual_seed(26)
    for name in ("base", "a", "b"):
        (root / name).mkdir(parents=True)
        save_file({n: torch.randn(s, generator=g) for n, s in shapes.items()}, root / name / "model.safetensors")
        (root / name / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": LAYERS,
            "vocab_size": 8, "num_attention_heads": 1, "intermediate_size": H, "tie_word_embeddings": False}))
    return root


def _import(root: Path, recipe: dict, capsys, monkeypatch) -> tuple[int, dict | None, list[str]]:
    """(exit code, the written params or None, stderr's lines) of import-mergekit run in `root`."""
    monkeypatch.chdir(root)
    (root / "recipe.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    capsys.readouterr()
    code = main(["import-mergekit", "recipe.yml", "-o", "params.yaml", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    written = root / "params.yaml"
    return code, yaml.safe_load(written.read_text()) if written.exists() else None, err


def test_a_model_filter_in_no_tensor_name_is_dropped_with_one_warning(tmp_path, capsys, monkeypatch):
    root = _family(tmp_path)
    recipe = {"merge_method": "task_arithmetic", "base_model": "base",
              "models": [{"model": "a", "parameters": {"weight": [{"filter": "mlp.gate", "value": 0.3},
                                                                  {"filter": "q_proj", "value": 0.7},
                                                                  {"value": 1.0}]}},
                         {"model": "b", "parameters": {"weight": 0.5}}]}
    code, params, err = _import(root, recipe, capsys, monkeypatch)
    assert code == 0
    assert err == ["warning: recipe.yml: models[0].parameters.weight: filter 'mlp.gate' matches no tensor of a; "
                   "mergekit ignores it, dropped"]
    assert params["experts"][0]["weight"] == [{"filter": "q_proj", "value": 0.7}, {"value": 1.0}]
    assert params["experts"][1]["weight"] == 0.5
    # written by hand, the same filter is a typo: refused when the params are read
    params["experts"][0]["weight"].insert(0, {"filter": "mlp.gate", "value": 0.3})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert main(["check", "params.yaml", "--no-probe"]) == 2
    assert "filter 'mlp.gate' is in no tensor name of the base" in capsys.readouterr().err


def test_check_of_a_mergekit_recipe_reports_what_import_drops(tmp_path, capsys, monkeypatch):
    root = _family(tmp_path)
    monkeypatch.chdir(root)
    (root / "recipe.yml").write_text(yaml.safe_dump({
        "merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": [{"filter": "absent", "value": 3},
                                                                                      {"value": 1.0}]}},
                                             {"model": "b", "parameters": {"weight": 1.0}}]}))
    capsys.readouterr()
    assert main(["check", "recipe.yml", "--no-probe"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("WARN  recipe.yml: models[0].parameters.weight: filter 'absent' matches no tensor of a; "
                      "mergekit ignores it, dropped")


def test_a_parameter_the_method_does_not_read_is_dropped_with_one_warning(tmp_path, capsys, monkeypatch):
    root = _family(tmp_path)
    recipe = {"merge_method": "nuslerp", "base_model": "base", "parameters": {"normalize": False, "weight": 1.0},
              "models": [{"model": "a", "parameters": {"t": 0.5}}, {"model": "b"}]}
    code, params, err = _import(root, recipe, capsys, monkeypatch)
    assert code == 0
    assert err == ["warning: recipe.yml: parameters.normalize: mergekit 0.1.5's nuslerp does not read it; "
                   "mergekit ignores it, dropped",
                   "warning: recipe.yml: models[0].parameters.t: mergekit 0.1.5's nuslerp does not read it; "
                   "mergekit ignores it, dropped"]
    assert "normalize" not in params["parameters"]
    assert [e["weight"] for e in params["experts"]] == [1.0, 1.0]


def test_a_shared_parameter_given_to_one_model_is_dropped(tmp_path, capsys, monkeypatch):
    """mergekit reads slerp's t from the slice and global scopes only, never a model's own."""
    root = _family(tmp_path)
    recipe = {"merge_method": "slerp", "base_model": "base", "parameters": {"t": 0.25},
              "models": [{"model": "base"}, {"model": "a", "parameters": {"t": 0.9}}]}
    code, params, err = _import(root, recipe, capsys, monkeypatch)
    assert code == 0 and params["parameters"]["t"] == 0.25
    assert err == ["warning: recipe.yml: models[1].parameters.t: mergekit 0.1.5's slerp reads it from the slice "
                   "and global parameters, never a model's; mergekit ignores it, dropped"]


def test_a_required_weight_no_condition_of_which_matches_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """mergekit: 'Missing required parameter weight'; nothing is written, and no warning precedes the error."""
    root = _family(tmp_path)
    recipe = {"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": {"filter": "absent",
                                                                                            "value": 1}}},
                                                   {"model": "b", "parameters": {"weight": 1.0}}]}
    code, params, err = _import(root, recipe, capsys, monkeypatch)
    assert code == 2 and params is None
    assert len(err) == 1 and "models[0].parameters.weight: required" in err[0], err


def test_slice_filters_are_matched_on_the_names_mergekit_matches_them(tmp_path):
    """A shared setting (lambda) on the output's names (output layer 1 is slice 1's); a per-input
    one (weight), global or a source's own, on the sources' names in their layer ranges (every
    source here is its model's layer 0); the input itself is not changed."""
    root = _family(tmp_path)
    recipe = {"merge_method": "task_arithmetic", "base_model": "base",
              "parameters": {"lambda": [{"filter": "layers.1.mlp", "value": 0.2}, {"filter": "layers.7", "value": 0.9},
                                        {"value": 1.0}],
                             "weight": [{"filter": "layers.1.mlp", "value": 0.3}, {"value": 0.5}]},
              "slices": [{"sources": [{"model": "base", "layer_range": [0, 1]},
                                      {"model": "a", "layer_range": [0, 1], "parameters": {
                                          "weight": [{"filter": "layers.1.", "value": 2}, {"value": 1}]}}]},
                         {"sources": [{"model": "base", "layer_range": [0, 1]},
                                      {"model": "b", "layer_range": [0, 1]}]}]}
    before = json.dumps(recipe)
    cleaned, warnings = without_ignored(recipe, "r.yml", root)
    assert json.dumps(recipe) == before
    assert cleaned["parameters"] == {"lambda": [{"filter": "layers.1.mlp", "value": 0.2}, {"value": 1.0}],
                                     "weight": [{"value": 0.5}]}
    assert cleaned["slices"][0]["sources"][1]["parameters"] == {"weight": [{"value": 1}]}
    assert warnings == [
        "warning: r.yml: parameters.lambda: filter 'layers.7' matches no tensor of the output; mergekit ignores it, "
        "dropped",
        "warning: r.yml: parameters.weight: filter 'layers.1.mlp' matches no tensor of the slices' sources; mergekit "
        "ignores it, dropped",
        "warning: r.yml: slices[0].sources[1].parameters.weight: filter 'layers.1.' matches no tensor of a (layers "
        "[0, 1]); mergekit ignores it, dropped"]


def test_an_unreadable_model_leaves_its_filters_as_written(tmp_path):
    recipe = {"merge_method": "linear", "models": [{"model": "missing", "parameters": {
        "weight": [{"filter": "absent", "value": 1}, {"value": 2}]}}]}
    assert without_ignored(recipe, "r.yml", tmp_path) == (recipe, [])


_SPECS = r'''
import json
from mergekit.merge_methods import registry
print(json.dumps({n: [sorted(p.name for p in m.spec.shared_parameters), sorted(p.name for p in m.spec.input_parameters)]
                  for n, m in registry._METHODS.items()}))
'''


@pytest.mark.skipif(not MERGEKIT_PYTHON.exists(), reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}")
def test_the_methods_facts_are_mergekits_specs():
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", _SPECS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    specs = json.loads(proc.stdout.strip().splitlines()[-1])
    names = mergekit_names()
    assert set(specs) <= set(names)
    for mk_name, (shared, per_input) in specs.items():
        facts = get_method(names[mk_name]).mergekit
        assert (sorted(facts.shared), sorted(facts.per_input)) == (shared, per_input), mk_name
