"""The store of finished merges, `merges/<plan_hash>/` in the cache (index/cache.py): save a
merge, find one, restore it by hardlinks.

An entry is authenticated (index/store_key.py): saving writes `store.mac`, the keyed blake3
of ("merges", plan hash, the manifest's bytes); an entry whose MAC does not verify under this
user's key (absent, forged, another user's) is never restored nor trusted by a part job, and
the next save replaces it. A save goes to a staging folder of its own, renamed over the
entry, so two runs of one plan saving at once leave one complete entry. The store is only a
cache: a save that cannot be made is skipped, never an error.
"""
from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

from mergepipe.errors import IntegrityError
from mergepipe.index.cache import MERGES, STORE_MAC, CacheLayout
from mergepipe.index.store_key import entry_mac, mac_matches, store_key
from mergepipe.output.manifest import MANIFEST, MANIFEST_SCHEMA, load_manifest, verify_outputs


def restore(cache: CacheLayout, plan: dict, tmp: Path, lineage: dict | None = None) -> bool:
    """Hard-link a previously built merge of this exact plan (its JSON form, plan/record.py
    plan_json: what the stored manifest records) into tmp, if this user's run stored
    it (its MAC verifies under this user's key: a shared cache folder's writers can put any
    self-consistent entry there), it is intact, and it has this `lineage` (the same input
    bytes, once plain, may now hold a mergepipe manifest). False leaves tmp empty."""
    key = store_key()  # before any work: a broken key file is an error, not a silent rebuild
    if key is None:  # no key can be made here: nothing stored can be authenticated
        return False
    cached = cache.merge(plan["plan_hash"])
    try:
        recorded = (cached / STORE_MAC).read_bytes()
        _link_owned(cached / MANIFEST, tmp / MANIFEST)
        # the bytes the MAC covers are the ones linked into tmp, which only this user can replace
        authentic = mac_matches(key, MERGES.folder, cached.name, (tmp / MANIFEST).read_bytes(), recorded)
        man = load_manifest(tmp) if authentic else None
        if man is None or man.get("plan_hash") != plan["plan_hash"] or man.get("plan") != plan \
                or man.get("schema") != MANIFEST_SCHEMA or man.get("lineage", {}) != (lineage or {}):
            raise _NotRestorable  # another user's or a forged entry, another plan or lineage, an older format
        for name in man["outputs"]["files"]:
            _link_owned(cached / name, tmp / name)
        verify_outputs(tmp, deep=True)  # rehashes every file against the authenticated manifest
    except (_NotRestorable, IntegrityError, OSError):  # also: removed by a concurrent run's save meanwhile
        for p in tmp.iterdir():
            p.unlink()
        return False
    return True


def is_stored(cache: CacheLayout, plan_hash: str) -> bool:
    """A finished merge of plan `plan_hash` that this user stored, with every file it records (a
    restore authenticates and rehashes it again): a forged or another user's entry must not
    make the part jobs skip their tensors."""
    cached = cache.merge(plan_hash)
    key = store_key()
    if key is None:
        return False
    try:
        authentic = mac_matches(key, MERGES.folder, cached.name, (cached / MANIFEST).read_bytes(),
                                (cached / STORE_MAC).read_bytes())
        man = load_manifest(cached)
    except (OSError, IntegrityError):
        return False
    return authentic and man.get("plan_hash") == plan_hash and all(
        (cached / name).is_file() for name in man["outputs"]["files"])


def save(cache: CacheLayout, plan_hash: str, tmp: Path) -> None:
    """Store the merge in `tmp` (its files and manifest) as plan `plan_hash`'s entry, with this
    user's MAC; replaces an entry `restore` refused. Nothing is stored where no key exists."""
    key = store_key()
    if key is None:  # an entry without this user's MAC would never be restored
        return
    cached = cache.merge(plan_hash)
    # A staging folder of our own: two runs of one plan (to different targets) may save at once.
    staging = cache.merge_staging(plan_hash, uuid.uuid4().hex[:12])
    try:
        staging.mkdir(parents=True)
        for p in tmp.iterdir():
            if p.is_file():
                _link_or_copy(p, staging / p.name)
        manifest = (staging / MANIFEST).read_bytes()
        (staging / STORE_MAC).write_text(entry_mac(key, MERGES.folder, cached.name, manifest))
        if cached.exists():
            shutil.rmtree(cached, ignore_errors=True)  # an entry restore refused: damaged, forged, another user's
        os.replace(staging, cached)
    except OSError:
        pass  # the store is only a cache: another run saved this plan first, or no space for a copy
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _NotRestorable(Exception):
    """A store entry that is absent, not this user's, or not of this plan and lineage."""


def _link_owned(src: Path, dst: Path) -> None:
    """A hard link when this user owns `src` (the owner of an inode could rewrite the published
    file in place later), else a copy."""
    _link_or_copy(src, dst)
    st = os.lstat(dst)
    if not stat.S_ISREG(st.st_mode):  # a link or a folder in an entry: not one a run wrote
        raise _NotRestorable
    if st.st_uid != os.geteuid():
        dst.unlink()
        shutil.copyfile(src, dst, follow_symlinks=False)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
