"""manifest.json as untrusted input to `verify` (and every reader through load_manifest) and to
scripts/check_manifest.py: JSON that two parsers read differently, or that no canonical hash
covers, is refused in one line, never a traceback and never "OK"."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.output.manifest import MANIFEST
from tests.helpers import write_config

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_manifest.py"


@pytest.fixture(scope="module")
def published(tiny_family, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("hostile-manifests")
    assert main(["run", str(write_config(site, tiny_family)), "-q"]) == 0
    return site / "out"


def _copy(published: Path, tmp_path: Path, text: str) -> Path:
    out = tmp_path / "out"
    shutil.copytree(published, out)
    (out / MANIFEST).write_text(text)
    return out


def _file_listed_twice(text: str) -> str:
    """config.json listed twice: first with a forged hash, then with the true one (which the last-wins
    parser of Python keeps, so the manifest_hash still matched; a first-wins reader sees the forgery)."""
    return text.replace('"config.json": {', '"config.json": {"blake3": "' + "0" * 64 + '"},\n  "config.json": {', 1)


HOSTILE = {
    "a_file_listed_twice": (_file_listed_twice, "duplicate key 'config.json'"),
    "nan_in_a_field": (lambda text: text.replace('"schema": 2', '"schema": NaN', 1), "NaN"),
    "infinity_in_a_field": (lambda text: text.replace('"schema": 2', '"schema": -Infinity', 1), "Infinity"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_verify_refuses_json_no_canonical_hash_covers_in_one_line(case, published, tmp_path, capsys):
    edit, fragment = HOSTILE[case]
    text = (published / MANIFEST).read_text()
    assert edit(text) != text
    out = _copy(published, tmp_path, edit(text))
    capsys.readouterr()
    for extra in ([], ["--deep"]):
        assert main(["verify", str(out), *extra]) == 6
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(out / MANIFEST) in err and fragment in err, err


@pytest.mark.parametrize("case", [*sorted(HOSTILE), "nested_100000_deep"])
def test_the_standalone_checker_refuses_them_in_one_line(case, published, tmp_path):
    text = (published / MANIFEST).read_text()
    hostile = '{"a":' * 100_000 + "1" + "}" * 100_000 if case == "nested_100000_deep" else HOSTILE[case][0](text)
    out = _copy(published, tmp_path, hostile)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == "", proc
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("MISMATCH: ") and "Traceback" not in err, err
    assert str(out / MANIFEST) in err, err
    if case in HOSTILE:
        assert HOSTILE[case][1] in err, err


def test_the_true_manifest_still_passes_both(published, tmp_path):
    out = _copy(published, tmp_path, (published / MANIFEST).read_text())
    assert main(["verify", str(out), "--deep"]) == 0
    assert subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True).returncode == 0
    assert json.loads((out / MANIFEST).read_text())["manifest_hash"]


def _forged_plan(published: Path, tmp_path: Path) -> Path:
    """A manifest whose plan lists an expert its reads do not name, both hashes recomputed
    (anyone who can write the folder can do this: the hashes have no key)."""
    from mergepipe.output.manifest import manifest_hash
    from mergepipe.plan.planner import plan_hash
    man = json.loads((published / MANIFEST).read_text())
    plan = man["plan"]
    plan["experts"] = [{**plan["experts"][0], "name": "ghost"}, *plan["experts"][1:]]
    man["plan_hash"] = plan["plan_hash"] = plan_hash(plan)
    man["manifest_hash"] = manifest_hash(man)
    return _copy(published, tmp_path, json.dumps(man))


@pytest.mark.parametrize("target", ["folder", "manifest"])
def test_explain_refuses_a_plan_no_merge_could_have_in_one_line(target, published, tmp_path, capsys):
    """explain read the manifest's plan without checking it: a KeyError traceback."""
    out = _forged_plan(published, tmp_path)
    capsys.readouterr()
    assert main(["explain", str(out if target == "folder" else out / MANIFEST)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out / MANIFEST) in err and "plan key" in err, err


def test_explain_still_reads_a_plan_file_with_its_made_from_record(published, tmp_path, tiny_family):
    cfg = write_config(tmp_path, tiny_family)
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["explain", str(tmp_path / "plan.json"), "--cache-dir", str(tmp_path / "cache")]) == 0


def test_provenance_refuses_a_plan_no_merge_could_have_in_one_line(published, tmp_path, capsys):
    """provenance quoted the manifest's plan without checking it: KeyError/TypeError tracebacks
    for a plan without experts or with a base that is not a record."""
    out = _forged_plan(published, tmp_path)
    capsys.readouterr()
    assert main(["provenance", str(out), "-o", str(tmp_path / "prov.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out / MANIFEST) in err and "plan key" in err, err
    assert not (tmp_path / "prov.json").exists()
