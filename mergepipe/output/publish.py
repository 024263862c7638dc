"""Atomic publication of an output folder.

Files are written into a temp folder beside the target, fsynced, then renamed
into place, so a reader (or a crash) sees either the previous complete folder or
the new one, never a partial one. A lock file beside the target stops a second
writer; a lock or temp folder left by a dead process is detected and removed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from mergepipe.errors import OutputError

_RENAME_EXCHANGE = 2
_EMPTY_LOCK_GRACE_S = 10  # a live writer fills its lock within microseconds of creating it
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(path: Path) -> tuple[str, int] | None:
    try:
        host, pid = path.read_text().strip().rsplit(":", 1)
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _stale(path: Path) -> bool:
    owner = _owner(path)
    if owner is None:  # empty: its writer died between creating the lock and writing its pid
        try:
            return time.time() - path.stat().st_mtime > _EMPTY_LOCK_GRACE_S
        except OSError:
            return False
    return owner is not None and owner[0] == socket.gethostname() and not _pid_alive(owner[1])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _remove_leftovers(target: Path) -> list[Path]:
    """Remove temp/old folders beside `target`; only called while holding its lock,
    so anything found belongs to a writer that died."""
    removed = []
    for p in target.parent.glob(f".{target.name}.*"):
        if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


class Publisher:
    """with Publisher(target) as tmp: write into tmp; then .commit() renames it in.

    Leaving the block without commit (an exception) removes the temp folder and
    leaves the target untouched.
    """

    def __init__(self, target: str | Path) -> None:
        self.target = Path(target).absolute()
        self.lock = self.target.parent / f".{self.target.name}.lock"
        self.tmp = self.target.parent / f".{self.target.name}.tmp-{uuid.uuid4().hex[:12]}"
        self._committed = False

    def __enter__(self) -> Path:
        if self.target.exists() and not self.target.is_dir():
            raise OutputError(f"{self.target}: output path exists and is not a folder")
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in the way, permissions
            raise OutputError(f"{self.target}: cannot create its parent folder: {e.strerror}") from None
        me = f"{socket.gethostname()}:{os.getpid()}"
        for attempt in range(2):
            try:
                fd = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                if attempt == 0 and _stale(self.lock):
                    self.lock.unlink(missing_ok=True)  # its writer died (kill -9)
                    continue
                owner = _owner(self.lock) or ("?", "?")
                raise OutputError(f"{self.target}: locked by another mergepipe writer "
                                  f"({owner[0]}:{owner[1]}, lock {self.lock}); wait for it, or remove the "
                                  "lock if that process is gone") from None
            except OSError as e:  # read-only folder, ...
                raise OutputError(f"{self.target}: cannot create the lock {self.lock}: {e.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(me)
        self.stale_removed = _remove_leftovers(self.target)
        self.tmp.mkdir()
        return self.tmp

    def commit(self) -> None:
        for p in self.tmp.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(self.tmp)
        if self.target.exists():
            if not _exchange(self.tmp, self.target):
                old = self.target.parent / f".{self.target.name}.old-{uuid.uuid4().hex[:12]}"
                os.rename(self.target, old)
                os.rename(self.tmp, self.target)
                self.tmp = old
            shutil.rmtree(self.tmp, ignore_errors=True)  # the previous version
        else:
            os.rename(self.tmp, self.target)
        _fsync_dir(self.target.parent)
        self._committed = True

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.lock.unlink(missing_ok=True)
        err = exc[0] if exc else None
        if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:  # aux files, manifest, fsync: one clean line
            raise OutputError(f"{self.target}: not published: writing {err.filename or 'the output'} failed: "
                              f"{err.strerror}") from None
