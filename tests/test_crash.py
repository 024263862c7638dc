"""Crashes and faults (issue 5): kill -9 at random moments, disk full, write errors.

The promise: whatever happens to a `mergepipe run`, the target folder holds the
previous complete merge or nothing (or, killed after the rename, the new complete
merge), `mergepipe verify` passes on it, a rerun produces the same hashes as an
uninterrupted run, and what a dead run left (temp folder, lock) is cleaned.
"""
from __future__ import annotations

import json
import random
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.output.manifest import load_manifest
from tests.corpus.procs import REPO, Warm, leftovers, params, published

N_KILLS = 20


class Pool:
    """One warm process per config, replaced as soon as it is used."""

    def __init__(self, argvs: dict[str, list[str]]) -> None:
        self.argvs = argvs
        self.warm = {name: Warm(argv) for name, argv in argvs.items()}

    def take(self, name: str) -> Warm:
        w, self.warm[name] = self.warm[name], Warm(self.argvs[name])
        return w

    def close(self) -> None:
        for w in self.warm.values():
            w.close()


# Long: one scenario (configs, kill loop, recovery checks) whose steps share the state it kills.
@pytest.mark.slow
def test_kill_9_at_random_moments(small_family, tmp_path, capsys):  # noqa: PLR0915
    cache, pub = small_family["cache"], tmp_path / "pub"
    pub.mkdir()
    target = pub / "out"
    cfgs = {"A": params(tmp_path / "A.yaml", small_family, target, cache),
            "B": params(tmp_path / "B.yaml", small_family, target, cache, budget="40%")}
    ref, seconds = {}, {}
    for name, cfg in cfgs.items():  # uninterrupted runs, merged (not restored), in their own folders
        shutil.rmtree(cache / "merges", ignore_errors=True)
        w = Warm(["run", str(cfg), "-q", "-o", str(tmp_path / f"ref-{name}")])
        w.go()
        rc, err, seconds[name] = w.wait()
        assert rc == 0, err
        man = load_manifest(tmp_path / f"ref-{name}")
        ref[name] = (man["plan_hash"], man["outputs"])
    outputs = {plan: outs for plan, outs in ref.values()}
    assert len(outputs) == 2

    rng = random.Random(20240605)
    pool = Pool({name: ["run", str(cfg), "-q"] for name, cfg in cfgs.items()})
    stats: Counter = Counter()
    state, kills = None, 0  # plan hash published at target
    try:
        while kills < N_KILLS:
            if kills in (7, 14) and state is not None:  # start from nothing again now and then
                shutil.rmtree(target)
                state = None
            name = rng.choice("AB") if state is None else ("B" if state == ref["A"][0] else "A")
            if rng.random() < 0.8:
                shutil.rmtree(cache / "merges", ignore_errors=True)  # merge, not restore from the store
            else:
                stats["store_restore_runs"] += 1
            w = pool.take(name)
            w.go()
            delay = rng.uniform(0, seconds[name])
            time.sleep(max(0.0, delay - (time.monotonic() - w.t0)))
            w.kill()
            rc, err, _ = w.wait()
            if rc != -signal.SIGKILL:  # it finished first
                assert rc == 0, err
                state = published(target)
                assert state == ref[name][0]
                stats["finished_before_kill"] += 1
                continue
            kills += 1
            now = published(target)
            assert now in (state, ref[name][0]), "target is neither the previous merge nor the new one"
            stats["killed_after_publish" if now != state else "killed_before_publish"] += 1
            state = now
            if state is not None:
                assert load_manifest(target)["outputs"] == outputs[state]
                assert main(["verify", str(target), "-q"]) == 0
            stats["left_temp_or_lock"] += bool(leftovers(target))
            if kills % 4 == 0:  # rerun to completion: same hashes, leftovers cleaned
                w = pool.take(name)
                w.go()
                rc, err, _ = w.wait()
                assert rc == 0, err
                state = published(target)
                assert state == ref[name][0]
                assert load_manifest(target)["outputs"] == ref[name][1]
                assert leftovers(target) == []
                stats["completed_reruns"] += 1
    finally:
        pool.close()
    assert stats["completed_reruns"] >= 5
    with capsys.disabled():
        print(f"\n[crash] {kills} kills -9: {dict(sorted(stats.items()))}")


def test_kill_9_during_indexing(tiny_family, tmp_path):
    """Kills while a cold cache is being filled: the next run still gives the reference hashes."""
    root = Path(tiny_family["root"])
    family = {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}
    cfg_ref = params(tmp_path / "ref.yaml", family, tmp_path / "ref", tmp_path / "cache-ref")
    w = Warm(["run", str(cfg_ref), "-q"])
    w.go()
    rc, err, cold = w.wait()
    assert rc == 0, err
    want, want_plan = load_manifest(tmp_path / "ref")["outputs"], load_manifest(tmp_path / "ref")["plan_hash"]
    cfg = params(tmp_path / "p.yaml", family, tmp_path / "pub" / "out", tmp_path / "cache")
    rng = random.Random(7)
    nxt = Warm(["run", str(cfg), "-q"])
    try:
        for _ in range(5):
            w, nxt = nxt, Warm(["run", str(cfg), "-q"])
            w.go()
            time.sleep(rng.uniform(0, cold))
            w.kill()
            w.wait()
            assert published(tmp_path / "pub" / "out") in (None, want_plan)
        nxt.go()
        rc, err, _ = nxt.wait()
    finally:
        nxt.close()
    assert rc == 0, err
    assert load_manifest(tmp_path / "pub" / "out")["outputs"] == want
    assert leftovers(tmp_path / "pub" / "out") == []


# ------------------------------------------------------------------ disk full / write errors

