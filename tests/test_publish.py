import os
import signal
import subprocess
import sys
import time

import pytest

from mergepipe.errors import OutputError
from mergepipe.output.publish import Publisher, Terminated, check_output_path, terminate_unwinds


def test_publish_replaces_atomically(tmp_path):
    target = tmp_path / "out"
    for version in ("one", "two"):
        pub = Publisher(target, force=True)
        with pub as tmp:
            (tmp / "f").write_text(version)
            pub.commit()
        assert (target / "f").read_text() == version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_before_commit_leaves_target_untouched(tmp_path):
    target = tmp_path / "out"
    pub = Publisher(target, force=True)
    with pub as tmp:
        (tmp / "f").write_text("good")
        pub.commit()
    with pytest.raises(RuntimeError):
        with Publisher(target, force=True) as tmp:
            (tmp / "f").write_text("half")
            raise RuntimeError("crash")
    assert (target / "f").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_lock_blocks_second_writer_and_stale_lock_is_cleaned(tmp_path):
    target = tmp_path / "out"
    with Publisher(target):
        with pytest.raises(OutputError, match="locked"):
            with Publisher(target):
                pass
    # a writer killed with -9 leaves its lock and temp folder behind
    code = ("import os; from mergepipe.output.publish import Publisher; p = Publisher(%r); t = p.__enter__(); "
            "(t / 'x').write_text('partial'); os._exit(0)") % str(target)
    subprocess.run([sys.executable, "-c", code], check=True)
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())
    pub = Publisher(target, force=True)
    with pub as tmp:
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        with Publisher(tmp_path / "out"):
            pass


# ------------------------------------------------------------------ issue 15: what may be replaced

def _publish(target, content="x", **kw):
    pub = Publisher(target, **kw)
    with pub as tmp:
        (tmp / "f").write_text(content)
        pub.commit()


