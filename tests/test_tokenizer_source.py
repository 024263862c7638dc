"""output.tokenizer_source: the output's tokenizer files come from another model folder,
hashed into the plan; another vocabulary size is refused."""
from __future__ import annotations

import json

import pytest

from mergepipe.cli import main
from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError
from mergepipe.commands.pipeline import plan_config
from mergepipe.index.store import Store
from tests.helpers import write_config


def _tokenizer_model(tmp_path, family, vocab_delta: int = 0):
    folder = tmp_path / "tok"
    folder.mkdir()
    base = family["root"] / "base"
    config = json.loads((base / "config.json").read_text())
    config["vocab_size"] += vocab_delta
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [*tokenizer.get("added_tokens", []), {"id": 0, "content": "<mine>"}]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_tokenizer_files_come_from_the_source(tmp_path, tiny_family):
    folder = _tokenizer_model(tmp_path, tiny_family)
    cfg = write_config(tmp_path, tiny_family, output={"dir": str(tmp_path / "out"), "tokenizer_source": "tok"})
    assert main(["run", str(cfg), "-q"]) == 0
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    base = tiny_family["root"] / "base"
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert (base / "tokenizer_config.json").exists() and not (out / "tokenizer_config.json").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["output"]["tokenizer_source"]["path"] == "tok"
    assert "tokenizer.json" in manifest["plan"]["output"]["tokenizer_source"]["files"]
    assert main(["verify", str(out)]) == 0


def test_a_changed_tokenizer_after_planning_is_refused(tmp_path, tiny_family):
    folder = _tokenizer_model(tmp_path, tiny_family)
    cfg = write_config(tmp_path, tiny_family, output={"dir": str(tmp_path / "out"), "tokenizer_source": "tok"})
    assert main(["plan", str(cfg), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    (folder / "tokenizer.json").write_text("{}")
    code = main(["merge", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out"), "--root", str(tmp_path),
                 "--cache-dir", str(tmp_path / "cache"), "-q"])
    assert code == 6 and not (tmp_path / "out").exists()


def test_another_vocabulary_is_refused(tmp_path, tiny_family):
    _tokenizer_model(tmp_path, tiny_family, vocab_delta=8)
    cfg = load_config(write_config(tmp_path, tiny_family, output={"dir": str(tmp_path / "out"),
                                                                  "tokenizer_source": "tok"}))
    with pytest.raises(ConfigError, match=r"output.tokenizer_source: .*tok has vocab_size \d+, the base \d+"):
        plan_config(cfg, Store(tmp_path / "cache"))
