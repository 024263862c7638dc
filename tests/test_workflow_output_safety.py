"""The workflows never delete a user's files: Snakemake and DVC delete a job's outputs before
running it, so rules/common.smk refuses (at parse time) an output.dir or demo folder that
mergepipe would not replace, and DVC's outputs that hold user folders are `persist`."""
from __future__ import annotations

from pathlib import Path

import yaml
import subprocess
from tests.helpers.workflow import make_workspace, run
from tests.helpers import file_tree


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


GIT = ["git", "-c", "user.name=mergepipe-test", "-c", "user.email=test@example.invalid",
       "-c", "init.defaultBranch=main"]


def test_dvc_repro_never_deletes_a_users_folder_at_output_dir(tmp_path):
    """DVC deletes a stage's outputs before running it: `dvc repro` after params.yaml's
    output.dir was pointed at a user's folder deleted the whole folder (notes, weights), then
    published the merge there. The output is now `persist`, so the workflow's own check refuses."""
    ws = make_workspace(tmp_path / "ws", with_source=True)
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "workflow"]):
        subprocess.run([*GIT, *args], cwd=ws, capture_output=True, check=True)
    run(ws, "dvc", "repro", "demo")  # the models (its Snakemake call would refuse the folder too)
    mine = ws / "mywork"
    mine.mkdir()
    (mine / "notes.txt").write_text("a week of results\n")
    (mine / "model.safetensors").write_bytes(b"my fine-tune")
    params = ws / "params.yaml"
    params.write_text(params.read_text().replace("dir: merged", "dir: mywork"))
    before = file_tree(mine)
    proc = run(ws, "dvc", "repro", check=False)
    assert proc.returncode != 0
    assert "output.dir 'mywork'" in proc.stdout + proc.stderr
    assert file_tree(mine) == before


def test_a_model_put_in_the_demo_folder_is_not_deleted_with_it(tmp_path):
    """The demo rule's output (and DVC's demo stage's) is the whole demo folder, which both
    tools delete before regenerating it: a model the user put there went with it, under DVC as
    soon as the folder changed, under Snakemake when params.yaml named one more demo expert.
    DVC's demo output is now `persist` and the workflow refuses a demo folder holding a
    file `mergepipe demo` did not write."""
    ws = make_workspace(tmp_path / "ws", with_source=True)
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "workflow"]):
        subprocess.run([*GIT, *args], cwd=ws, capture_output=True, check=True)
    run(ws, "dvc", "repro", "demo")
    mine = ws / "models" / "demo" / "my_expert"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"my fine-tune")
    proc = run(ws, "dvc", "repro", "demo", check=False)
    assert proc.returncode != 0 and "'my_expert'" in proc.stdout + proc.stderr
    assert (mine / "model.safetensors").read_bytes() == b"my fine-tune"
    params = ws / "params.yaml"
    text = params.read_text()
    last = "  - {name: expert_2, path: models/demo/expert_2, weight: 0.7}\n"
    assert last in text
    params.write_text(text.replace(last, last + "  - {name: expert_3, path: models/demo/expert_3, weight: 0.3}\n"))
    proc = run(ws, "snakemake", "merged/manifest.json", check=False)
    assert proc.returncode != 0 and "'my_expert'" in proc.stdout + proc.stderr
    assert (mine / "model.safetensors").read_bytes() == b"my fine-tune"
