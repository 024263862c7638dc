"""Red-team pass 6 (issue 15): data loss and wrong models `verify` calls OK, from a shared
cluster folder, a careless shell or a half-edited params.yaml. Each test lost a user's files
or published a model that verify called OK before its fix."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.output.run_record import record_path
from tests.helpers import write_config
from tests.helpers.workflow import make_workspace, run

GIT = ["git", "-c", "user.name=mergepipe-test", "-c", "user.email=test@example.invalid",
       "-c", "init.defaultBranch=main"]


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


def test_a_users_weights_under_a_copied_manifest_are_not_replaced(tiny_family, tmp_path, capsys):
    """A folder holding a user's model.safetensors and a manifest.json copied from another
    output (`cp -r merged mine` and then new weights moved in, or the manifest copied over)
    passed as a complete mergepipe output: `run` replaced it, weights lost. A weight file is
    ours only at the inode and size the run record holds, or if it matches the manifest."""
    def config(name: str, out: Path, **kw) -> Path:
        (tmp_path / name).mkdir()
        return write_config(tmp_path / name, tiny_family, output={"dir": str(out)},
                            cache_dir=str(tmp_path / "cache"), **kw)
    out = tmp_path / "out"
    cfg = config("c", out)
    assert main(["run", str(cfg), "-q"]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"my fine-tune")
    shutil.copy(out / "manifest.json", mine)
    shutil.copytree(out, tmp_path / "mine2")  # a whole copy, then a fine-tune moved over its weights
    (tmp_path / "ft.safetensors").write_bytes(b"my other fine-tune")
    os.replace(tmp_path / "ft.safetensors", tmp_path / "mine2" / "model.safetensors")
    for folder in (mine, tmp_path / "mine2"):
        before = _tree(folder)
        other = config(f"c-{folder.name}", folder)
        capsys.readouterr()
        assert main(["run", str(other), "-q"]) == 7
        assert "not the weight file mergepipe published" in capsys.readouterr().err
        assert _tree(folder) == before
    # what stays replaceable: a flipped byte in place (damage) and the same bytes under a new
    # inode without its run record (a folder DVC restored)
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert main(["run", str(cfg), "-q"]) == 0 and weights.read_bytes() == good
    record_path(out).unlink()
    weights.unlink()
    weights.write_bytes(good)
    lam = config("c-lambda", out, parameters={"lambda": 0.9})
    assert main(["run", str(lam), "-q"]) == 0
    assert json.loads((out / "manifest.json").read_text())["plan"]["parameters"]["lambda"] == 0.9


@pytest.mark.parametrize("direct", [False, True], ids=["kernel-copy", "direct-writes"])
def test_a_base_edited_while_the_merge_runs_is_not_published(tiny_family, tmp_path, capsys, monkeypatch, direct):
    """The base's unmerged regions are copied file to file (or, with direct writes, read and
    appended) and their hashes taken from its index: a base rewritten in place while a merge
    ran (a shared folder, `cp` over a shard) published other bytes under the index's hashes,
    and plain `verify` (and `run`) called it OK. The inputs' stat keys are now checked again
    before publishing."""
    import mergepipe.engine.merge as engine
    import mergepipe.util.fs as fs
    monkeypatch.setenv("MERGEPIPE_DIRECT_WRITES", "1" if direct else "0")
    fam = tmp_path / "fam"
    shutil.copytree(tiny_family["root"], fam)
    cfg = write_config(tmp_path, {**tiny_family, "root": fam}, budget="10%")
    base = fam / "base" / "model.safetensors"
    def edit(offset: int) -> None:  # a user's in-place edit, now
        with open(base, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x5A]))

    if direct and not fs.shares_extents(tmp_path):
        module, attr = engine, "CheckpointReader"  # the engine's own reader: the copied runs' reads
        real = engine.CheckpointReader

        class racing(real):
            def read_range(self, t, begin, end):
                if engine.CheckpointReader is not real:
                    edit(begin)
                    monkeypatch.setattr(module, attr, real)
                return super().read_range(t, begin, end)
    else:
        module, attr = fs, "copy_range"  # the kernel copy's entry point
        real = fs.copy_range

        def racing(src_fd, src_offset, *args, **kw):
            if os.fstat(src_fd).st_ino == base.stat().st_ino:
                edit(src_offset)
                monkeypatch.setattr(module, attr, real)
            return real(src_fd, src_offset, *args, **kw)
    monkeypatch.setattr(module, attr, racing)
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) == 3
    assert "changed while the merge ran" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert getattr(module, attr) is real  # the edit happened
    assert main(["run", str(cfg), "-q"]) == 0  # the next run indexes the edited base
    assert main(["verify", str(tmp_path / "out"), "--deep", "-q"]) == 0



def test_a_merge_past_float16s_range_is_refused_not_published_as_inf(tiny_family, tmp_path, capsys):
    """float16 tops out at 65504: a merge into `output.dtype: float16` whose values exceed it
    (finite in float32) published a model of inf that `verify` called OK."""
    cfg = write_config(tmp_path, tiny_family, parameters={"lambda": 1e8}, output={"dir": str(tmp_path / "out"),
                                                                                   "dtype": "float16"})
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) == 5
    assert "float16's range" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    ok = write_config(tmp_path, tiny_family, output={"dir": str(tmp_path / "out"), "dtype": "float16"})
    assert main(["run", str(ok), "-q"]) == 0  # an ordinary float16 merge is not refused


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
