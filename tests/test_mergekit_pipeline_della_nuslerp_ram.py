"""mergekit YAML -> `import-mergekit` -> `mergepipe run`, against mergekit 0.1.5's own `run_merge`
on the same YAML, for passthrough, nearswap, ram, ramplus_tl, della_linear (density 1, so
nothing random), and nuslerp (with a base model, flatten; without one, per row); and the
configurations mergekit's tests/test_basic_merges.py runs for these methods (filtered passthrough
scale, nuslerp in all 8 mode/base combinations and with a negative weight, ram, ramplus_tl,
nearswap with the base listed among the models), computed in float32.

This checks the importer's reading of each method's config (which model is the base, what a
missing base_model means, per-model vs shared parameters, unweighted methods) as well as the
engine and the method: both outputs, bf16, must be equal by the rule of tests/helpers/equivalence.py,
with the bound on magnitudes summed |W0| + sum |W_k| (times 4 for the slerp-type methods,
whose coefficients exceed 1). All configs run in one mergekit process (its start-up dominates).
Skipped without `.venv-mergekit`.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.cli import main
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge

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
    configs.update(_basic_merges(base, e))
    return {name: {**c, "dtype": "float32", "out_dtype": "bfloat16"} for name, c in configs.items()}


def _basic_merges(base: str, e: list[str]) -> dict[str, dict]:
    """The configurations of mergekit's own tests/test_basic_merges.py for these methods (model_a,
    model_b = expert_0, expert_1 with weights 0.6, 0.4; model_c = the base), with dtype float32
    instead of bfloat16: mergekit then computes in fp32 as mergepipe always does."""
    two = [{"model": e[0], "parameters": {"weight": 0.6}}, {"model": e[1], "parameters": {"weight": 0.4}}]
    out = {
        "basic_passthrough_scale": {"merge_method": "passthrough", "models": [
            {"model": e[0], "parameters": {"scale": [{"filter": "o_proj", "value": 0}, {"value": 1}]}}]},
        "basic_nuslerp_negative": {"merge_method": "nuslerp", "base_model": base,
                                   "models": [{"model": e[0], "parameters": {"weight": -0.5}}, two[1]],
                                   "parameters": {"nuslerp_row_wise": False, "nuslerp_flatten": False}},
        "basic_ram": {"merge_method": "ram", "base_model": base, "models": two},
        "basic_ramplus_tl": {"merge_method": "ramplus_tl", "base_model": base, "models": two,
                             "parameters": {"r": 0.05, "alpha": 1.0}},
        "basic_nearswap": {"merge_method": "nearswap", "base_model": e[0], "models": two,
                           "parameters": {"t": 0.0001}},
    }
    for with_base in (False, True):
        for row_wise in (False, True):
            for flatten in (False, True):
                name = f"basic_nuslerp_{'base' if with_base else 'nobase'}_rw{int(row_wise)}_fl{int(flatten)}"
                out[name] = {"merge_method": "nuslerp", "models": two,
                             "parameters": {"nuslerp_row_wise": row_wise, "nuslerp_flatten": flatten},
                             **({"base_model": base} if with_base else {})}
    return out


MERGE_METHOD = {name: c["merge_method"] for name, c in _configs(Path("root")).items()}  # every name is ours too
NAMES = list(MERGE_METHOD)


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


@pytest.mark.parametrize("name", NAMES)
def test_imported_config_runs_like_mergekit(merges, name):
    ours_all, theirs_all, models = merges
    ours, params = ours_all[name]
    theirs = theirs_all[name]
    assert params["method"] == MERGE_METHOD[name]
    if name == "passthrough":  # the one model is base and expert; its scale a method parameter
        assert params["base"] == params["experts"][0]["path"] and params["parameters"]["scale"] == 0.5
    if name == "nuslerp_rows_nobase":  # the first model is the base, its weight base_weight
        assert params["parameters"]["base_weight"] == 0.3 and len(params["experts"]) == 1
    assert set(theirs) <= set(ours) and len(theirs) > 0
    inputs = [models["base"]] + [models[f"expert_{k}"] for k in range(3)]
    if name == "basic_passthrough_scale":  # mergekit's own check: o_proj zeroed, the rest expert_0's
        assert all(bool((t == 0).all()) == ("o_proj" in k) for k, t in ours.items() if t.is_floating_point())
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


def test_basic_merges_della_imports_and_runs_and_bad_epsilon_is_refused(tmp_path, tiny_family):
    """test_basic_merges' della configs: the valid one imports and runs (a randomized mask, so
    compared with mergekit in tests/test_mergekit_equivalence_della_nuslerp_ram.py, not here); density 0.66 with
    epsilon 1.35 is refused at import, as mergekit raises ValueError."""
    from mergepipe.config.mergekit import import_mergekit
    from mergepipe.errors import ConfigError

    root = tiny_family["root"]
    config = {"merge_method": "della", "base_model": str(root / "base"),
              "models": [{"model": str(root / "expert_0"), "parameters": {"weight": 0.6}},
                         {"model": str(root / "expert_1"), "parameters": {"weight": 0.4}}],
              "parameters": {"density": 0.66, "epsilon": 0.05, "lambda": 0.5}, "dtype": "bfloat16"}
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(config))
    assert main(["import-mergekit", str(tmp_path / "ok.yaml"), "-o", str(tmp_path / "params.yaml"), "-q"]) == 0
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params.update(output={**params["output"], "dir": str(tmp_path / "out")}, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(["run", str(tmp_path / "params.yaml"), "-q"]) == 0
    merged, base = _load_dir(tmp_path / "out"), _load_dir(root / "base")
    assert any(not torch.equal(merged[k], base[k]) for k in base)
    config["parameters"]["epsilon"] = 1.35
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="density \\+/- epsilon must lie strictly between 0 and 1"):
        import_mergekit(tmp_path / "bad.yaml")
