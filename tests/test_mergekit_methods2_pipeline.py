"""mergekit YAML -> `import-mergekit` -> `mergepipe run`, against mergekit 0.1.5's own `run_merge`
on the same YAML, for passthrough, nearswap, ram, ramplus_tl, della_linear (density 1, so
nothing random), and nuslerp (with a base model, flatten; without one, per row).

This checks the importer's reading of each method's config (which model is the base, what a
missing base_model means, per-model vs shared parameters, unweighted methods) as well as the
engine and the method: both outputs, bf16, must be equal by the rule of tests/_equivalence.py,
with the bound on magnitudes summed |W0| + sum |W_k| (times 4 for the slerp-type methods,
whose coefficients exceed 1). All configs run in one mergekit process (its start-up dominates).
Skipped without `.venv-mergekit`.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.cli import main
from tests._equivalence import INSTALL, MERGEKIT_PYTHON, judge

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]

SCRIPT = r'''
import json, sys
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

for path, out in json.loads(sys.argv[1]):
    config = MergeConfiguration.model_validate(yaml.safe_load(open(path)))
    run_merge(config, out, MergeOptions(lazy_unpickle=False, copy_tokenizer=False, write_model_card=False))
'''


def _configs(root) -> dict[str, dict]:
    """The mergekit configurations, as users write them (weights only where the method has them)."""
    e = [str(root / f"expert_{k}") for k in range(3)]
    base = str(root / "base")
    configs = {
        "passthrough": {"merge_method": "passthrough", "models": [{"model": e[0], "parameters": {"scale": 0.5}}]},
        "nearswap": {"merge_method": "nearswap", "base_model": base, "models": [{"model": e[1]}],
                     "parameters": {"t": 0.004}},
        "ram": {"merge_method": "ram", "base_model": base, "models": [{"model": m} for m in e],
                "parameters": {"epsilon": 1e-3}},
        "ramplus_tl": {"merge_method": "ramplus_tl", "base_model": base, "models": [{"model": m} for m in e],
                       "parameters": {"epsilon": 1e-3, "r": 0.5}},
        "della_linear": {"merge_method": "della_linear", "base_model": base,
                         "models": [{"model": e[0], "parameters": {"weight": 0.6, "epsilon": 0.1}},
                                    {"model": e[2], "parameters": {"weight": 0.9, "epsilon": 0.1}}]},
        "nuslerp_flat": {"merge_method": "nuslerp", "base_model": base,
                         "models": [{"model": e[0], "parameters": {"weight": 0.4}},
                                    {"model": e[1], "parameters": {"weight": 0.8}}]},
        "nuslerp_rows_nobase": {"merge_method": "nuslerp", "parameters": {"nuslerp_flatten": False},
                                "models": [{"model": e[2], "parameters": {"weight": 0.3}},
                                           {"model": e[1], "parameters": {"weight": 0.9}}]},
    }
    return {name: {**c, "dtype": "float32", "out_dtype": "bfloat16"} for name, c in configs.items()}


def _load_dir(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def merges(tmp_path_factory, tiny_family):
    root = tiny_family["root"]
    tmp = tmp_path_factory.mktemp("mk2_pipeline")
    jobs, ours = [], {}
    for name, config in _configs(root).items():
        d = tmp / name
        d.mkdir()
        (d / "mergekit.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        assert main(["import-mergekit", str(d / "mergekit.yaml"), "-o", str(d / "params.yaml"), "-q"]) == 0
        params = yaml.safe_load((d / "params.yaml").read_text())
        params.update(output={**params["output"], "dir": str(d / "out")}, cache_dir=str(tmp / "cache"))
        (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        assert main(["run", str(d / "params.yaml"), "-q"]) == 0
        ours[name] = (_load_dir(d / "out"), params)
        jobs.append((str(d / "mergekit.yaml"), str(d / "mk_out")))
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", SCRIPT, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = {name: _load_dir(tmp / name / "mk_out") for name in ours}
    models = {p.name: _load_dir(p) for p in [root / "base", *(root / f"expert_{k}" for k in range(3))]}
    return ours, theirs, models


@pytest.mark.parametrize("name", ["passthrough", "nearswap", "ram", "ramplus_tl", "della_linear", "nuslerp_flat",
                                  "nuslerp_rows_nobase"])
def test_imported_config_runs_like_mergekit(merges, name):
    ours_all, theirs_all, models = merges
    ours, params = ours_all[name]
    theirs = theirs_all[name]
    assert params["method"] == ("nuslerp" if name.startswith("nuslerp") else name)
    if name == "passthrough":  # the one model is base and expert; its scale a method parameter
        assert params["base"] == params["experts"][0]["path"] and params["parameters"]["scale"] == 0.5
    if name == "nuslerp_rows_nobase":  # the first model is the base, its weight base_weight
        assert params["parameters"]["base_weight"] == 0.3 and len(params["experts"]) == 1
    assert set(theirs) <= set(ours) and len(theirs) > 0
    inputs = [models["base"]] + [models[f"expert_{k}"] for k in range(3)]
    factor = 4.0 if name.startswith("nuslerp") else 1.0
    compared = identical = 0
    for tname, reference in theirs.items():
        got = ours[tname]
        assert got.dtype == reference.dtype == torch.bfloat16, tname
        scale = factor * sum(m[tname].double().abs() for m in inputs)
        verdict = judge(got.reshape(-1), reference.reshape(-1), scale=scale.reshape(-1))
        assert verdict.misses == 0, f"{tname}: {verdict}"
        compared += verdict.compared
        identical += verdict.identical
    assert identical > 0.9 * compared, (identical, compared)