def _fsize_limit(nbytes: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us; ignored: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return preexec


def _tiny(tiny_family) -> dict:
    root = Path(tiny_family["root"])
    return {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}


@pytest.mark.parametrize("existing", [False, True], ids=["absent", "existing"])
def test_file_size_limit_fails_cleanly(tiny_family, tiny_cache, tmp_path, existing):
    """RLIMIT_FSIZE below the output size: EFBIG -> one clean line, nothing published, temp removed."""
    target = tmp_path / "pub" / "out"
    cfg = params(tmp_path / "p.yaml", _tiny(tiny_family), target, tiny_cache)
    shutil.rmtree(tiny_cache / "merges", ignore_errors=True)  # write the merge, do not restore it
    if existing:
        assert main(["run", str(cfg), "-q", "--budget", "10%"]) == 0
        before = {p.name: p.read_bytes() for p in target.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "run", str(cfg), "-q"], cwd=REPO, capture_output=True,
                          text=True, preexec_fn=_fsize_limit(1 << 20), timeout=300)
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "File too large" in proc.stderr
    if existing:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    else:
        assert not target.exists()
    assert leftovers(target) == []


@pytest.mark.parametrize("limit", [2 << 10, 64 << 10])
def test_file_size_limit_on_a_cold_cache(tiny_family, tmp_path, limit):
    """The limit hits the index cache first: still one clean line, nothing published."""
    target = tmp_path / "pub" / "out"
    cfg = params(tmp_path / "p.yaml", _tiny(tiny_family), target, tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "run", str(cfg), "-q"], cwd=REPO, capture_output=True,
                          text=True, preexec_fn=_fsize_limit(limit), timeout=300)
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not target.exists() and leftovers(target) == []
    assert not [p for p in (tmp_path / "cache").rglob("*.tmp")], "a temp file was left in the cache"


_TMPFS_SCRIPT = textwrap.dedent("""\
    import json, os, subprocess, sys
    from mergepipe.cli import main
    cfg, pub, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    results = []
    for size in sizes:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", pub], check=True)
        try:
            rc = main(["run", cfg, "-q", "-o", os.path.join(pub, "out")])
            results.append({"size": size, "rc": rc, "left": sorted(os.listdir(pub))})
        finally:
            subprocess.run(["umount", pub], check=True)
    print(json.dumps(results))
""")


def test_disk_full_on_a_small_tmpfs(tiny_family, tiny_cache, tmp_path):
    """ENOSPC at several points of the write (weights, aux files, manifest) on a tiny tmpfs mounted in a
    private mount namespace: each a clean error, nothing left on the full disk."""
    if subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt && umount /mnt"],
                      capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m and mount (root or user namespaces)")
    pub = tmp_path / "pub"
    pub.mkdir()
    cfg = params(tmp_path / "p.yaml", _tiny(tiny_family), pub / "out", tiny_cache)
    assert main(["run", str(cfg), "-q", "-o", str(tmp_path / "full")]) == 0  # the real size
    size = sum(p.stat().st_size for p in (tmp_path / "full").iterdir())
    model = (tmp_path / "full" / "model.safetensors").stat().st_size
    sizes = [64 << 10, model // 2, model - 4096, model + 8192, size - 8192, size + (1 << 20)]
    shutil.rmtree(tiny_cache / "merges")  # merge every time, no restore from the store
    proc = subprocess.run(["unshare", "-m", sys.executable, "-c", _TMPFS_SCRIPT, str(cfg), str(pub), json.dumps(sizes)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    errors = [line for line in proc.stderr.splitlines() if line]
    *failing, ok = results
    assert ok["rc"] == 0 and ok["left"] == [".out.run.json", "out"]  # the output and its run record
    for r in failing:
        assert r["rc"] == 7 and r["left"] == [], r
    assert len(errors) == len(failing) and all(e.startswith("mergepipe: error: ") for e in errors), errors
    assert all("No space left on device" in e for e in errors), errors


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_during_a_merge_clean_up(sig, tiny_family, tiny_cache, tmp_path):
    """A batch scheduler's SIGTERM or a closed terminal's SIGHUP in the middle of the merge: exit
    128+signal, the previous output untouched, no temp folder or lock left (as for Ctrl-C)."""
    root = Path(tiny_family["root"])
    family = {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}
    target = tmp_path / "out"
    cfg = params(tmp_path / "p.yaml", family, target, tiny_cache, budget="full")
    assert main(["run", str(cfg), "-q"]) == 0
    before = load_manifest(target)["plan_hash"]
    cfg = params(tmp_path / "p.yaml", family, target, tiny_cache, budget="40%")
    marker = tmp_path / "merging"
    code = textwrap.dedent(f"""
        import sys, time
        import mergepipe.commands.pipeline as pipeline
        real = pipeline.run_merge
        def slow(plan, inputs, tmp, **kw):
            (tmp / "partial").write_text("x")
            open({str(marker)!r}, "w").close()
            time.sleep(60)
            return real(plan, inputs, tmp, **kw)
        pipeline.run_merge = slow
        shutil_cache = {str(tiny_cache / "merges")!r}
        import shutil; shutil.rmtree(shutil_cache, ignore_errors=True)
        from mergepipe.cli import main
        sys.exit(main(["run", {str(cfg)!r}, "-q"]))
    """)
    # as from a terminal: a suite run under nohup would pass its ignored SIGHUP on, and an
    # ignored hangup is respected on purpose (output/publish.py::terminate_unwinds)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no merge started"
    proc.send_signal(sig)
    rc = proc.wait(timeout=30)
    err = proc.stderr.read()
    assert rc == 128 + sig, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert published(target) == before
    assert leftovers(target) == []
