"""A cache that cannot take a write (disk full, quota, file size limit, read-only): every cache
writer of the index layer (model and delta indexes, stat entries, sketches) fails with the one
exit-7 line naming the entry, at whichever step the OSError comes (creating the temp file, a
write, the fsync, the rename), and leaves no temp or partial file; the next run succeeds."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.errors import OutputError
from mergepipe.index import sketch
from mergepipe.index.store import Store
from tests.helpers import write_config

ERRNOS = {"ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT, "EFBIG": errno.EFBIG, "EROFS": errno.EROFS}
STEPS = ("create", "first-write", "later-write", "fsync", "rename")


def _under(path, folder: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(folder.resolve())


def _fd_under(fd: int, folder: Path) -> bool:
    try:
        return _under(os.readlink(f"/proc/self/fd/{fd}"), folder)
    except OSError:
        return False


def inject(monkeypatch, folder: Path, step: str, code: int) -> None:
    """Make `step` fail with `code` for files under `folder` (everything else untouched)."""
    def fail():
        raise OSError(code, os.strerror(code))

    if step == "create":
        real_mkstemp = tempfile.mkstemp
        monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: fail() if _under(
            k.get("dir") or (a[2] if len(a) > 2 else "."), folder) else real_mkstemp(*a, **k))
    elif step in ("first-write", "later-write"):
        real_write, seen = os.write, [0]

        def write(fd, data):
            if _fd_under(fd, folder):
                seen[0] += 1
                if step == "first-write" or seen[0] > 1:
                    fail()
                return real_write(fd, data[:max(1, len(data) // 2)])  # a short write: the loop goes on
            return real_write(fd, data)
        monkeypatch.setattr(os, "write", write)
    elif step == "fsync":
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: fail() if _fd_under(fd, folder) else real_fsync(fd))
    else:
        real_replace = os.replace
        monkeypatch.setattr(os, "replace", lambda a, b, **k: fail() if _under(b, folder) else real_replace(a, b, **k))


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def _check(err: OutputError, code: int, folder: Path) -> None:
    message = str(err)
    assert err.exit_code == 7 and "\n" not in message
    assert "cannot write to the cache" in message and os.strerror(code) in message
    assert str(folder) in message


@pytest.fixture()
def indexed(tiny_family, tmp_path):
    """A store with the base and expert_0 indexed (the sketch writer's inputs)."""
    root = Path(tiny_family["root"])
    store = Store(tmp_path / "cache")
    base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
    expert, index, delta = store.expert_index(root / "expert_0", base, base_index)
    return store, (base, base_index, expert, index, delta)


@pytest.mark.parametrize("code", list(ERRNOS.values()), ids=list(ERRNOS))
@pytest.mark.parametrize("step", STEPS)
def test_sketch_writer_fails_in_one_line_and_leaves_nothing(indexed, monkeypatch, step, code):
    store, (base, base_index, expert, index, delta) = indexed
    path = sketch.cache_path(store.root, index.content_hash, base_index.content_hash, base_index.layout.key)
    if step == "later-write":
        monkeypatch.setattr(sketch._TempFile, "BUFFER_BYTES", 1)  # one write per block: fail mid-file
    inject(monkeypatch, path.parent, step, code)
    with pytest.raises(OutputError) as got:
        sketch.build(path, base, base_index, expert, index, delta)
    _check(got.value, code, path.parent)
    assert _files(path.parent) == []
    monkeypatch.undo()
    sketch.build(path, base, base_index, expert, index, delta)
    sketch.Sketch(path, expert=index.content_hash, base=base_index.content_hash, base_index=base_index)
    assert _files(path.parent) == [path.name]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["ENOSPC", "EROFS"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("entry", ["models", "stat", "deltas"])
def test_index_writers_fail_in_one_line_and_leave_no_temp(tiny_family, tmp_path, monkeypatch, entry, step, code):
    root = Path(tiny_family["root"])
    store = Store(tmp_path / "cache")
    folder = store.root / entry
    if entry == "deltas":  # the base indexed first: only the expert's delta entry fails
        base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
    inject(monkeypatch, folder, step, code)
    with pytest.raises(OutputError) as got:
        if entry == "deltas":
            store.expert_index(root / "expert_0", base, base_index)
        else:
            store.model_index(root / "base", block_bytes=16 << 10)
    _check(got.value, code, folder)
    assert not [f for f in _files(folder) if ".tmp" in f]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["ENOSPC", "EROFS"])
def test_run_with_a_full_sketch_folder_exits_7_in_one_line(tiny_family, tmp_path, monkeypatch, capsys, code):
    """The reported case: `mergepipe run` of a sketch plan on a cache that fills while the sketch
    is written (a write in _write_done): exit 7, one line, nothing published, no sketch left."""
    params = write_config(tmp_path, tiny_family, budget="25%", plan={"strategy": "sketch"})
    inject(monkeypatch, tmp_path / "cache" / "sketch", "later-write", code)
    monkeypatch.setattr(sketch._TempFile, "BUFFER_BYTES", 1)
    assert main(["run", str(params), "-q"]) == 7
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot write to the cache" in err and os.strerror(code) in err, err
    assert not (tmp_path / "out").exists()
    assert _files(tmp_path / "cache" / "sketch") == []
    monkeypatch.undo()
    assert main(["run", str(params), "-q"]) == 0
    assert main(["verify", str(tmp_path / "out")]) == 0
