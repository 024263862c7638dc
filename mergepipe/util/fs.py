"""File-system helpers shared by every step: atomic writes, canonical JSON, file hashes.

One implementation of each, so every file mergepipe writes is either absent or
complete (never a torn or half-renamed file), and every JSON document it writes or
hashes is spelled the same way for the same content.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
from pathlib import Path

from blake3 import blake3

FILE_MODE = 0o644  # mkstemp creates 0600, which would hide written files from other users


def fsync_dir(path: Path | str) -> None:
    """fsync a folder so a rename inside it survives a crash (no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on folders; the rename itself is still atomic
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write `data` to `path` atomically: a uniquely named temp file in the same folder,
    fsynced, renamed over `path`, then the folder fsynced.

    Readers see the old file or the new one, never a partial one; concurrent writers do
    not share a temp name. Creates missing parent folders. OSError propagates (the temp
    file is removed first); callers turn it into their own one-line error.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        try:
            os.fchmod(fd, FILE_MODE)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(parent)


def read_json_object_text(path: Path | str) -> str:
    """The text of a file that must hold a JSON object (a plan, a manifest): one that does not
    start with '{' (a model file or /dev/zero given by mistake) is refused after its first
    4 KiB, never read whole. Raises OSError, or ValueError (UnicodeDecodeError too)."""
    with open(path, "rb") as f:
        head = f.read(4096)
        if not head.lstrip().startswith(b"{"):
            raise ValueError("not a JSON object")
        return (head + f.read()).decode("utf-8")


def canonical_json(obj, *, indent: int | None = None) -> bytes:
    """The one JSON spelling: sorted keys, ASCII, no NaN/Infinity (ValueError).

    indent=None: compact (`,` and `:` separators, no trailing newline) -- what is hashed
    (plan hashes, cache keys) and stored compressed. indent=N: pretty-printed with a
    trailing newline -- what people read (plans, manifests, records, shard indexes).
    """
    if indent is None:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return (json.dumps(obj, sort_keys=True, indent=indent, allow_nan=False) + "\n").encode()


def hash_file(path: Path | str, *, chunk_bytes: int = 16 << 20) -> str:
    """blake3 hex digest of a file's bytes."""
    # Chunked reads, not update_mmap: a mapping's touched pages count in the
    # process's RSS, which then grew with the output size (BENCHMARKS.md).
    h = blake3(max_threads=blake3.AUTO)
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


_NO_KERNEL_COPY = frozenset((errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM))


REFLINK_BLOCK = 4096  # file-system block: the unit btrfs and XFS share extents in
# statfs f_type of the Linux file systems whose copy_file_range shares extents (reflinks):
# btrfs, XFS, ZFS, NFS
_REFLINK_FS = frozenset((0x9123683E, 0x58465342, 0x2FC12FC1, 0x6969))


def file_system_type(path: str | Path) -> int | None:
    """statfs(2)'s f_type of the file system holding `path` (Linux), else None."""
    try:
        import ctypes
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statfs(os.fsencode(str(path)), buf) != 0:
            return None
        return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_long)], sys.byteorder, signed=True) & 0xFFFFFFFF
    except (OSError, AttributeError, ValueError):
        return None


def shares_extents(path: str | Path) -> bool:
    """Whether copy_file_range on the file system of `path` may share extents (btrfs, XFS,
    ZFS; NFS 4.2 servers may clone too) rather than write the bytes again; unknown: True,
    so that the kernel copy is kept where it is not known to be a plain copy."""
    kind = file_system_type(path)
    return kind is None or kind in _REFLINK_FS


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int, *,
               chunk_bytes: int = 8 << 20) -> int:
    """Copy `nbytes` from src at src_offset to dst at dst_offset without the bytes passing
    through Python: `os.copy_file_range` (the kernel copies, or shares extents where the file
    system can); where it is refused (EXDEV, ENOSYS, EINVAL, EOPNOTSUPP, ...) pread/pwrite
    through one reused buffer. Returns the bytes copied in the kernel (0 for the fallback).

    Raises:
        OSError: a read or write error, or src ends before nbytes (EIO).
    """
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            # where src and dst sit alike within a file-system block, the aligned middle goes in
            # its own call: btrfs/XFS share (reflink) whole aligned blocks, and copy the rest
            cuts = [nbytes]
            if (src_offset - dst_offset) % REFLINK_BLOCK == 0:
                head = -src_offset % REFLINK_BLOCK
                tail = (src_offset + nbytes) % REFLINK_BLOCK
                if head + tail < nbytes:
                    cuts = [c for c in (head, nbytes - tail, nbytes) if c > 0]
            for end in cuts:
                while done < end:
                    n = os.copy_file_range(src_fd, dst_fd, end - done, src_offset + done, dst_offset + done)
                    if n == 0:
                        raise OSError(errno.EIO, "source ended before the range was copied")
                    done += n
            return done
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
    buf = bytearray(min(chunk_bytes, max(1, nbytes - done)))
    view = memoryview(buf)
    kernel = done
    while done < nbytes:
        n = os.preadv(src_fd, [view[:min(len(buf), nbytes - done)]], src_offset + done)
        if n == 0:
            raise OSError(errno.EIO, "source ended before the range was copied")
        w = 0
        while w < n:
            w += os.pwrite(dst_fd, view[w:n], dst_offset + done + w)
        done += n
    return kernel


_SYNC_FILE_RANGE_WRITE = 2
_libc_sync_file_range = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these dirty pages to the device now (Linux
    `sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait for them), so that the
    writeback overlaps the rest of the merge and the final fsync has little left (1 GB output:
    fsync 0.55 -> 0.03 s, the copy loop around it 0.95 -> 0.70 s). Best effort: a no-op where
    the call is missing or fails; durability still comes from the fsync."""
    global _libc_sync_file_range
    if _libc_sync_file_range is None:
        try:
            import ctypes
            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _libc_sync_file_range = f
        except (OSError, AttributeError):
            _libc_sync_file_range = False
    if _libc_sync_file_range and nbytes > 0:
        _libc_sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
