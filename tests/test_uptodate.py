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
