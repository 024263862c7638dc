"""Red-team pass 6 (issue 15): data loss and wrong models `verify` calls OK, from a shared
cluster folder, a careless shell or a half-edited params.yaml. Each test lost a user's files
or published a model that verify called OK before its fix."""
from __future__ import annotations

import subprocess
from pathlib import Path

from tests.workflow_helpers import make_workspace, run

GIT = ["git", "-c", "user.name=mergepipe-test", "-c", "user.email=test@example.invalid", "-c", "init.defaultBranch=main"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


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
    before = _tree(mine)
    proc = run(ws, "dvc", "repro", check=False)
    assert proc.returncode != 0
    assert "output.dir 'mywork'" in proc.stdout + proc.stderr
    assert _tree(mine) == before
