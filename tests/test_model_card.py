"""The merged folder's README.md carries the Hub's merge metadata and is byte-stable."""
from __future__ import annotations

import yaml

from mergepipe.cli import main
from tests.helpers import write_config


def _card(tmp_path, family, name):
    d = tmp_path / name
    d.mkdir()
    cfg = write_config(d, family, method="ties", parameters={"density": 0.5})
    assert main(["run", str(cfg), "-q"]) == 0
    return (d / "out" / "README.md").read_text(), yaml.safe_load(cfg.read_text())


def test_card_front_matter_names_every_input_and_is_stable(tiny_family, tmp_path):
    text, cfg = _card(tmp_path, tiny_family, "a")
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model_relation"] == "merge"
    assert front["library_name"] == "transformers"
    assert front["tags"] == ["merge", "mergepipe"]
    assert front["base_model"][0] == cfg["base"]
    assert sorted(front["base_model"][1:]) == sorted(e["path"] for e in cfg["experts"])
    assert '"method": "ties"' in text.split("## Configuration")[1]
    again, _ = _card(tmp_path, tiny_family, "b")  # own cache: built again, not restored
    assert again.replace(str(tmp_path / "b"), str(tmp_path / "a")) == text
