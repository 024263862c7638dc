"""The per-user secret key that authenticates store entries, and their MACs.

A cache folder may be shared (a cluster project folder): anyone who can write it can put
self-consistent files under any name. An entry that carries this user's MAC was written by
a run of this user; one that does not is rebuilt, never trusted. The key lives outside the
cache (`$MERGEPIPE_STORE_KEY_FILE`, else `$XDG_CONFIG_HOME/mergepipe/store.key`, else
`~/.config/mergepipe/store.key`): 32 random bytes, mode 0600, created on first use. A key
file that exists but cannot serve (a folder, unreadable, another length, readable by others)
is an error naming it, never replaced: replacing it would disown every entry it signed.
Where no key exists and none can be created, the store of merges is off (`store_key`).
"""
from __future__ import annotations

import hmac
import os
import stat
import tempfile
from pathlib import Path

from blake3 import blake3

from mergepipe.errors import ConfigError, OutputError
from mergepipe.util.fs import fsync_dir

KEY_ENV = "MERGEPIPE_STORE_KEY_FILE"
KEY_BYTES = 32
MAC_PREFIX = "mergepipe-store-mac-1 "


def key_path() -> Path:
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "mergepipe" / "store.key"


def load_key() -> bytes:
    """This user's store key, created (0600, atomically) when absent.

    Raises:
        ConfigError: the key file is a folder, unreadable, not 32 bytes or open to others.
        OutputError: it is absent and cannot be created.
    """
    path = key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    _create_key(path)
    try:
        return _read_key(path)
    except FileNotFoundError:
        raise OutputError(f"{path}: store key vanished right after it was created; run again") from None


def store_key() -> bytes | None:
    """This user's key, or None where none exists and none can be made (a read-only home on a
    cluster node): stored merges are then neither restored nor saved, and the merge runs.
    A key file that exists but cannot serve is still an error (ConfigError): silently ignoring
    it would rebuild every merge without saying why."""
    try:
        return load_key()
    except OutputError:
        return None


def _read_key(path: Path) -> bytes:
    fix = f"fix or remove it (or set {KEY_ENV} to another file)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO there is refused, not waited on
    except FileNotFoundError:
        if path.is_symlink():
            raise ConfigError(f"{path}: store key is a link to nothing; {fix}") from None
        raise
    except NotADirectoryError:  # a file where a folder above it goes: no key, and none can be made there
        raise FileNotFoundError(path) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the store key: {e.strerror or e}; {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: store key is not a regular file; {fix}")
        if st.st_mode & 0o077:  # another user who can read it can forge this user's entries
            raise ConfigError(f"{path}: store key is readable or writable by other users "
                              f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        data = os.read(fd, KEY_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the store key: {e.strerror or e}; {fix}") from None
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise ConfigError(f"{path}: store key is not {KEY_BYTES} bytes; {fix}")
    return data


def _create_key(path: Path) -> None:
    """Write a fresh key under a temp name, then link it to `path`: two first runs at once
    both end up reading the one key that won, and an existing key is never overwritten."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".store.key.", suffix=".tmp", dir=path.parent)  # 0600
    except OSError as e:
        raise OutputError(f"{path}: cannot create the store key: {e.strerror or e}; "
                          f"set {KEY_ENV} to a file in a writable folder") from None
    try:
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return  # another run created it first: its key is the one
        fsync_dir(path.parent)
    except OSError as e:
        raise OutputError(f"{path}: cannot create the store key: {e.strerror or e}; "
                          f"set {KEY_ENV} to a file in a writable folder") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def entry_mac(key: bytes, kind: str, name: str, data: bytes) -> str:
    """The MAC line of store entry `kind/name` whose authenticated bytes are `data` (the kind and
    name are bound in, so an entry moved under another name or kind does not verify)."""
    h = blake3(f"{kind}\0{name}\0".encode(), key=key)
    h.update(data)
    return f"{MAC_PREFIX}{h.hexdigest()}\n"


def mac_matches(key: bytes, kind: str, name: str, data: bytes, recorded: bytes) -> bool:
    return hmac.compare_digest(entry_mac(key, kind, name, data).encode(), recorded)
