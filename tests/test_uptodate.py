"""`mergepipe run`'s no-op check (commands/uptodate.py, issue 13): with nothing to do it
answers from the output's run record without importing torch or planning; anything that may
change the plan or the output (the config's bytes, an override, an input file edited in
place, an entry added to a model folder, an output file touched, a damaged record) sends
it to the full check, which decides."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.commands import uptodate
from mergepipe.output.manifest import load_manifest
from mergepipe.output.run_record import record_path
from tests.corpus.procs import params
from tests.helpers import write_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup(tiny_family, tiny_cache, tmp_path):
    root = Path(tiny_family["root"])
    for name in ("base", "expert_1"):
        shutil.copytree(root / name, tmp_path / name)
    family = {"base": tmp_path / "base", "experts": [root / "expert_0", tmp_path / "expert_1", root / "expert_2"]}
    cfg = params(tmp_path / "p.yaml", family, tmp_path / "out", tiny_cache, budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    return cfg, tmp_path / "out", family


def _fast(cfg: Path, out: Path | None = None, budget: str | None = None):
    return uptodate.fast_up_to_date(cfg, {"budget": budget, "output": None if out is None else str(out)},
                                    None if out is None else str(out))


def test_noop_run_takes_the_record_and_imports_no_torch(setup):
    cfg, out, _ = setup
    assert _fast(cfg) == (out, load_manifest(out)["plan_hash"])
    code = ("import sys; from mergepipe.cli import main; rc = main(['run', sys.argv[1]]); "
            "assert rc == 0; assert 'torch' not in sys.modules and 'numba' not in sys.modules and "
            "'numpy' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))")
    proc = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stderr


def test_config_and_override_changes_miss(setup):
    cfg, out, _ = setup
    assert _fast(cfg, budget="25%") is None  # an override is part of the key
    text = cfg.read_text()
    cfg.write_text(text + "\n# a comment\n")  # other bytes: the full check decides (and finds it up to date)
    assert _fast(cfg) is None
    assert main(["run", str(cfg), "-q"]) == 0
    assert _fast(cfg) is not None  # the full check refreshed the record
    cfg.write_text(text.replace("50%", "25%"))
    assert _fast(cfg) is None
    before = load_manifest(out)["plan_hash"]
    assert main(["run", str(cfg), "-q"]) == 0
    assert load_manifest(out)["plan_hash"] != before and _fast(cfg) is not None


@pytest.mark.parametrize("change", ["edit_in_place", "new_entry", "touch_output", "extra_output", "damaged_record"])
def test_changes_send_run_to_the_full_check(setup, change):
    cfg, out, family = setup
    if change == "edit_in_place":  # size and mtime restored: ctime still moves
        victim = family["experts"][1] / "model.safetensors"
        st = victim.stat()
        with open(victim, "r+b") as f:
            f.seek(st.st_size - 10)
            b = f.read(1)
            f.seek(st.st_size - 10)
            f.write(bytes([b[0] ^ 0x5A]))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "new_entry":
        (family["base"] / "notes.txt").write_text("x")
    elif change == "touch_output":
        os.utime(out / "model.safetensors")
    elif change == "extra_output":
        (out / "extra.txt").write_text("x")
    else:
        info = json.loads(record_path(out).read_text())
        info[uptodate.RECORD]["inputs"] = {"x": [1]}
        record_path(out).write_text(json.dumps(info))
    assert _fast(cfg) is None
    if change == "edit_in_place":  # the expert's bytes changed: a new merge
        before = load_manifest(out)["outputs"]
        assert main(["run", str(cfg), "-q"]) == 0
        assert load_manifest(out)["outputs"] != before
    elif change == "extra_output":  # not a mergepipe output any more: refused without --force
        assert main(["run", str(cfg), "-q"]) == 7
    else:
        assert main(["run", str(cfg), "-q"]) == 0


def test_garbage_run_json_is_a_miss_not_a_crash(setup):
    cfg, out, _ = setup
    for garbage in (b"", b"[]", b"{\"up_to_date\": 3, \"stat\": []}", b"\xff\x00", b"{\"up_to_date\": {}}"):
        record_path(out).write_bytes(garbage)
        assert _fast(cfg) is None
    assert main(["run", str(cfg), "-q"]) == 0


def _plan_hash(out: Path) -> str:
    return json.loads((out / "manifest.json").read_text())["plan_hash"]


@pytest.mark.parametrize("edit", ["tokenizer_file", "tokenizer_link_target", "calibration_text"])
def test_run_is_not_a_noop_after_an_input_outside_the_models_changed(edit, tiny_family, tmp_path):
    """run's no-op record keyed only the model folders: after an edit of the tokenizer source's
    files (or the blob its HF-style link points at) or of the calibration text, `run` said
    "up to date" and kept the stale output, which verify calls OK."""
    base = Path(tiny_family["root"]) / "base"
    tok, blobs = tmp_path / "tok", tmp_path / "blobs"
    tok.mkdir()
    blobs.mkdir()
    (tok / "config.json").write_bytes((base / "config.json").read_bytes())
    (blobs / "abc").write_bytes((base / "tokenizer.json").read_bytes())
    (tok / "tokenizer.json").symlink_to(blobs / "abc")
    (tok / "tokenizer_config.json").write_bytes((base / "tokenizer_config.json").read_bytes())
    (tmp_path / "calib.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    extra = {"plan": {"strategy": "calibrated", "text": "calib.txt", "max_tokens": 64, "seq_len": 32}} \
        if edit == "calibration_text" else {}
    cfg = write_config(tmp_path, tiny_family, budget="50%", **extra,
                       output={"dir": str(tmp_path / "out"), "tokenizer_source": "tok"})
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-q"]) == 0
    before = _plan_hash(out)
    if edit == "tokenizer_file":
        (tok / "tokenizer_config.json").write_text('{"model_max_length": 7}')
    elif edit == "tokenizer_link_target":
        (blobs / "abc").write_text('{"version": "edited"}')
    else:
        (tmp_path / "calib.txt").write_text("0 1 2 3 4 5 6 7 8 9 zzz qqq xxx " * 20)
    assert main(["run", str(cfg), "-q"]) == 0
    assert _plan_hash(out) != before
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tok / name).read_bytes()
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["plan_hash"] == _plan_hash(out)
