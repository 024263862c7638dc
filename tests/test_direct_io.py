"""Direct writes (checkpoint/direct_io.py): the output written in file order around the page
cache gives the same bytes and the same manifest as buffered writes, falls back where the
kernel refuses O_DIRECT, and reports a failed write with one line and nothing published."""
from __future__ import annotations

import errno
import json
import os
import random
import time

import pytest

import mergepipe.checkpoint.direct_io as dio
from mergepipe.checkpoint.direct_io import ALIGN, CHUNK, DirectAppender, direct_open
from mergepipe.checkpoint.safetensors import OutTensor, SafetensorsWriter
from mergepipe.cli import main
from mergepipe.util.fs import shares_extents
from tests.helpers import write_config


def _append_all(path, pieces: list[bytes]) -> bytes:
    fd = direct_open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        app = DirectAppender(fd)
        for p in pieces:
            app.append(p)
        app.close()
        os.ftruncate(fd, sum(map(len, pieces)))
    finally:
        os.close(fd)
    return path.read_bytes()


def test_appended_pieces_of_any_size_land_in_order(tmp_path):
    rng = random.Random(0)
    sizes = [0, 1, 7, ALIGN - 1, ALIGN, ALIGN + 1, CHUNK - 3, 5, CHUNK, 2 * CHUNK + 11, 12345]
    pieces = [rng.randbytes(n) for n in sizes]
    assert _append_all(tmp_path / "f", pieces) == b"".join(pieces)
    assert _append_all(tmp_path / "empty", []) == b""


def test_a_refused_direct_write_falls_back_to_buffered_with_the_same_bytes(tmp_path, monkeypatch):
    """A device with larger sectors, or a file system that opens O_DIRECT but refuses its
    writes, answers EINVAL: the fd drops O_DIRECT and the bytes are the same."""
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)
    monkeypatch.setattr(dio.os, "pwrite", pwrite)
    pieces = [random.Random(1).randbytes(3 * CHUNK // 2)]
    assert _append_all(tmp_path / "f", pieces) == pieces[0]
    if hasattr(os, "O_DIRECT") and not shares_extents(tmp_path):
        assert refused  # the first write was tried direct


def test_a_failed_write_is_raised_by_close(tmp_path):
    fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o644)  # writes fail: EBADF
    try:
        app = DirectAppender(fd)
        app.append(b"x" * (CHUNK + 1))
        with pytest.raises(OSError):
            app.close()
    finally:
        os.close(fd)


def test_a_direct_writer_refuses_bytes_out_of_order(tmp_path):
    w = SafetensorsWriter(tmp_path / "m.safetensors", [OutTensor("a", "BF16", (4, 4)), OutTensor("b", "BF16", (4,))],
                          direct=True)
    try:
        with pytest.raises(AssertionError, match="out of order"):
            w.write_rows("b", 0, bytes(8))
    finally:
        w.abort()


def _merge(tmp_path, family, name: str, direct: bool, monkeypatch, **overrides) -> dict:
    monkeypatch.setenv("MERGEPIPE_DIRECT_WRITES", "1" if direct else "0")
    cfg = write_config(tmp_path, family, output={"dir": str(tmp_path / name)}, cache_dir=str(tmp_path / f"c-{name}"),
                       **overrides)
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["verify", str(tmp_path / name), "--deep", "-q"]) == 0
    return json.loads((tmp_path / name / "manifest.json").read_text())


@pytest.mark.parametrize("overrides", [{"budget": "10%", "plan": {"strategy": "energy"}}, {"budget": "25%"},
                                       {"budget": "full", "method": "ties", "parameters": {"density": 0.5}}],
                         ids=["energy-10pct", "sketch-25pct", "ties-full"])
def test_direct_and_buffered_writes_give_the_same_files_and_manifest(tiny_family, tmp_path, monkeypatch, overrides):
    """The bytes, the tree hashes and the manifest's byte counters (base bytes copied included)
    are the same whichever way the output was written."""
    appended = []
    real = DirectAppender.append

    def spy(self, data):
        appended.append(len(memoryview(data).cast("B")))
        return real(self, data)
    monkeypatch.setattr(DirectAppender, "append", spy)
    buffered = _merge(tmp_path, tiny_family, "buf", False, monkeypatch, **overrides)
    assert not appended
    direct = _merge(tmp_path, tiny_family, "dio", True, monkeypatch, **overrides)
    if shares_extents(tmp_path):
        pytest.skip("this file system has reflinks: the engine keeps copy_file_range there")
    assert appended
    assert direct["bytes"] == buffered["bytes"] and direct["outputs"] == buffered["outputs"]
    for f in sorted((tmp_path / "buf").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "dio" / f.name).read_bytes()


def test_a_failed_direct_write_stops_the_merge_with_one_line_and_nothing_published(tiny_family, tmp_path,
                                                                                   monkeypatch, capsys):
    real = DirectAppender._write
    calls = [0]

    def full_disk(self, view, at):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, view, at)
    monkeypatch.setattr(DirectAppender, "_write", full_disk)
    monkeypatch.setenv("MERGEPIPE_DIRECT_WRITES", "1")
    cfg = write_config(tmp_path, tiny_family, budget="10%")
    capsys.readouterr()
    code = main(["run", str(cfg), "-q"])
    if shares_extents(tmp_path):
        pytest.skip("this file system has reflinks: the engine keeps copy_file_range there")
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and "safetensors" in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    monkeypatch.setattr(DirectAppender, "_write", real)
    assert main(["run", str(cfg), "-q"]) == 0


def test_a_direct_writer_frees_its_buffers_at_its_last_byte(tmp_path):
    """A sharded output is written one file after another: each file's buffers and writer
    thread go as soon as its last byte is appended, not when every file is closed at the end
    (three 8 MiB buffers per shard of a 70B model would add up)."""
    tensors = [OutTensor("a", "BF16", (4, 4)), OutTensor("b", "BF16", (4,))]
    w = SafetensorsWriter(tmp_path / "m.safetensors", tensors, direct=True)
    w.write_rows("a", 0, bytes(range(32)))
    assert w._appender is not None
    w.write_rows("b", 0, bytes(8))
    assert w._appender is None and w.direct
    w.close()
    data = (tmp_path / "m.safetensors").read_bytes()
    assert len(data) == w.size and data.endswith(bytes(range(32)) + bytes(8))


def test_close_after_a_failed_write_ends_the_writer_thread(tmp_path, monkeypatch):
    """An error found while the last chunk is handed over still ends the thread (it waited on
    its queue forever) and unmaps the buffers."""
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        app = DirectAppender(fd)
        monkeypatch.setattr(app, "_write", lambda view, at: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        app.append(b"x" * CHUNK)  # one chunk handed over: its write fails
        app.append(b"y" * 10)
        for _ in range(500):  # the writer thread has failed before close hands the tail over
            if app._error is not None:
                break
            time.sleep(0.01)
        with pytest.raises(OSError, match="I/O error"):
            app.close()
        assert not app._thread.is_alive()
    finally:
        os.close(fd)
