"""Densities and gammas off the two-decimal grid against mergekit 0.1.5: mergekit YAMLs of ties,
breadcrumbs and breadcrumbs_ties at 0.333, 0.125, 0.4567, gammas 0.017 / 0.013 and a gradient
density per layer, through `import-mergekit` + `run` (which makes the exact cuts those values ask
for, commands/cuts.py), equal mergekit-yaml's output by the rule of tests/helpers/equivalence.py
on fp32 pico Llamas (random fp32 deltas: no run of equal values at a threshold, where mergekit
would keep an arbitrary subset). Skipped without the mergekit reference venv."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from mergepipe.cli import main
from mergepipe.config.mergekit import write_params
from tests.helpers import load_model
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]

BUILD = r'''
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
root = sys.argv[1]
for i, name in enumerate(["base", "a", "b"]):
    torch.manual_seed(2000 + i)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=64))
    with torch.no_grad():  # norms start at ones: make every tensor differ between models
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(f"{root}/{name}", safe_serialization=True)
'''

RUN = r'''
import json, sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge
for text, out in json.loads(open(sys.argv[1]).read()):
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(text)), out,
              options=MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True))
'''

RECIPES = {
    "ties": {"merge_method": "ties", "parameters": {"density": 0.333},
             "models": [{"weight": 0.6, "density": 0.125}, {"weight": 0.4}]},
    "ties_gradient": {"merge_method": "ties", "parameters": {"density": 0.5},
                      "models": [{"weight": 0.7}, {"weight": 0.5, "density": [0.125, 0.333]}]},
    "breadcrumbs": {"merge_method": "breadcrumbs", "parameters": {"density": 0.333, "gamma": 0.017},
                    "models": [{"weight": 0.6}, {"weight": 0.4, "density": 0.125}]},
    "breadcrumbs_ties": {"merge_method": "breadcrumbs_ties", "parameters": {"density": 0.4567, "gamma": 0.013},
                         "models": [{"weight": 0.5}, {"weight": 0.5, "gamma": 0.0125}]},
}


def _yaml(name: str, root) -> str:
    r = RECIPES[name]
    models = [{"model": str(root / m), "parameters": p} for m, p in zip(("a", "b"), r["models"])]
    return yaml.safe_dump({"merge_method": r["merge_method"], "base_model": str(root / "base"), "models": models,
                           "parameters": r["parameters"], "dtype": "float32"}, sort_keys=False)


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mk_off_grid")
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", BUILD, str(root)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = root / "cases.json"
    spec.write_text(json.dumps([(_yaml(n, root), str(root / f"out-{n}")) for n in RECIPES]))
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", RUN, str(spec)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_an_off_grid_recipe_gives_mergekits_model(theirs, tmp_path, name):
    recipe = tmp_path / "mergekit.yml"
    recipe.write_text(_yaml(name, theirs))
    params_path = tmp_path / "params.yaml"
    assert main(["import-mergekit", str(recipe), "-o", str(params_path), "-q"]) == 0
    params = yaml.safe_load(params_path.read_text())
    params["output"]["dir"] = str(tmp_path / "out")
    params["cache_dir"] = str(tmp_path / "cache")
    write_params(params, params_path)
    assert main(["run", str(params_path), "-q"]) == 0
    plan = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]
    assert plan["cuts"]  # the values are off the grid: exact cuts were made and recorded
    ours, ref = load_model(tmp_path / "out"), load_model(theirs / f"out-{name}")
    inputs = [load_model(theirs / m) for m in ("base", "a", "b")]
    spread = 1 + sum(abs(m["weight"]) for m in RECIPES[name]["models"])
    assert sorted(ours) == sorted(ref)
    for tensor, reference in ref.items():
        scale = sum(m[tensor].double().abs() for m in inputs) * spread
        verdict = judge(ours[tensor].reshape(-1), reference.reshape(-1), scale=scale.reshape(-1))
        assert verdict.misses == 0, f"{tensor}: {verdict}"
