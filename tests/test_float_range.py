"""The merge computes in float32 and writes the output dtype: weights, parameters or effective
weights past float32's range (in params.yaml or an edited plan), and values past float16's range
in a float16 output, are one-line errors, never a published model of inf or NaN."""
from __future__ import annotations

import json

import pytest
import yaml

from mergepipe.cli import main
from tests.helpers import one_line_error, write_config


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
    one_line_error(capsys, "lambda" if name == "lambda_1e39" else "weight")
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
    one_line_error(capsys, str(plan_file), "weight", "float32")
    assert not (tmp_path / "m").exists()


def test_a_merge_past_float16s_range_is_refused_not_published_as_inf(tiny_family, tmp_path, capsys):
    """float16 tops out at 65504: a merge into `output.dtype: float16` whose values exceed it
    (finite in float32) published a model of inf that `verify` called OK."""
    cfg = write_config(tmp_path, tiny_family, parameters={"lambda": 1e8}, output={"dir": str(tmp_path / "out"),
                                                                                   "dtype": "float16"})
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) == 5
    assert "float16's range" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    ok = write_config(tmp_path, tiny_family, output={"dir": str(tmp_path / "out"), "dtype": "float16"})
    assert main(["run", str(ok), "-q"]) == 0  # an ordinary float16 merge is not refused
