"""Buffered writes (MERGEPIPE_DIRECT_WRITES=0, and file systems with reflinks): the base runs
a merge keeps are copied on the copier's thread (engine/copies.py), apart from the merging
thread: the bytes are the same, every run is copied, and a failed copy stops the merge with
one line and nothing published."""
from __future__ import annotations

import errno
import threading

import pytest

from mergepipe.cli import main
from mergepipe.engine.copies import BackgroundCopies
from mergepipe.util.progress import Progress
from tests.helpers import write_config


def _energy_config(tmp_path, family, out: str = "out"):
    # strategy energy: whole blocks or nothing, so a 10% plan leaves most blocks to copy; a
    # store of its own, so that a second output is merged again, not restored
    return write_config(tmp_path, family, budget="10%", plan={"strategy": "energy"},
                        output={"dir": str(tmp_path / out)}, cache_dir=str(tmp_path / f"cache-{out}"))


def test_copied_runs_go_to_the_copier_thread_and_give_the_same_bytes(tiny_family, tmp_path, monkeypatch):
    import mergepipe.util.fs as fs
    monkeypatch.setenv("MERGEPIPE_DIRECT_WRITES", "0")
    seen: list[str] = []
    copy_range = fs.copy_range

    def recording(*args, **kw):
        seen.append(threading.current_thread().name)
        return copy_range(*args, **kw)

    cfg = _energy_config(tmp_path, tiny_family)
    assert main(["run", str(cfg), "-q"]) == 0
    monkeypatch.setattr(fs, "copy_range", recording)
    assert main(["run", str(_energy_config(tmp_path, tiny_family, "out2")), "-q"]) == 0
    assert seen and all(name.startswith("mergepipe-copy") for name in seen)
    weights = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert weights
    for name in weights:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()
    assert main(["verify", str(tmp_path / "out2"), "--deep", "-q"]) == 0


def test_a_failed_copy_stops_the_merge_with_one_line_and_nothing_published(tiny_family, tmp_path, monkeypatch,
                                                                           capsys):
    import mergepipe.util.fs as fs
    monkeypatch.setenv("MERGEPIPE_DIRECT_WRITES", "0")
    calls = [0]
    copy_range = fs.copy_range

    def full_disk(*args, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return copy_range(*args, **kw)

    monkeypatch.setattr(fs, "copy_range", full_disk)
    cfg = _energy_config(tmp_path, tiny_family)
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and "copy of tensor" in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp folder or lock left
    monkeypatch.setattr(fs, "copy_range", copy_range)
    assert main(["run", str(cfg), "-q"]) == 0


def test_background_copies_total_in_order_and_raise_the_first_failure():
    copies = BackgroundCopies(Progress(100, "copying", False))
    for n in (3, 4, 5):
        copies.submit(lambda n: (n, n - 1), n)
    copies.finish()
    assert (copies.bytes, copies.kernel_bytes) == (12, 9)

    def fail(msg):
        raise OSError(errno.EIO, msg)
    copies = BackgroundCopies(Progress(100, "copying", False))
    copies.submit(lambda: (1, 1))
    copies.submit(fail, "first")
    copies.submit(fail, "second")
    with pytest.raises(OSError, match="first"):
        copies.finish()


def test_cancel_waits_for_the_running_copy_and_drops_the_rest():
    started, release, ran = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(5)
        ran.append("slow")
        return 1, 0

    copies = BackgroundCopies(Progress(100, "copying", False))
    copies.submit(slow)
    copies.submit(lambda: ran.append("never") or (1, 0))
    started.wait(5)
    threading.Timer(0.2, release.set).start()
    copies.cancel()  # returns only once the running copy is done: its fds may close after it
    assert ran == ["slow"]
