"""Atomic publication of an output folder.

Files are written into a temp folder beside the target, fsynced, then renamed
into place, so a reader (or a crash) sees either the previous complete folder or
the new one, never a partial one. A lock file beside the target stops a second
writer; a lock or temp folder left by a dead process is detected and removed.

Whether the target may be written or replaced (protected paths, a folder mergepipe did not
write, `force`) is output/safety.py's rule: the publisher asks it when it is created, again
under the lock, and again just before the swap. Temp and lock names are `.NAME.tmp-<12 hex>`,
`.NAME.old-<12 hex>` and `.NAME.lock`, matched exactly (never by a prefix glob),
so the writers of `m` and `m.v2` never touch each other's files. SIGTERM and
SIGHUP unwind like Ctrl-C, so the temp folder and the lock are removed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import shlex
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mergepipe.errors import OutputError
from mergepipe.output.safety import check_output_path, check_replace, replaceable

__all__ = ["Publisher", "Terminated", "check_output_path", "clean_dead_writer", "leftover_of", "replaceable",
           "terminate_unwinds"]  # check_output_path, replaceable: output/safety.py's, for publish's callers

_RENAME_EXCHANGE = 2
_EMPTY_LOCK_GRACE_S = 10  # a file lock (no-symlink folders) is filled microseconds after its creation
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
    try:  # a symbolic link whose target is the owner; a file holding it (older versions, no-symlink folders)
        text = os.readlink(path) if path.is_symlink() else path.read_text()
        host, pid = text.strip().rsplit(":", 1)
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _take_lock(lock: Path, me: str) -> None:
    """Create `lock` naming its owner `me` in one step, or raise FileExistsError. A symbolic
    link is created with its target (the owner) atomically, so a writer killed at any moment
    never leaves a lock without an owner; where a folder has no symbolic links (FAT, some
    FUSE), an exclusive file holds the owner, and one left empty is stale after a grace time."""
    try:
        os.symlink(me, lock)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(me)
    except BaseException:  # a full disk: no empty lock left behind
        lock.unlink(missing_ok=True)
        raise


def _stale(path: Path) -> bool:
    owner = _owner(path)
    if owner is None:  # empty: its writer died between creating the lock and writing its pid
        try:
            return time.time() - path.lstat().st_mtime > _EMPTY_LOCK_GRACE_S
        except OSError:
            return False
    return owner is not None and owner[0] == socket.gethostname() and not _pid_alive(owner[1])


def _locked_by(lock: Path) -> str:
    """Who holds `lock` and exactly what to do about it (one line)."""
    owner = _owner(lock)
    if owner is None:
        return (f"locked by another mergepipe writer that is starting (lock {lock}); wait for it (a lock left "
                f"empty is removed by the next run after {_EMPTY_LOCK_GRACE_S} s)")
    host, pid = owner
    if host == socket.gethostname():
        return (f"locked by another mergepipe writer, {host}:{pid} (this host), still running (lock {lock}); "
                f"wait for it to finish, or stop it (kill {pid})")
    # another host: its process table cannot be read from here, so the lock is never removed automatically
    return (f"locked by another mergepipe writer, {host}:{pid}: process {pid} on host {host} (lock {lock}); "
            f"this host cannot tell whether it is still running: if no mergepipe runs there any more (check with "
            f"`ssh {host} ps -p {pid}`), remove the lock with: rm {shlex.quote(str(lock))}")


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


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so that cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextmanager
def terminate_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` (like SIGINT raises
    KeyboardInterrupt); outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        prev = signal.getsignal(sig)
        if prev is signal.SIG_IGN:  # e.g. nohup: the user asked to survive a hangup
            continue
        old[sig] = prev
        signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)


def _leftover_re(name: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(name)}\.(?:tmp|old)-[0-9a-f]{{12}}")


def _remove_leftovers(target: Path) -> list[Path]:
    """Remove temp/old folders of `target` (exact names, never another target's); only
    called while holding its lock, so anything found belongs to a writer that died."""
    removed = []
    pattern = _leftover_re(target.name)
    for p in target.parent.iterdir():
        if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def clean_dead_writer(target: str | Path) -> list[Path]:
    """Remove what a writer killed after its commit left beside `target` (its lock, the
    previous version it was deleting), as the next writer would: `run` finding the output up
    to date publishes nothing, so it would stay there. Cheap (one listing) and best effort:
    nothing is touched while a live writer holds the lock. Returns the folders removed."""
    target = Path(target)
    lock = target.parent / f".{target.name}.lock"
    pattern = _leftover_re(target.name)
    try:
        found = any(pattern.fullmatch(n) for n in os.listdir(target.parent))
    except OSError:
        return []
    locked = os.path.lexists(lock)
    if not found and not locked:
        return []
    if locked:
        if not _stale(lock):
            return []  # a live writer: its temp folder is its own
        lock.unlink(missing_ok=True)
    try:
        _take_lock(lock, f"{socket.gethostname()}:{os.getpid()}")
    except OSError:
        return []  # another writer got there first, or a read-only folder: leave it to them
    try:
        return _remove_leftovers(target) if os.path.isdir(target) else []
    finally:
        lock.unlink(missing_ok=True)


def _recover_previous(target: Path) -> Path | None:
    """Where renameat2's exchange is unsupported (NFS, Lustre, some FUSE), `commit` renames
    the previous version to `.NAME.old-*` and then the new one in; a writer killed between
    the two leaves no target, only the old folder (and its temp). Put the newest old folder
    back (only called under the target's lock), so that cleaning up the leftovers does not
    delete the user's previous output. Returns the folder restored, or None."""
    if os.path.lexists(target):
        return None
    pattern = _leftover_re(target.name)
    olds = [p for p in target.parent.iterdir()
            if pattern.fullmatch(p.name) and ".old-" in p.name and p.is_dir() and not p.is_symlink()]
    if not olds:
        return None
    newest = max(olds, key=lambda p: (p.stat().st_mtime_ns, p.name))
    os.rename(newest, target)
    return newest


_LEFTOVER = re.compile(r"\..+\.(?:lock|(?:tmp|old)-[0-9a-f]{12})")


def leftover_of(path: Path) -> bool:
    """Whether `path` is named like a writer's lock, temp folder or previous version (of any target)."""
    return bool(_LEFTOVER.fullmatch(path.name))


class Publisher:
    """with Publisher(target) as tmp: write into tmp; then .commit() renames it in.

    Leaving the block without commit (an exception) removes the temp folder and
    leaves the target untouched.
    """

    def __init__(self, target: str | Path, *, force: bool = False) -> None:
        self.target = check_output_path(target)
        self.force = force
        self.lock = self.target.parent / f".{self.target.name}.lock"
        self.tmp = self.target.parent / f".{self.target.name}.tmp-{uuid.uuid4().hex[:12]}"
        self._committed = False
        self._signals = terminate_unwinds()

    def _check_target(self) -> None:
        check_replace(self.target, force=self.force)

    def __enter__(self) -> Path:
        self._check_target()
        self._signals.__enter__()
        try:
            return self._enter()
        except BaseException:
            self._signals.__exit__(None, None, None)
            raise

    def _enter(self) -> Path:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in the way, permissions
            raise OutputError(f"{self.target}: cannot create its parent folder: {e.strerror}") from None
        me = f"{socket.gethostname()}:{os.getpid()}"
        for attempt in range(2):
            try:
                _take_lock(self.lock, me)
                break
            except FileExistsError:
                if attempt == 0 and _stale(self.lock):
                    self.lock.unlink(missing_ok=True)  # its writer died (kill -9)
                    continue
                raise OutputError(f"{self.target}: {_locked_by(self.lock)}") from None
            except OSError as e:  # read-only folder, ...
                raise OutputError(f"{self.target}: cannot create the lock {self.lock}: {e.strerror}") from None
        try:
            _recover_previous(self.target)  # a writer killed mid-commit: its previous version, back in place
            self._check_target()  # again under the lock: another writer may have changed it meanwhile
            _remove_leftovers(self.target)
            self.tmp.mkdir()
        except BaseException:
            self.lock.unlink(missing_ok=True)
            raise
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
        # again just before replacing it: files the user put into the target while the merge ran
        # (minutes) are not deleted with the previous version
        self._check_target()
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
        try:
            if not self._committed:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.lock.unlink(missing_ok=True)
        finally:
            self._signals.__exit__(None, None, None)
        err = exc[0] if exc else None
        if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:  # aux files, manifest, fsync: one clean line
            raise OutputError(f"{self.target}: not published: writing {err.filename or 'the output'} failed: "
                              f"{err.strerror}") from None
