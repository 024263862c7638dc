"""The workflows never delete a user's files: Snakemake and DVC delete a job's outputs before
running it, so rules/common.smk refuses (at parse time) an output.dir or demo folder that
mergepipe would not replace, and DVC's outputs that hold user folders are `persist`."""
from __future__ import annotations

from pathlib import Path

import yaml


def test_the_workflow_never_lets_snakemake_delete_a_users_weights_at_output_dir(tiny_family, tmp_path):
    """`snakemake` with output.dir a folder of the user's (a model.safetensors and some
    manifest.json): Snakemake deletes a job's existing outputs before running it, so the user's
    weights were gone before `mergepipe merge` refused the folder. rules/common.smk now refuses
    such a folder at parse time (what mergepipe would not replace without --force)."""
    from tests.helpers.workflow import make_workspace, smk
    ws = make_workspace(tmp_path / "ws")
    root = Path(tiny_family["root"])
    cfg = yaml.safe_load((ws / "params.yaml").read_text())
    cfg.update(base=str(root / "base"), experts=[{"name": "e0", "path": str(root / "expert_1"), "weight": 1.0}],
               method="task_arithmetic", parameters={"lambda": 1.0}, budget="full",
               output={**cfg.get("output", {}), "dir": "mine"})
    cfg.pop("plan", None)
    (ws / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    mine = ws / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"the user's weights")
    (mine / "manifest.json").write_text('{"mine": 1}')
    proc = smk(ws, "-c1", "mine/model.safetensors", check=False)
    assert proc.returncode != 0 and "output.dir 'mine'" in proc.stdout + proc.stderr
    assert (mine / "model.safetensors").read_bytes() == b"the user's weights"
    assert (mine / "manifest.json").read_text() == '{"mine": 1}'
