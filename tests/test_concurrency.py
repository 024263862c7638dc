"""Concurrent runs (issue 5): two writers of one target are serialized by the lock or
the second fails with one clear line; never an interleaved or partial output. Two
runs of one plan to different targets share the cache and store without tripping."""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from mergepipe.cli import main
from mergepipe.commands.uptodate import RECORD
from mergepipe.errors import OutputError
from mergepipe.output.manifest import load_manifest
from mergepipe.output.publish import Publisher
from mergepipe.output.run_record import record_path
from tests.corpus.procs import Warm, leftovers, params, published


def _race(argvs: list[list[str]], offset: float) -> list[tuple[int, str]]:
    procs = [Warm(a) for a in argvs]
    try:
        procs[0].go()
        time.sleep(offset)
        for p in procs[1:]:
            p.go()
        return [p.wait()[:2] for p in procs]
    finally:
        for p in procs:
            p.close()


def test_two_runs_to_one_target(small_family, tmp_path):
    cache, target = small_family["cache"], tmp_path / "pub" / "out"
    a = params(tmp_path / "A.yaml", small_family, target, cache)
    b = params(tmp_path / "B.yaml", small_family, target, cache, budget="40%")
    plans = {}
    for name, cfg in (("A", a), ("B", b)):  # the plan hash of each config
        assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / f"{name}.json")]) == 0
        plans[name] = json.loads((tmp_path / f"{name}.json").read_text())["plan_hash"]
    rng = random.Random(3)
    outcomes = []
    for round_ in range(2):
        shutil.rmtree(cache / "merges", ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        order = [("A", a), ("B", b)] if round_ % 2 == 0 else [("B", b), ("A", a)]
        results = _race([["run", str(cfg), "-q"] for _, cfg in order], rng.uniform(0, 0.3))
        ok = {name for (name, _), (rc, _) in zip(order, results) if rc == 0}
        for (name, _), (rc, err) in zip(order, results):
            assert rc in (0, 7), err
            if rc == 7:
                assert err.count("\n") == 1 and "locked by another mergepipe writer" in err, err
        assert ok, results
        assert published(target) in {plans[n] for n in ok}  # complete, verified, one writer's output
        assert leftovers(target) == []
        outcomes.append(len(ok))
    print(f"\n[concurrency] rounds: {outcomes} (1: second writer refused, 2: serialized)")


def test_one_plan_to_two_targets_shares_the_store(small_family, tmp_path):
    """Same plan, same cache, different targets, at the same time: both publish the same bytes."""
    cache = small_family["cache"]
    cfg = params(tmp_path / "p.yaml", small_family, tmp_path / "out1", cache, budget="60%")
    shutil.rmtree(cache / "merges", ignore_errors=True)
    results = _race([["run", str(cfg), "-q", "-o", str(tmp_path / d)] for d in ("out1", "out2")], 0.0)
    assert [rc for rc, _ in results] == [0, 0], results
    m1, m2 = (load_manifest(tmp_path / d) for d in ("out1", "out2"))
    assert published(tmp_path / "out1") == published(tmp_path / "out2")
    assert m1["outputs"] == m2["outputs"]
    assert not [p for p in (cache / "merges").iterdir() if "partial" in p.name]


def test_store_saves_and_restores_race_safely(tmp_path):
    """Two runs of one plan saving to and restoring from the store at once (threads, many times):
    no exception, and the entry left is complete."""
    from mergepipe.output.manifest import MANIFEST, MANIFEST_SCHEMA, dumps, manifest_hash, verify_outputs
    from mergepipe.index.cache import STORE_MAC, CacheLayout
    from mergepipe.output import merge_store
    from blake3 import blake3
    files = {f"f{j}": {"blake3": blake3(bytes([j]) * 1000).hexdigest()} for j in range(8)}
    man = {"schema": MANIFEST_SCHEMA, "plan_hash": "plan", "plan": {"plan_hash": "plan"},
           "outputs": {"tensors": {}, "files": files}}
    man["manifest_hash"] = manifest_hash(man)
    outs = []
    for i in range(2):
        out = tmp_path / f"tmp{i}"
        out.mkdir()
        for j in range(8):
            (out / f"f{j}").write_bytes(bytes([j]) * 1000)
        (out / MANIFEST).write_bytes(dumps(man))
        outs.append(out)
    restored = []
    cached = tmp_path / "merges" / "plan"
    errors = []

    def save(out):
        for _ in range(150):
            try:
                merge_store.save(CacheLayout(tmp_path), "plan", out)
            except Exception as e:  # noqa: BLE001 - any exception is the failure this test looks for
                errors.append(repr(e))

    def restore():
        for k in range(150):
            scratch = tmp_path / f"r{k}"
            scratch.mkdir()
            try:
                if merge_store.restore(CacheLayout(tmp_path), {"plan_hash": "plan"}, scratch):
                    verify_outputs(scratch)
                    restored.append(k)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
            shutil.rmtree(scratch)

    threads = [threading.Thread(target=save, args=(o,)) for o in outs] + [threading.Thread(target=restore)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert restored  # some restores found a complete entry
    assert sorted(p.name for p in cached.parent.iterdir()) == ["plan"]
    assert sorted(p.name for p in cached.iterdir()) == sorted([f"f{j}" for j in range(8)] + [MANIFEST, STORE_MAC])


def test_lock_owned_by_a_live_process_is_respected(tmp_path):
    target = tmp_path / "out"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".out.lock").write_text(f"{socket.gethostname()}:{sleeper.pid}")
        with pytest.raises(OutputError,
                           match=f"locked by another mergepipe writer, .*:{sleeper.pid} "
                                 "\\(this host\\), still running"):
            with Publisher(target):
                pass
        assert (tmp_path / ".out.lock").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    pub = Publisher(target)  # its owner is gone now: stale, removed
    with pub as tmp:
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_empty_lock_from_a_writer_killed_before_writing_its_pid(tmp_path):
    """kill -9 between creating the lock and writing the owner leaves an empty lock: once it is
    older than a few seconds no live writer can own it, so it is stale; a fresh one is respected."""
    target = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    lock.write_text("")
    with pytest.raises(OutputError, match="locked"):
        with Publisher(target):
            pass
    old = time.time() - 3600
    os.utime(lock, (old, old))
    pub = Publisher(target)
    with pub as tmp:
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_lock_from_another_host_says_exactly_what_to_do(tmp_path):
    """A lock whose writer ran on another host (a shared cluster folder) cannot be checked from
    here, so it is never removed automatically: the one-line error names the host, the pid
    and the lock file, and gives the command that removes it; after that the writer proceeds."""
    target = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    lock.write_text("node-417.cluster:31337")
    with pytest.raises(OutputError) as e:
        with Publisher(target):
            pass
    msg = str(e.value)
    assert "\n" not in msg and "node-417.cluster" in msg and "31337" in msg and str(lock) in msg
    assert f"rm {lock}" in msg
    assert lock.exists() and not target.exists()
    lock.unlink()  # what the message says to do
    pub = Publisher(target)
    with pub as tmp:
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_up_to_date_run_cleans_what_a_writer_killed_after_its_commit_left(small_family, tmp_path):
    """kill -9 after the rename but before the lock and the previous version were removed: the
    target is complete and up to date, so the rerun publishes nothing, yet it still removes the
    dead writer's lock and folder (both up-to-date checks); a live writer's are never touched."""
    cache, target = small_family["cache"], tmp_path / "pub" / "out"
    cfg = params(tmp_path / "A.yaml", small_family, target, cache)
    assert main(["run", str(cfg), "-q"]) == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for drop_record in (False, True):  # the fast check by the run record, then the full check
        if drop_record:  # the run record without its make-style record: the full check decides
            info = json.loads(record_path(target).read_text())
            info.pop(RECORD, None)
            record_path(target).write_text(json.dumps(info))
        (tmp_path / "pub" / ".out.lock").write_text(f"{socket.gethostname()}:{dead.pid}")
        (tmp_path / "pub" / ".out.tmp-0123456789ab").mkdir()
        (tmp_path / "pub" / ".out.tmp-0123456789ab" / "model.safetensors").write_bytes(b"x")
        (tmp_path / "pub" / ".out.v2.tmp-0123456789ab").mkdir(exist_ok=True)  # another target's: not ours
        assert main(["run", str(cfg), "-q"]) == 0
        assert leftovers(target) == [".out.v2.tmp-0123456789ab"]  # (leftovers() matches by prefix)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "pub" / ".out.lock").write_text(f"{socket.gethostname()}:{sleeper.pid}")
        (tmp_path / "pub" / ".out.tmp-0123456789ab").mkdir()
        assert main(["run", str(cfg), "-q"]) == 0
        assert leftovers(target) == [".out.lock", ".out.tmp-0123456789ab", ".out.v2.tmp-0123456789ab"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_names_its_owner_from_the_moment_it_exists(tmp_path):
    """The lock is a symbolic link created with its owner as target (one system call), so a
    writer killed at any moment leaves a lock that names a dead pid, removed by the next run
    at once, never an empty one that blocks it (the CI flake of kill -9 between create and write)."""
    target = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    pub = Publisher(target)
    with pub:
        assert lock.is_symlink() and os.readlink(lock) == f"{socket.gethostname()}:{os.getpid()}"
        with pytest.raises(OutputError, match=f":{os.getpid()} \\(this host\\), still running"):
            with Publisher(target):
                pass
    assert not os.path.lexists(lock)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.symlink(f"{socket.gethostname()}:{dead.pid}", lock)  # what kill -9 of a writer leaves
    pub = Publisher(target)
    with pub as tmp:
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_folder_without_symlinks_gets_a_file_lock(tmp_path, monkeypatch):
    """Where symlink() is refused (FAT, some FUSE), the lock is an exclusive file naming its owner."""
    import errno
    from mergepipe.output import publish

    def refuse(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(publish.os, "symlink", refuse)
    target, lock = tmp_path / "out", tmp_path / ".out.lock"
    pub = Publisher(target)
    with pub as tmp:
        assert not lock.is_symlink() and lock.read_text() == f"{socket.gethostname()}:{os.getpid()}"
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
