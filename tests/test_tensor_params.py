"""Per-tensor parameters (gradients over layers, tensor filters) in params.yaml: the grammar
against mergekit 0.1.5's own `evaluate_setting`, the plan's `tensor_parameters`, and merges
whose every tensor equals the same tensor of a merge with that tensor's resolved scalars."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from mergepipe.cli import main
from mergepipe.config.params import config_from_dict, load_config
from mergepipe.config.settings import layer_positions, parse_setting
from mergepipe.config.tensor_params import resolve_tensor_parameters
from mergepipe.errors import ConfigError
from tests.helpers.equivalence import MERGEKIT_PYTHON
from tests.helpers import load_model, write_config

SETTINGS = [
    [0, 0.5, 0.3, 0.7, 1],
    [1.0, 0.0],
    [0.25],
    {"filter": "self_attn", "value": 0.3},
    [{"filter": "self_attn", "value": [0, 0.5, 1]}, {"filter": "mlp", "value": [1, 0.5, 0]}, {"value": 0.5}],
    [{"filter": "o_proj", "value": 0}, {"filter": "*", "value": 2}],
    [{"filter": "up_proj", "value": 0.2}],
]
NAMES = ["model.layers.3.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
         "model.layers.1.self_attn.o_proj.weight", "model.embed_tokens.weight", "lm_head.weight"]
TS = [0.0, 0.2, 1 / 3, 0.5, 2 / 3, 0.77, 1.0]


def test_layer_positions_follow_mergekit():
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)] + \
            ["model.embed_tokens.weight", "model.norm.weight", "transformer.h.0.attn.c_attn.weight",
             "transformer.h.1.attn.c_attn.weight", "vision.encoder.layers.0.fc.weight"]
    t = layer_positions(names)
    assert [t[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(5)] == [0, 0.25, 0.5, 0.75, 1]
    assert t["model.embed_tokens.weight"] == t["model.norm.weight"] == 0  # mergekit's pre/post weights
    assert t["transformer.h.1.attn.c_attn.weight"] == 1 and t["transformer.h.0.attn.c_attn.weight"] == 0
    assert t["vision.encoder.layers.0.fc.weight"] == 1  # a stack of one layer: t = 1, as mergekit


@pytest.mark.skipif(not MERGEKIT_PYTHON.exists(), reason="mergekit reference venv not found")
def test_evaluate_matches_mergekit_evaluate_setting():
    script = r'''
import json, sys
from pydantic import TypeAdapter
from mergekit.config import ParameterSetting, evaluate_setting
cases = json.loads(sys.argv[1])
adapter = TypeAdapter(ParameterSetting)
out = []
for setting, name, t in cases:
    out.append(evaluate_setting(name, adapter.validate_python(setting), t, validate=lambda v: v))
print(json.dumps(out))
'''
    cases = [(s, n, t) for s in SETTINGS for n in NAMES for t in TS]
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", script, json.dumps(cases)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout)
    ours = [parse_setting(s).evaluate(n, t) for s, n, t in cases]
    assert ours == theirs  # exact, fp64 interpolation included


@pytest.mark.parametrize("bad, message", [
    ({"experts.0.weight": []}, "experts[0].weight: expected a value"),
    ({"experts.0.weight": [{"filter": "mlp"}]}, "has no value"),
    ({"experts.0.weight": [{"filter": "mlp", "value": 1, "x": 2}]}, "unknown condition key 'x'"),
    ({"experts.0.density": [0.5, 1.5]}, "experts[0].density: must be in (0, 1]"),
    ({"parameters": {"lambda": [1, "x"]}}, "parameters.lambda"),
])
def test_bad_settings_are_one_line_errors(tmp_path, tiny_family, bad, message):
    cfg = write_config(tmp_path, tiny_family, method="ties")
    with pytest.raises(ConfigError) as err:
        load_config(cfg, overrides=bad)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_normalized_round_trips_settings(tmp_path, tiny_family):
    weight = [{"filter": "mlp", "value": [0.2, 0.8]}, {"value": 0.5}]
    cfg = load_config(write_config(tmp_path, tiny_family, method="ties",
                                   parameters={"density": [0.2, 0.6]}),
                      overrides={"experts.0.weight": weight})
    norm = cfg.normalized()
    assert norm["experts"][0]["weight"] == weight
    assert norm["parameters"]["density"] == [0.2, 0.6]
    assert norm["experts"][0]["density"] is None  # the method's, per tensor
    again = config_from_dict(norm, root=tmp_path)
    assert again.normalized() == norm


def test_resolution_names_the_tensor(tmp_path, tiny_family):
    cfg = load_config(write_config(tmp_path, tiny_family, method="ties"),
                      overrides={"experts.1.weight": {"filter": "mlp", "value": 0.5}})
    with pytest.raises(ConfigError, match=r"tensor 'model\.embed_tokens\.weight'.*experts\[1\]\.weight: no condition"):
        resolve_tensor_parameters(cfg, ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"])
    cfg = load_config(write_config(tmp_path, tiny_family, method="ties", parameters={"density": [0.3, 0.65]}))
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(4)]
    # a gradient between the index's grid values resolves as it is: the merge makes those exact cuts
    tp = resolve_tensor_parameters(cfg, names)
    assert tp["groups"][tp["tensors"][names[1]]]["parameters"]["density"] == pytest.approx(0.3 + 0.35 / 3)


def _merge(tmp_path, family, sub: str, **cfg) -> dict:
    d = tmp_path / sub
    d.mkdir()
    path = write_config(d, family, cache_dir=str(tmp_path / "cache"), **cfg)
    assert main(["run", str(path), "-q"]) == 0
    return load_model(d / "out")


def test_slerp_gradient_equals_per_layer_scalar_merges(tmp_path, tiny_family):
    """t: [0.1, 0.9] on attention, 0.4 elsewhere: each tensor equals the scalar-t merge at its t."""
    experts = yaml.safe_load(write_config(tmp_path, tiny_family).read_text())["experts"][:1]
    t_setting = [{"filter": "self_attn", "value": [0.1, 0.9]}, {"value": 0.4}]
    ours = _merge(tmp_path, tiny_family, "grad", method="slerp", experts=experts, parameters={"t": t_setting})
    position = layer_positions(ours)
    for name, tensor in ours.items():
        t = parse_setting(t_setting).evaluate(name, position[name])
        ref = _merge(tmp_path, tiny_family, f"t{t}", method="slerp", experts=experts, parameters={"t": t}) \
            if not (tmp_path / f"t{t}").exists() else load_model(tmp_path / f"t{t}" / "out")
        assert ref[name].equal(tensor), name
    plan = json.loads((tmp_path / "grad" / "out" / "manifest.json").read_text())["plan"]
    groups = plan["tensor_parameters"]["groups"]
    assert sorted({g["parameters"]["t"] for g in groups}) == sorted(
        {parse_setting(t_setting).evaluate(n, position[n]) for n in ours})


def test_filtered_expert_weight_and_density(tmp_path, tiny_family):
    """TIES with expert 0's weight 0.3 on mlp (1.0 elsewhere) and density per filter: every tensor
    equals the merge with those values as scalars, and the other tensors are untouched."""
    base = yaml.safe_load(write_config(tmp_path, tiny_family).read_text())
    experts = base["experts"]
    per = [dict(e) for e in experts]
    per[0]["weight"] = [{"filter": "mlp", "value": 0.3}, {"value": 1.0}]
    ours = _merge(tmp_path, tiny_family, "filtered", method="ties", experts=per,
                  parameters={"density": [{"filter": "self_attn", "value": 0.4}, {"value": 0.7}]})
    mlp = [dict(e) for e in experts]
    mlp[0]["weight"] = 0.3
    ref_mlp = _merge(tmp_path, tiny_family, "mlp", method="ties", experts=mlp, parameters={"density": 0.7})
    ref_attn = _merge(tmp_path, tiny_family, "attn", method="ties", experts=experts, parameters={"density": 0.4})
    ref_rest = _merge(tmp_path, tiny_family, "rest", method="ties", experts=experts, parameters={"density": 0.7})
    seen = set()
    for name, tensor in ours.items():
        ref = ref_mlp if "mlp" in name else ref_attn if "self_attn" in name else ref_rest
        assert ref[name].equal(tensor), name
        seen.add("mlp" if "mlp" in name else "attn" if "self_attn" in name else "rest")
    assert seen == {"mlp", "attn", "rest"}


def test_explain_uses_each_tensors_weights(tmp_path, tiny_family, capsys):
    """A budgeted per-tensor plan: explain shows the weights as per tensor and the share of
    update energy kept from each tensor's own effective weights (the planner's scores)."""
    experts = yaml.safe_load(write_config(tmp_path, tiny_family).read_text())["experts"][:2]
    experts[0]["weight"] = [{"filter": "mlp", "value": 0.3}, {"value": 1.0}]
    experts[1]["weight"] = [0.2, 0.9]
    d = tmp_path / "budget"
    d.mkdir()
    path = write_config(d, tiny_family, experts=experts, budget="50%", cache_dir=str(tmp_path / "cache"))
    assert main(["run", str(path), "-q"]) == 0
    capsys.readouterr()
    assert main(["explain", str(d / "out"), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "| per tensor |" in out
    plan = json.loads((d / "out" / "manifest.json").read_text())["plan"]
    kept = float(out.split("sum of planned s^2 / sum of all s^2): ")[1].split("%")[0]) / 100
    omitted, full = plan["bound"]["omitted_mass"], plan["bound"]["full_update_norm_estimate"]
    assert 0 < kept < 1 and full > omitted > 0


def test_plan_records_and_checks_tensor_parameters(tmp_path, tiny_family):
    """The card shows the per-tensor parameters; a plan from disk with a group index out of
    range is refused naming the key."""
    experts = yaml.safe_load(write_config(tmp_path, tiny_family).read_text())["experts"][:2]
    experts[1]["weight"] = [0.2, 0.9]
    path = write_config(tmp_path, tiny_family, experts=experts)
    assert main(["plan", str(path), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    tp = plan["tensor_parameters"]
    # 4 layers: t = 0 (layer 0 and every tensor outside the layers), 1/3, 2/3, 1
    assert [g["experts"]["e1"]["weight"] for g in tp["groups"]] == \
        [parse_setting([0.2, 0.9]).evaluate("x", t) for t in (0, 1 / 3, 2 / 3, 1)]
    assert all(tp["tensors"][n] == 0 for n in tp["tensors"] if ".layers." not in n)
    assert main(["merge", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out"), "--root", str(tmp_path),
                 "--cache-dir", str(tmp_path / "cache"), "-q"]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "\ntensor_parameters:\n" in card  # the plan's configuration, as YAML
    name = sorted(tp["tensors"])[0]
    tp["tensors"][name] = len(tp["groups"])
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    code = main(["merge", str(tmp_path / "bad.json"), "-o", str(tmp_path / "out2"), "--root", str(tmp_path),
                 "--cache-dir", str(tmp_path / "cache"), "-q"])
    assert code == 2 and not (tmp_path / "out2").exists()
