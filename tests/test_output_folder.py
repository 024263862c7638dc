"""The published output folder is what the Hub expects and nothing else: config.json's dtype
fields name the dtype the weights are in (transformers loads the merge as written), and no
host- or inode-specific file sits beside the weights (the run record lives beside the folder)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.cli import main
from mergepipe.commands import uptodate
from mergepipe.errors import CheckpointError
from mergepipe.output.hf_config import output_config
from mergepipe.output.run_record import record_path
from tests.helpers import write_config


def _dtypes(folder: Path) -> set[str]:
    return {t.dtype for t in open_checkpoint(folder).tensors.values()}


def test_an_output_dtype_is_the_one_transformers_loads(tiny_family, tmp_path):
    cfg = write_config(tmp_path, tiny_family, output={"dir": str(tmp_path / "out"), "dtype": "float16"})
    assert main(["run", str(cfg), "-q"]) == 0
    assert _dtypes(tmp_path / "out") == {"F16"}
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert str(config.dtype) == "torch.float16"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float16"
    assert main(["verify", str(tmp_path / "out"), "-q"]) == 0


def test_a_mergekit_dtype_is_the_one_transformers_loads(tiny_family, tmp_path):
    root = Path(tiny_family["root"])
    (tmp_path / "mk.yml").write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": str(root / "base"), "dtype": "float16",
        "models": [{"model": str(root / f"expert_{k}"), "parameters": {"weight": 0.5}} for k in range(2)]}))
    assert main(["import-mergekit", str(tmp_path / "mk.yml"), "-o", str(tmp_path / "params.yaml"), "-q"]) == 0
    out = Path(yaml.safe_load((tmp_path / "params.yaml").read_text())["output"]["dir"])
    out = out if out.is_absolute() else tmp_path / out
    assert main(["run", str(tmp_path / "params.yaml"), "-q"]) == 0
    assert _dtypes(out) == {"F16"}
    assert str(AutoConfig.from_pretrained(out).dtype) == "torch.float16"


def test_the_base_dtype_keeps_the_base_config_bytes(tiny_family, tmp_path):
    cfg = write_config(tmp_path, tiny_family)
    assert main(["run", str(cfg), "-q"]) == 0
    base = Path(tiny_family["root"]) / "base" / "config.json"
    assert (tmp_path / "out" / "config.json").read_bytes() == base.read_bytes()


def test_every_dtype_field_and_sub_config_is_set(tmp_path):
    src = tmp_path / "config.json"
    src.write_text(json.dumps({"dtype": "bfloat16", "torch_dtype": "bfloat16", "model_type": "llava",
                               "text_config": {"torch_dtype": "bfloat16", "hidden_size": 8},
                               "vision_config": {"dtype": "float32"}, "other": {"hidden_size": 8}}))
    config = json.loads(output_config(src, "float16"))
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert config["text_config"]["torch_dtype"] == config["vision_config"]["dtype"] == "float16"
    assert config["other"] == {"hidden_size": 8}  # no dtype field where the base had none
    src.write_text(json.dumps({"model_type": "llama"}))
    assert json.loads(output_config(src, "float32"))["torch_dtype"] == "float32"
    src.write_text('{"torch_dtype": "float16"}')
    assert output_config(src, "float16") == b'{"torch_dtype": "float16"}'  # already right: bytes kept
    src.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json: not a JSON object"):
        output_config(src, "float16")


PUBLISHABLE = {"model.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md",
               "manifest.json", "mergekit_config.yml"}


def test_the_output_folder_holds_only_what_the_hub_gets(tiny_family, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_family)
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-q"]) == 0
    names = {p.name for p in out.iterdir()}
    assert names <= PUBLISHABLE | {n for n in names if n.endswith(".safetensors")}, names
    host = os.uname().nodename
    for p in out.iterdir():
        if not p.name.endswith(".safetensors"):
            text = p.read_text()
            assert host not in text and str((out / "manifest.json").stat().st_ino) not in text, p.name
    record = json.loads(record_path(out).read_text())  # beside the folder: .out.run.json
    assert record_path(out) == tmp_path / ".out.run.json" and record["host"] == host
    capsys.readouterr()
    assert main(["run", str(cfg)]) == 0  # the no-op: answered from the record beside the folder
    assert "up to date" in capsys.readouterr().err
    assert uptodate.fast_up_to_date(cfg, {"budget": None, "output": None}, None) is not None
    assert main(["verify", str(out), "-q"]) == 0


def test_a_file_where_the_run_record_goes_is_never_replaced(tiny_family, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_family)
    record_path(tmp_path / "out").write_text("my notes\n")
    for force in ([], ["--force"]):
        capsys.readouterr()
        assert main(["run", str(cfg), "-q", *force]) == 7
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ".out.run.json" in err and "not a mergepipe run record" in err
        assert record_path(tmp_path / "out").read_text() == "my notes\n" and not (tmp_path / "out").exists()


def test_an_earlier_versions_run_json_inside_the_output_is_dropped(tiny_family, tmp_path):
    cfg = write_config(tmp_path, tiny_family)
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-q"]) == 0
    (out / "run.json").write_text(json.dumps({"host": "h", "seconds": 1.0}))  # as earlier versions wrote it
    record_path(out).unlink()
    assert main(["run", str(cfg), "-q"]) == 0  # republished (restored from the store), without it
    assert not (out / "run.json").exists() and record_path(out).is_file()
    assert main(["verify", str(out), "-q"]) == 0
