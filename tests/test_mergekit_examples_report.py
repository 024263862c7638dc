"""scripts/mergekit_examples_report.py on mergekit's examples/ (vendored in
tests/data/mergekit_examples/) and on a folder whose models are available (then it runs)."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = Path(__file__).parent / "data" / "mergekit_examples"


def _script():
    spec = importlib.util.spec_from_file_location("mergekit_examples_report",
                                                  ROOT / "scripts" / "mergekit_examples_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_share_and_reasons():
    script = _script()
    result = script.report(EXAMPLES)
    rows = {r["file"]: r for r in result["files"]}
    assert result["total"] == 6 and len(rows) == 6
    for name in ("bio-merge.yml", "gradient-slerp.yml", "linear.yml", "ties.yml", "orcamini-platy-44layer.yml"):
        assert rows[name]["imports"], (name, rows[name]["reason"])
    for r in result["files"]:
        assert r["reason"] is None or "\n" not in r["reason"]
    text = script.render(result)
    assert text.endswith(f"{result['imported']} of 6 import ({100 * result['imported'] / 6:.0f}%)\n")


def test_stacking_example_runs_where_its_models_are(tmp_path, tiny_family, capsys, monkeypatch):
    """The 44-layer frankenmerge's form (two slices of two models) on tiny models: it imports,
    builds the stack and runs."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    root = tiny_family["root"]
    for name in ("base", "expert_0"):
        shutil.copytree(root / name, tmp_path / name)
    text = (EXAMPLES / "orcamini-platy-44layer.yml").read_text()
    text = text.replace("psmathur/orca_mini_v3_13b", "base").replace("garage-bAInd/Platypus2-13B", "expert_0")
    text = text.replace("[0, 24]", "[0, 3]").replace("[20, 40]", "[1, 4]")
    (tmp_path / "franken.yml").write_text(text)
    assert _script().main([str(tmp_path), "--run"]) == 0
    assert capsys.readouterr().out == "franken.yml: imports; ran\n1 of 1 import (100%); 1 ran\n"


def test_run_where_models_are_available(tmp_path, tiny_family, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    root = tiny_family["root"]
    for name in ("base", "expert_0", "expert_1"):
        shutil.copytree(root / name, tmp_path / name)
    (tmp_path / "ties.yml").write_text(yaml.safe_dump({
        "merge_method": "ties", "base_model": "base", "dtype": "bfloat16",
        "parameters": {"density": [{"filter": "mlp", "value": 0.5}, {"value": 0.3}]},
        "models": [{"model": "expert_0", "parameters": {"weight": [0.2, 0.8]}},
                   {"model": "expert_1", "parameters": {"weight": 0.5}}]}))
    (tmp_path / "missing.yml").write_text("merge_method: linear\nmodels:\n  - {model: org/none, parameters: "
                                          "{weight: 1}}\n  - {model: org/other, parameters: {weight: 1}}\n")
    script = _script()
    assert script.main([str(tmp_path), "--run"]) == 0
    out = capsys.readouterr().out
    assert "ties.yml: imports; ran\n" in out
    assert "missing.yml: imports; models not available\n" in out
    assert out.endswith("2 of 2 import (100%); 1 ran\n")
