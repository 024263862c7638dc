"""`mergepipe gc`: prune the cache folder (default `.mergepipe/`).

The kinds of entry, their folders and the names mergepipe gives them are index/cache.py's
(`KINDS`); gc visits each kind's folder in that order. What it may remove:
  merges/<plan_hash>/   finished merges kept so that an earlier plan is restored, not recomputed;
                        those referenced by a `--keep` output folder or plan.json stay
  merges/*.partial      store entries a dead process left half written
  parts/                part files of split merges (a finished gather no longer needs them), each only
                        beside the part job's sidecar that records its size
  calibration/ weighted/ joint/ sketch/ cuts/   the calibrated strategy's importance artifacts and
                        energies, joint methods' statistics, the sketch strategy's sketches and the
                        exact cuts off the index's grid (rebuilt when a plan or merge needs them
                        again); those a `--keep` output or plan names (its artifact hash, joint
                        key, sketch header hash, cuts' blake3) stay
  models/ deltas/ stat/ indexes, only with `indexes=True` (they are rebuilt by rereading the models)
  .<entry>.<random>.tmp  in any of these, a day old: a writer killed before its rename left it
An entry is removed only when its name is one mergepipe gives and its content starts as
mergepipe writes it (a safetensors header of format mergepipe-importance-*, an energies JSON,
the joint magic, a sketch trailer): a user's file there with a look-alike name is kept and reported.
Published outputs are separate hardlinks, so removing a store entry never touches them;
the bytes a removal frees are those of files with no other link.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import ConfigError, OutputError
from mergepipe.index.cache import (CALIBRATION, CUTS, JOINT, KINDS, MERGES, PARTS, SKETCH, WEIGHTED, CacheLayout,
                                   Kind, joint_key, temp_of)
from mergepipe.output.manifest import MANIFEST
from mergepipe.util.fs import read_json_object_text


@dataclass
class Removal:
    path: Path
    freed: int  # bytes of files with no other hardlink


@dataclass
class Keep:
    """What `--keep` outputs and plans reference: plan hashes (merges/), importance artifact
    hashes (calibration/ and the weighted/ entries made with them), joint keys (joint/)."""
    plans: set[str] = field(default_factory=set)
    artifacts: set[str] = field(default_factory=set)
    joint: set[str] = field(default_factory=set)
    sketches: set[str] = field(default_factory=set)  # sketch header hashes (sketch/)
    cuts: set[str] = field(default_factory=set)  # exact cuts' blake3 (cuts/)


def plan_of(path: str | Path) -> dict:
    """The plan recorded by an output folder or its manifest.json (under `plan`), or a plan.json."""
    p = Path(path)
    src = p / MANIFEST if p.is_dir() else p
    try:
        doc = json.loads(read_json_object_text(src))
        plan = doc["plan"] if isinstance(doc.get("plan"), dict) else doc  # a plan itself has no `plan` key
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: --keep needs an output folder or a plan.json ({e})") from None
    if not isinstance(plan, dict) or not isinstance(doc.get("plan_hash"), str):
        raise ConfigError(f"{src}: no plan_hash; --keep needs an output folder or a plan.json")
    return {**plan, "plan_hash": doc["plan_hash"]}


def plan_hash_of(path: str | Path) -> str:
    """The plan hash recorded by an output folder (its manifest) or a plan.json."""
    return plan_of(path)["plan_hash"]


def keep_of(paths: list[str]) -> Keep:
    keep = Keep()
    for path in paths:
        plan = plan_of(path)
        keep.plans.add(plan["plan_hash"])
        cal = (plan.get("strategy") or {}).get("calibration") if isinstance(plan.get("strategy"), dict) else None
        if isinstance(cal, dict) and isinstance(cal.get("artifact"), str):
            keep.artifacts.add(cal["artifact"])
        joint = plan.get("joint")
        if isinstance(joint, dict) and isinstance(joint.get("key"), str):
            keep.joint.add(joint["key"])
        sk = (plan.get("strategy") or {}).get("sketch") if isinstance(plan.get("strategy"), dict) else None
        if isinstance(sk, dict) and isinstance(sk.get("artifacts"), dict):
            keep.sketches.update(v for v in sk["artifacts"].values() if isinstance(v, str))
        if isinstance(plan.get("cuts"), dict):
            keep.cuts.update(v for v in plan["cuts"].values() if isinstance(v, str))
    return keep


def _freed(path: Path) -> int:
    try:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
        return sum(st.st_size for st in (p.stat() for p in files) if st.st_nlink == 1)
    except FileNotFoundError:
        return 0  # removed meanwhile by another process (a second gc)


TEMP_AGE = 86400  # seconds: a live writer's temp is younger; a killed one's (kill -9, OOM) older


def _stale_temp(kind: Kind, path: Path) -> bool:
    """A temp file of one of our entries, a day old: its writer was killed before renaming it."""
    if not temp_of(kind, path.name) or path.is_symlink() or not path.is_file():
        return False
    try:
        return time.time() - path.stat().st_mtime > TEMP_AGE
    except OSError:
        return False


def _head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _joint_is_ours(path: Path) -> bool:
    from mergepipe.index.joint import MAGIC
    return _head(path, len(MAGIC)) == MAGIC


def _sketch_is_ours(path: Path) -> bool:
    from mergepipe.index.sketch import header_digest
    return header_digest(path) is not None


def _weighted_is_ours(path: Path) -> bool:
    return _head(path, 22).startswith((b'{"artifact":"', b'{"format":1,"tensors":'))  # canonical: sorted keys


def _cuts_is_ours(path: Path) -> bool:
    head = _head(path, 96)  # canonical JSON: {"blake3":"<64 hex>","format":N,...
    return head.startswith(b'{"blake3":"') and head[75:85] == b'","format"'


def _calibration_is_ours(path: Path) -> bool:
    head = _head(path, 1 << 16)
    return b'"format":"mergepipe-importance-' in head.replace(b" ", b"") and len(head) > 8


# per derived kind (index/cache.py, `derived`): whether an entry's content starts as mergepipe
# writes it (cheap: a few bytes), so a user's look-alike file is kept
WRITTEN_BY_US: dict[str, Callable[[Path], bool]] = {
    JOINT.folder: _joint_is_ours, SKETCH.folder: _sketch_is_ours, WEIGHTED.folder: _weighted_is_ours,
    CALIBRATION.folder: _calibration_is_ours, CUTS.folder: _cuts_is_ours}


def _part_is_ours(path: Path) -> bool:
    from mergepipe.commands.parts import part_is_ours  # the engine is imported only for a parts/ folder
    return part_is_ours(path)


def _joint_referenced(path: Path, keep: Keep) -> bool:
    return joint_key(path.name) in keep.joint


def _sketch_referenced(path: Path, keep: Keep) -> bool:
    from mergepipe.index.sketch import header_digest
    return header_digest(path) in keep.sketches


def _weighted_referenced(path: Path, keep: Keep) -> bool:
    from mergepipe.index.weighted import recorded_artifact
    return recorded_artifact(path) in keep.artifacts


def _cuts_referenced(path: Path, keep: Keep) -> bool:
    from mergepipe.index.extra_cuts import recorded_digest
    return bool(keep.cuts) and recorded_digest(path) in keep.cuts


def _calibration_referenced(path: Path, keep: Keep) -> bool:
    from mergepipe.util.fs import hash_file
    try:
        return bool(keep.artifacts) and hash_file(path) in keep.artifacts
    except OSError:
        return False


# per derived kind: whether a --keep output or plan names the entry (its joint key, sketch
# header hash, importance artifact hash), so it stays
REFERENCED: dict[str, Callable[[Path, Keep], bool]] = {
    JOINT.folder: _joint_referenced, SKETCH.folder: _sketch_referenced, WEIGHTED.folder: _weighted_referenced,
    CALIBRATION.folder: _calibration_referenced, CUTS.folder: _cuts_referenced}


def collect(cache_dir: str | Path, keep: Keep | set[str], *, indexes: bool = False,
            foreign: list[Path] | None = None) -> list[Removal]:
    """What gc would remove, in a stable order: store entries, part files, derived entries
    nothing in `keep` references and (with `indexes`) index files, each recognised by its own
    name pattern; anything else is left alone. `foreign` collects the look-alike files kept
    because their content is not ours."""
    keep = keep if isinstance(keep, Keep) else Keep(plans=set(keep))
    cache = CacheLayout(cache_dir)
    victims: list[Path] = []
    for kind in KINDS:
        folder = cache.folder(kind)
        if not kind.pruned or not folder.is_dir() or folder.is_symlink():
            continue
        for p in sorted(folder.iterdir()):
            if _removable(kind, p, keep, indexes=indexes, foreign=foreign):
                victims.append(p)
    return [Removal(p, _freed(p)) for p in victims]


def _removable(kind: Kind, p: Path, keep: Keep, *, indexes: bool, foreign: list[Path] | None) -> bool:
    """Whether gc removes `p`, found in `kind`'s folder: a day-old temp of one of its entries,
    or an entry with one of its names, of its type (folder or file), not referenced by `keep`
    and (a derived entry or a part file) with content mergepipe wrote."""
    if not kind.folders and _stale_temp(kind, p):
        return True
    if kind.index and not indexes:
        return False
    if not kind.entry.fullmatch(p.name) or p.is_symlink() or not (p.is_dir() if kind.folders else p.is_file()):
        return False
    if kind is MERGES and p.name in keep.plans or kind.derived and REFERENCED[kind.folder](p, keep):
        return False
    if kind.derived and not WRITTEN_BY_US[kind.folder](p) or kind is PARTS and not _part_is_ours(p):
        if foreign is not None:
            foreign.append(p)
        return False
    return True


def _gone_ok(func, path, exc_info) -> None:
    """rmtree's error hook: an entry another process removed first (a second `gc`, a run
    replacing a damaged store entry) is not an error; anything else is."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def remove(removals: list[Removal]) -> int:
    """Remove what `collect` found. Raises OutputError naming the entry that cannot be removed."""
    for r in removals:
        try:
            if r.path.is_dir() and not r.path.is_symlink():
                shutil.rmtree(r.path, onerror=_gone_ok)
            else:
                r.path.unlink(missing_ok=True)
        except OSError as e:
            raise OutputError(f"{r.path}: cannot remove this cache entry: {e.strerror or e}") from None
    return sum(r.freed for r in removals)
