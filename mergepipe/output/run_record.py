"""The run record of a published output: timings, host, cache statistics, the stat keys of
the published files and `run`'s no-op record (commands/uptodate.py), all outside the manifest.

It lives beside the output folder, as `.NAME.run.json` next to `NAME/` (like the publisher's
`.NAME.lock`), never inside it: what is inside is what the Hub gets, and inode numbers and
host names are no part of a model. A file at that path is replaced only when it is a run
record (a JSON object whose `kind` is RECORD_KIND, a regular file); anything else there is a
user's, refused before a merge starts. Standard library only: `run`'s no-op check reads it
before anything heavy is imported.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

from mergepipe.errors import OutputError

RECORD_KIND = "mergepipe run record"
MANIFEST = "manifest.json"  # output.manifest.MANIFEST (not imported: that module pulls in more)
LEGACY_NAME = "run.json"  # where earlier versions kept the record: inside the output folder
_NAME = re.compile(r"\..+\.run\.json")


def record_path(out_dir: str | os.PathLike[str]) -> Path:
    out_dir = Path(os.path.normpath(Path(out_dir).absolute()))
    return out_dir.parent / f".{out_dir.name}.run.json"


def stat_key(path: str | os.PathLike[str]) -> list[int]:
    """What changes whenever a file's bytes may have: size, mtime_ns, ctime_ns (which
    os.utime cannot set back), inode, device."""
    st = os.stat(path, follow_symlinks=False)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _load(path: Path) -> dict | None:
    """The record at `path`, or None when there is none or it is not a run record."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        info = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) and info.get("kind") == RECORD_KIND else None


def is_record(path: Path) -> bool:
    """Whether `path` is a run record, named as one (a file beside an output, e.g. in a
    sweep's models/ folder)."""
    return bool(_NAME.fullmatch(path.name)) and _load(path) is not None


def read(out_dir: str | os.PathLike[str]) -> dict | None:
    return _load(record_path(out_dir))


def published_stat(out_dir: str | os.PathLike[str]) -> dict[str, list[int]]:
    """The stat keys recorded for the output's files at publication, when the record is this
    folder's: its manifest is the file published (size, mtime_ns, inode and device; a copied
    or rewritten manifest differs; the ctime changes with every hard link the store adds);
    else {}."""
    stat = (read(out_dir) or {}).get("stat")
    if not isinstance(stat, dict) or not isinstance(stat.get(MANIFEST), list) or len(stat[MANIFEST]) != 5:
        return {}
    try:
        now = stat_key(Path(out_dir) / MANIFEST)
    except OSError:
        return {}
    same = [now[i] for i in (0, 1, 3, 4)] == [stat[MANIFEST][i] for i in (0, 1, 3, 4)]
    return stat if same else {}


def check_writable(out_dir: str | os.PathLike[str]) -> None:
    """Refuse an output whose record path holds something that is not a run record.

    Raises:
        OutputError: naming the file, before any weight is read.
    """
    path = record_path(out_dir)
    if os.path.lexists(path) and _load(path) is None:
        raise OutputError(f"{path}: exists and is not a mergepipe run record; mergepipe keeps the run "
                          f"record of {out_dir} there: move that file away (never replaced, even with --force)")


def write(out_dir: str | os.PathLike[str], info: dict) -> None:
    """Write `info` as the record: a temp file beside it, fsynced, renamed over it; not over
    a file that is not a run record (raises OutputError, as `check_writable`)."""
    check_writable(out_dir)
    path = record_path(out_dir)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    data = (json.dumps({**info, "kind": RECORD_KIND}, sort_keys=True, indent=1) + "\n").encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def update(out_dir: str | os.PathLike[str], change) -> None:
    """Replace the record by change(its content, {} when there is none) unless that is None.
    Best effort: the record is a cache (the full check runs without it); a failure, or a
    file there that is not a run record, leaves things as they were."""
    path = record_path(out_dir)
    if os.path.lexists(path) and _load(path) is None:
        return
    try:
        info = change(_load(path) or {})
        if info is not None:
            write(out_dir, info)
    except Exception:  # noqa: BLE001 -- only a cache: the full check runs next time
        pass
