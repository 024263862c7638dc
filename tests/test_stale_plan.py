"""A plan made before params.yaml was edited is never merged as the edited file's.

`plan -o` records the blake3 of the params bytes it read (`made_from`, beside the plan and
outside its hash); `merge --params` refuses a plan of other bytes, and the workflow's plan
step reruns whenever the bytes differ from the ones it last planned, whatever the mtimes.
"""
from __future__ import annotations

import json
import os

from mergepipe.cli import main
from mergepipe.output.manifest import verify_outputs
from mergepipe.plan.planner import plan_hash
from tests.helpers import write_config
from tests.helpers.workflow import MODEL, copy_workspace, manifest, pending_jobs, set_budget, smk


def test_merge_refuses_a_plan_made_before_params_yaml_was_edited(tiny_family, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_family, budget="20%")
    plan_file, cache = tmp_path / "plan.json", str(tmp_path / "cache")
    merge = ["merge", str(plan_file), "--params", str(cfg), "--cache-dir", cache, "-q", "-o"]
    assert main(["plan", str(cfg), "-o", str(plan_file), "-q"]) == 0
    doc = json.loads(plan_file.read_text())
    # made_from is outside the hash: a plan's hash (and so its stored merge) is what it was
    assert set(doc["made_from"]) == {"params"} and plan_hash(doc) == doc["plan_hash"]
    assert plan_hash({k: v for k, v in doc.items() if k != "made_from"}) == doc["plan_hash"]

    set_budget(tmp_path, "35%")  # tmp_path/params.yaml
    capsys.readouterr()
    assert main([*merge, str(tmp_path / "stale")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "made from another version of" in err and "mergepipe plan" in err, err
    assert not (tmp_path / "stale").exists()

    assert main(["plan", str(cfg), "-o", str(plan_file), "-q"]) == 0  # planned again: merged
    assert main([*merge, str(tmp_path / "out")]) == 0
    man = verify_outputs(tmp_path / "out")
    assert man["budget"]["spec"] == "35%" and "made_from" not in man["plan"]
    assert man["plan_hash"] == json.loads(plan_file.read_text())["plan_hash"]


def test_merge_refuses_a_plan_that_cannot_say_what_it_was_made_from(tiny_family, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_family, budget="20%")
    cache = str(tmp_path / "cache")
    assert main(["plan", str(cfg), "-o", str(tmp_path / "cli.json"), "--budget", "50%", "-q"]) == 0
    doc = json.loads((tmp_path / "cli.json").read_text())
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "made_from"}))
    for name, why in (("cli.json", "made with --budget 50%"), ("old.json", "records no params file")):
        capsys.readouterr()
        args = ["merge", str(tmp_path / name), "--params", str(cfg), "-o", str(tmp_path / "out"), "--cache-dir", cache]
        assert main([*args, "-q"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, err
    # without --params, a plan file stands alone, as before
    assert main(["merge", str(tmp_path / "old.json"), "-o", str(tmp_path / "out"), "--cache-dir", cache, "-q"]) == 0


def test_the_workflow_replans_when_params_yaml_differs_from_what_the_plan_was_made_from(built_demo, tmp_path):
    """The race: params.yaml edited while the plan job ran, so plans/plan.json (of the old
    budget) is newer than the edit. Set here by giving the edited file an older mtime."""
    ws = copy_workspace(built_demo.ws, tmp_path / "ws")
    params, plan_file = ws / "params.yaml", ws / "plans" / "plan.json"
    set_budget(ws, "35%")
    old = plan_file.stat().st_mtime_ns - 10**9
    os.utime(params, ns=(old, old))
    assert pending_jobs(ws, MODEL) == {"plan": 1, "merge": 1}
    smk(ws, MODEL)
    assert manifest(ws)["budget"]["spec"] == "35%"
    assert pending_jobs(ws, MODEL) == {}
