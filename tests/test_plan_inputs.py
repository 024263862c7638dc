"""Same plan hash, same bytes: the base's non-weight files the output copies (config.json,
generation_config.json, tokenizer files, stack.json) are inputs of the plan, recorded in
`base.files` {name: blake3}; one edited after planning makes a new plan, and a plan made
before the edit is refused, naming the file, even where the store holds that plan's merge."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace as NS

import pytest
from blake3 import blake3

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.cli import main
from mergepipe.commands.base_files import copy_base_files
from mergepipe.errors import IntegrityError
from mergepipe.output.manifest import verify_outputs
from mergepipe.plan.planner import plan_hash
from tests.helpers import write_config


@pytest.fixture
def own_base(tmp_path, tiny_family):
    """params.yaml over a copy of the tiny family's base (so its files can be edited here)."""
    base = tmp_path / "base"
    shutil.copytree(tiny_family["root"] / "base", base)
    return write_config(tmp_path, tiny_family, base=str(base)), base


def _edit_config(base):
    config = json.loads((base / "config.json").read_text())
    config["rope_theta"] = 12345.0
    (base / "config.json").write_text(json.dumps(config, indent=2))


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_the_plan_records_the_base_files_the_output_copies(own_base, tmp_path, capsys):
    cfg, base = own_base
    assert main(["run", str(cfg), "-q"]) == 0
    man = _manifest(tmp_path / "out")
    files = man["plan"]["base"]["files"]
    assert "config.json" in files and "tokenizer.json" in files and "generation_config.json" in files
    assert files == {n: blake3((base / n).read_bytes()).hexdigest() for n in files}
    assert all(man["outputs"]["files"][n]["blake3"] == h for n, h in files.items())  # copied as planned
    assert not any(n.endswith(".safetensors") for n in files)
    capsys.readouterr()
    assert main(["explain", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert f"base files copied (hashed into the plan): {', '.join(files)}" in capsys.readouterr().out


def test_run_on_an_edited_base_config_replans_and_publishes_it(own_base, tmp_path):
    cfg, base = own_base
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-q"]) == 0
    first = _manifest(out)["plan_hash"]
    _edit_config(base)
    assert main(["run", str(cfg), "-q"]) == 0
    man = verify_outputs(out)
    assert man["plan_hash"] != first and man["plan_hash"] == plan_hash(man["plan"])
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert main(["verify", str(out), "--inputs"]) == 0


def test_merge_refuses_a_plan_made_before_the_base_config_was_edited(own_base, tmp_path, capsys):
    cfg, base = own_base
    plan_file, cache = tmp_path / "plan.json", str(tmp_path / "cache")
    merge = ["merge", str(plan_file), "--cache-dir", cache, "-q", "-o"]
    assert main(["plan", str(cfg), "-o", str(plan_file), "-q"]) == 0
    assert main([*merge, str(tmp_path / "first")]) == 0  # the store now holds this plan's merge
    _edit_config(base)
    capsys.readouterr()
    assert main([*merge, str(tmp_path / "stale")]) == 6
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and "re-plan" in err, err
    assert not (tmp_path / "stale").exists()
    # the output made before the edit no longer matches its inputs
    assert main(["verify", str(tmp_path / "first"), "--inputs"]) == 6
    assert "config.json" in capsys.readouterr().err


def test_a_base_file_added_or_removed_after_planning_is_refused(own_base, tmp_path, capsys):
    cfg, base = own_base
    plan_file, cache = tmp_path / "plan.json", str(tmp_path / "cache")
    assert main(["plan", str(cfg), "-o", str(plan_file), "-q"]) == 0
    generation = (base / "generation_config.json").read_bytes()
    (base / "generation_config.json").unlink()
    (base / "added_tokens.json").write_text("{}")
    for why, fix in (("generation_config.json", lambda: (base / "generation_config.json").write_bytes(generation)),
                     ("added_tokens.json", lambda: (base / "added_tokens.json").unlink())):
        capsys.readouterr()
        assert main(["merge", str(plan_file), "--cache-dir", cache, "-q", "-o", str(tmp_path / "out")]) == 6
        err = capsys.readouterr().err
        assert why in err and "re-plan" in err, err
        fix()
    assert main(["merge", str(plan_file), "--cache-dir", cache, "-q", "-o", str(tmp_path / "out")]) == 0


def test_a_plan_without_base_files_is_refused(own_base, tmp_path, capsys):
    cfg, _ = own_base
    plan_file = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-o", str(plan_file), "-q"]) == 0
    doc = json.loads(plan_file.read_text())
    del doc["base"]["files"], doc["made_from"]
    doc["plan_hash"] = plan_hash(doc)  # a plan of an earlier version, hash and all
    plan_file.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["merge", str(plan_file), "--cache-dir", str(tmp_path / "cache"), "-q", "-o",
                 str(tmp_path / "out")]) == 2
    assert "plan key base.files" in capsys.readouterr().err


def test_the_copy_step_checks_the_bytes_it_copies(own_base, tmp_path):
    """A file edited between the inputs' check and the copy: the copied bytes are hashed."""
    _, base = own_base
    ckpt = open_checkpoint(base)
    (tmp_path / "tmp").mkdir()
    names = ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
             "tokenizer_config.json")
    files = {n: blake3((base / n).read_bytes()).hexdigest() for n in names if (base / n).is_file()}
    plan = NS(base=NS(files=files), output=NS(dtype=None, tokenizer_source=None))  # PlanRecord's fields read
    copied = copy_base_files(plan, ckpt, tmp_path / "tmp")
    assert copied == plan.base.files
    plan.base.files["config.json"] = blake3(b"other bytes").hexdigest()
    with pytest.raises(IntegrityError, match=r"config\.json: changed since the plan was made.*re-plan"):
        copy_base_files(plan, ckpt, tmp_path / "tmp")


