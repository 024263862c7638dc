"""Loading a plan (plan/load.py): a plan file read back is its typed record, which dumps to
the file's bytes; a damaged plan is refused in one line naming the file and the key."""
from __future__ import annotations

import json

import pytest

from mergepipe.cli import main
from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.plan.load import load_plan, read_plan_file, recorded_plan
from mergepipe.plan.record import MADE_FROM, PlanRecord, plan_hash, plan_json
from mergepipe.util.fs import canonical_json
from tests.helpers import write_config

CONFIGS = {
    "energy": {"budget": "40%"},
    "sketch": {"budget": "30%", "plan": {"strategy": "sketch"}},
    "ties-compensated": {"method": "ties", "parameters": {"lambda": 1.0, "density": 0.5}, "budget": "50%",
                        "plan": {"strategy": "compensated"}},
}


def _plan_file(tmp_path, family, name: str, **over):
    (tmp_path / name).mkdir()
    cfg = write_config(tmp_path / name, family, cache_dir=str(tmp_path / "cache"), **over)
    path = tmp_path / name / "plan.json"
    assert main(["plan", str(cfg), "-o", str(path), "-q"]) == 0
    return path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_load_then_dump_gives_the_plan_files_bytes(tmp_path, tiny_family, name):
    path = _plan_file(tmp_path, tiny_family, name, **CONFIGS[name])
    rec, made_from = read_plan_file(path)
    assert isinstance(rec, PlanRecord) and made_from is not None
    data = path.read_bytes()
    recorded = json.loads(data)[MADE_FROM]
    assert canonical_json({**plan_json(rec), MADE_FROM: recorded}) + b"\n" == data
    assert plan_hash(plan_json(rec)) == rec.plan_hash
    assert load_plan(path) == rec


def _edited(path, edit):
    doc = json.loads(path.read_text())
    doc.pop(MADE_FROM)
    edit(doc)
    doc["plan_hash"] = plan_hash(doc)  # a careful hand edit: the hash matches again
    path.write_bytes(canonical_json(doc) + b"\n")


EDITS = [
    (lambda p: p["experts"][0].__setitem__("weight", "heavy"), "plan key experts.0.weight"),
    (lambda p: p["experts"][1].__setitem__("weight", 1), "plan key experts.1.weight: not in the form"),
    (lambda p: p["bytes"].__setitem__("planned_pairs", p["bytes"]["planned_pairs"] + 1),
     "plan key bytes.planned_pairs: does not count the reads"),
    (lambda p: p.pop("bound"), "plan key bound"),
    (lambda p: p.__setitem__("method", "averaging"), "plan key method"),
]


@pytest.mark.parametrize(("edit", "key"), EDITS, ids=[k for _, k in EDITS])
def test_a_damaged_plan_is_refused_in_one_line_naming_the_file_and_key(tmp_path, tiny_family, capsys, edit, key):
    path = _plan_file(tmp_path, tiny_family, "p", budget="40%")
    _edited(path, edit)
    with pytest.raises(ConfigError, match=key) as err:
        load_plan(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)
    assert main(["merge", str(path), "-o", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "-q"]) == 2
    message = capsys.readouterr().err.strip()
    assert str(path) in message and key in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_a_truncated_or_rehashed_plan_is_refused(tmp_path, tiny_family):
    path = _plan_file(tmp_path, tiny_family, "p", budget="40%")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=f"{path}: cannot read plan"):
        load_plan(path)
    doc = json.loads(data)
    doc["budget"] = "50%"  # edited, hash not recomputed
    path.write_bytes(canonical_json(doc) + b"\n")
    with pytest.raises(ConfigError, match="plan_hash does not match the plan's content"):
        load_plan(path)


def test_recorded_plan_checks_the_manifests_hash(tmp_path, tiny_family):
    path = _plan_file(tmp_path, tiny_family, "p", budget="40%")
    plan = plan_json(load_plan(path))
    man = {"plan_hash": plan["plan_hash"], "plan": plan}
    assert plan_json(recorded_plan(man, "m.json: plan")) == plan
    with pytest.raises(IntegrityError, match="m.json: plan: plan_hash does not match the recorded plan"):
        recorded_plan({**man, "plan_hash": "0" * 64}, "m.json: plan")