def test_a_folder_mergepipe_did_not_write_is_refused_unless_forced(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.txt").write_text("precious")
    with pytest.raises(OutputError, match="did not write.*--force"):
        _publish(mine)
    assert (mine / "data.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no lock or temp left
    _publish(mine, force=True)
    assert sorted(p.name for p in mine.iterdir()) == ["f"]


def test_an_empty_folder_is_replaced(tmp_path):
    (tmp_path / "out").mkdir()
    _publish(tmp_path / "out")
    assert (tmp_path / "out" / "f").read_text() == "x"


@pytest.mark.parametrize("path", ["", ".", "..", "/", "~", "CWD", "CWD/.."])
def test_root_like_paths_are_refused_even_with_force(path, tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    target = {"~": os.path.expanduser("~"), "CWD": str(work), "CWD/..": str(work.parent)}.get(path, path)
    with pytest.raises(OutputError):
        Publisher(target, force=True)
    with pytest.raises(OutputError):
        check_output_path(target)
    assert sorted(p.name for p in work.iterdir()) == []


def test_symlinked_output_paths_are_refused(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputError, match="dangling symbolic link"):
        _publish(tmp_path / "dangling")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OutputError, match="symbolic link"):
        _publish(tmp_path / "link", force=True)
    assert not (tmp_path / "nowhere").exists() and list((tmp_path / "real").iterdir()) == []


def test_cleanup_never_touches_another_targets_temp_folder(tmp_path):
    """d/m and d/m.v2 at once: m's leftover cleanup (run under m's lock) must not match m.v2's live temp."""
    other = Publisher(tmp_path / "m.v2", force=True)
    live = other.__enter__()
    (live / "w").write_text("writing")
    try:
        # a dead writer of m left a temp folder: that one is removed
        dead = tmp_path / f".m.tmp-{'a' * 12}"
        dead.mkdir()
        _publish(tmp_path / "m")
        assert not dead.exists()
        assert live.is_dir() and (live / "w").read_text() == "writing"
        other.commit()
    finally:
        other.__exit__(None, None, None)
    assert (tmp_path / "m.v2" / "w").read_text() == "writing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.v2"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signals_clean_up_like_ctrl_c(sig, tmp_path):
    """A signal while writing: the temp folder and the lock are removed, the target untouched."""
    target = tmp_path / "out"
    _publish(target, "old", force=True)
    code = (f"import os, signal, time; from mergepipe.output.publish import Publisher\n"
            f"p = Publisher({str(target)!r}, force=True)\n"
            f"with p as t:\n"
            f"    (t / 'f').write_text('new')\n"
            f"    os.kill(os.getpid(), {int(sig)})\n"
            f"    time.sleep(30)\n")
    t0 = time.monotonic()
    # the default disposition, as from a terminal: a suite run under nohup or in the background
    # passes an ignored SIGHUP or SIGINT on, and an ignored signal is respected on purpose
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    assert time.monotonic() - t0 < 20
    assert proc.returncode != 0
    assert (target / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], proc.stderr


def test_terminate_unwinds_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with terminate_unwinds():
        assert signal.getsignal(signal.SIGTERM) is not before
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_output_whose_manifest_a_build_tool_removed_is_replaced(tmp_path):
    """Snakemake deletes a job's declared outputs (weights, manifest) before rerunning it: the
    rest of our output (card, config; an earlier version's run.json) is still recognised; a
    user's look-alike is not."""
    out = tmp_path / "merged"
    out.mkdir()
    (out / "run.json").write_text('{"host": "h", "seconds": 1.0}')
    (out / "README.md").write_text("---\ntags: [merge, mergepipe]\n---\n\n# Merged with mergepipe (ties)\n")
    (out / "config.json").write_text("{}")
    _publish(out)
    assert sorted(p.name for p in out.iterdir()) == ["f"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "run.json").write_text('{"distance_km": 10}')  # not our run record
    (mine / "README.md").write_text("my notes")
    with pytest.raises(OutputError, match="did not write"):
        _publish(mine)
    (mine / "run.json").write_text('{"host": "h"}')  # a run record is no evidence: the card is
    with pytest.raises(OutputError, match="did not write"):
        _publish(mine)
    (mine / "README.md").write_text("# Merged with mergepipe (ties)\n")  # our card, but:
    (mine / "thesis.tex").write_text("x")  # not a kind of file an output holds
    with pytest.raises(OutputError, match="did not write"):
        _publish(mine)
    assert (mine / "thesis.tex").exists()


def test_an_output_dvc_restored_without_its_run_record_is_recognised_by_its_card(tmp_path):
    """.dvcignore leaves run.json out, so an output DVC restored has none; after Snakemake
    deletes its weights and manifest, our model card still says whose it is."""
    out = tmp_path / "merged"
    out.mkdir()
    (out / "README.md").write_text("---\ntags: [merge, mergepipe]\n---\n\n# Merged with mergepipe (ties)\n")
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    _publish(out)
    assert sorted(p.name for p in out.iterdir()) == ["f"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("# My model\n\nMerged with mergepipe, then fine-tuned.\n")
    (mine / "config.json").write_text("{}")
    with pytest.raises(OutputError, match="did not write"):
        _publish(mine)
    assert (mine / "README.md").exists()


def test_files_added_to_the_target_during_the_merge_are_not_deleted(tmp_path):
    target = tmp_path / "out"
    target.mkdir()  # empty at the start: replaceable
    pub = Publisher(target)
    with pytest.raises(OutputError, match="did not write"):
        with pub as tmp:
            (tmp / "f").write_text("new")
            (target / "copied-in.txt").write_text("the user's")  # while the merge runs
            pub.commit()
    assert (target / "copied-in.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_publish_killed_between_its_renames_keeps_the_previous_output(tmp_path, monkeypatch):
    """Without renameat2's exchange (NFS, Lustre), commit renames the previous version away and
    then the new one in. A kill between the two used to leave only `.out.old-*`, which the next
    run removed as a leftover: the previous output was lost even if that run then failed."""
    from mergepipe.output import publish
    from mergepipe.output.publish import Publisher
    target = tmp_path / "out"
    pub = Publisher(target)
    with pub as tmp:
        (tmp / "model.safetensors").write_bytes(b"version 1")
        pub.commit()
    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    real_rename = publish.os.rename

    def killed_after_first(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
            raise KeyboardInterrupt("killed between the renames")

    monkeypatch.setattr(publish.os, "rename", killed_after_first)
    pub = Publisher(target, force=True)  # (these folders hold no manifest: ownership is not what is tested)
    with pytest.raises(KeyboardInterrupt):
        with pub as tmp:
            (tmp / "model.safetensors").write_bytes(b"version 2")
            pub.commit()
    monkeypatch.setattr(publish.os, "rename", real_rename)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()][0].startswith(".out.old-")
    with pytest.raises(RuntimeError):  # the next run fails before publishing: version 1 is back anyway
        with Publisher(target, force=True):
            raise RuntimeError("the next merge fails")
    assert (target / "model.safetensors").read_bytes() == b"version 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