def test_an_output_dtype_still_rewrites_config_json(own_base, tmp_path):
    cfg, base = own_base
    text = cfg.read_text().replace("output:\n", "output:\n  dtype: float32\n")
    cfg.write_text(text)
    assert main(["run", str(cfg), "-q"]) == 0
    man = _manifest(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"
    assert man["plan"]["base"]["files"]["config.json"] == blake3((base / "config.json").read_bytes()).hexdigest()


def test_merge_refuses_a_tokenizer_source_changed_after_its_merge_was_stored(own_base, tmp_path, capsys):
    cfg, base = own_base
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copyfile(base / "config.json", tok / "config.json")
    shutil.copyfile(base / "tokenizer.json", tok / "tokenizer.json")
    cfg.write_text(cfg.read_text().replace("output:\n", "output:\n  tokenizer_source: tok\n"))
    plan_file, cache = tmp_path / "plan.json", str(tmp_path / "cache")
    merge = ["merge", str(plan_file), "--root", str(tmp_path), "--cache-dir", cache, "-q", "-o"]
    assert main(["plan", str(cfg), "-o", str(plan_file), "-q"]) == 0
    assert "tokenizer.json" not in json.loads(plan_file.read_text())["base"]["files"]
    assert main([*merge, str(tmp_path / "first")]) == 0
    (tok / "tokenizer.json").write_text("{}")
    capsys.readouterr()
    assert main([*merge, str(tmp_path / "stale")]) == 6
    assert "tokenizer.json" in capsys.readouterr().err and not (tmp_path / "stale").exists()


def test_a_config_the_output_dtype_cannot_be_written_into_is_refused_when_planning(own_base, tmp_path, capsys):
    cfg, base = own_base
    (base / "config.json").write_text("[1]")
    cfg.write_text(cfg.read_text().replace("output:\n", "output:\n  dtype: float32\n"))
    capsys.readouterr()
    assert main(["plan", str(cfg), "-o", str(tmp_path / "plan.json"), "-q"]) == 3
    err = capsys.readouterr().err
    assert f"{base / 'config.json'}: not a JSON object" in err and not (tmp_path / "plan.json").exists(), err
