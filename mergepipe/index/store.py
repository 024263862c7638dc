"""The cache folder: stat cache, model indexes, delta indexes, plans, merged outputs.

Layout under `cache_dir` (default `.mergepipe/`):
  stat/<key>.json        (path, size, mtime_ns, ctime_ns, inode, device, block_bytes) -> file fingerprint
  models/<key>.json.gz   ModelIndex, keyed by the files' fingerprints and block size
  deltas/<expert>-<base>-<block_bytes>.json.gz   DeltaIndex
Everything is keyed by content, so an unchanged model is never reread and a
changed one (same path, new bytes) never meets a stale index.
"""
from __future__ import annotations

import gzip
import json
import os
import uuid
from pathlib import Path

from blake3 import blake3

from mergepipe.errors import CheckpointError, OutputError
from mergepipe.index.build import DeltaIndex, ModelIndex, build_delta_index, build_expert_index, build_model_index
from mergepipe.checkpoint.safetensors import Checkpoint, ReadCounter, open_checkpoint


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # disk full, file size limit, read-only cache
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise OutputError(f"{path}: cannot write to the cache: {e.strerror}; free space or set cache_dir "
                          "elsewhere") from None


def _read_gz_json(path: Path) -> dict | None:
    try:
        return json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, ValueError, EOFError):
        return None  # missing or damaged cache entry: rebuild it


def _write_gz_json(path: Path, obj: dict) -> None:
    # mtime=0 keeps the bytes a pure function of the content
    _atomic_write(path, gzip.compress(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode(), mtime=0))


def file_fingerprints(ckpt: Checkpoint, index: ModelIndex) -> dict[str, str]:
    """Per file: blake3 over its header bytes and its blocks' hashes in offset order."""
    out = {}
    for h in ckpt.files:
        fp = blake3(h.header_bytes)
        for t in h.tensors:
            for digest in index.tensors[t.name].hashes:
                fp.update(bytes.fromhex(digest))
        out[h.path.name] = fp.hexdigest()
    return out


DELTA_FORMAT = 3  # bump when DeltaIndex changes meaning: old cache entries are then ignored


class Store:
    def __init__(self, cache_dir: str | Path) -> None:
        self.root = Path(cache_dir)
        self.index_reads = ReadCounter()
        self.hits = 0
        self.builds = 0

    def _stat_path(self, path: Path, block_bytes: int) -> Path:
        key = blake3(f"{path.resolve()}:{block_bytes}".encode()).hexdigest()[:32]
        return self.root / "stat" / f"{key}.json"

    @staticmethod
    def _stat(path: Path) -> dict:
        # ctime_ns: an in-place edit that restores size and mtime (os.utime) cannot restore it
        st = path.stat()
        return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}

    def _model_key(self, fingerprints: dict[str, str], block_bytes: int) -> Path:
        key = blake3(json.dumps([sorted(fingerprints.items()), block_bytes]).encode()).hexdigest()[:40]
        return self.root / "models" / f"{key}.json.gz"

    def _cached_model(self, ckpt: Checkpoint, block_bytes: int) -> ModelIndex | None:
        fingerprints = {}
        for h in ckpt.files:
            try:
                cached = json.loads(self._stat_path(h.path, block_bytes).read_text())
            except (OSError, ValueError):
                return None
            if cached.get("stat") != self._stat(h.path):
                return None
            fingerprints[h.path.name] = cached["fingerprint"]
        d = _read_gz_json(self._model_key(fingerprints, block_bytes))
        if d is None:
            return None
        self.hits += 1
        return ModelIndex.from_json(d)

    def _save_model(self, ckpt: Checkpoint, index: ModelIndex, stats: dict[Path, dict]) -> None:
        """Record `index` for `ckpt`, whose files had `stats` before they were read: a file
        that changed meanwhile was hashed half old, half new, so nothing is recorded."""
        for h in ckpt.files:
            if self._stat(h.path) != stats[h.path]:
                raise CheckpointError(f"{h.path}: changed while it was being indexed; run again")
        fingerprints = file_fingerprints(ckpt, index)
        _write_gz_json(self._model_key(fingerprints, index.block_bytes), index.to_json())
        for h in ckpt.files:
            entry = {"stat": self._stat(h.path), "fingerprint": fingerprints[h.path.name]}
            _atomic_write(self._stat_path(h.path, index.block_bytes), json.dumps(entry, sort_keys=True).encode())

    def model_index(self, path: str | Path, *, block_bytes: int, threads: int = 2,
                    progress: bool = False) -> tuple[Checkpoint, ModelIndex]:
        """Open a checkpoint and return its index, from the cache when every file is unchanged."""
        ckpt = open_checkpoint(path)
        index = self._cached_model(ckpt, block_bytes)
        if index is None:
            stats = {h.path: self._stat(h.path) for h in ckpt.files}
            index = build_model_index(ckpt, block_bytes=block_bytes, threads=threads, counter=self.index_reads,
                                      progress=progress)
            self.builds += 1
            self._save_model(ckpt, index, stats)
        return ckpt, index

    def expert_index(self, path: str | Path, base: Checkpoint, base_index: ModelIndex, *,
                     threads: int = 2, progress: bool = False) -> tuple[Checkpoint, ModelIndex, DeltaIndex]:
        """An expert's ModelIndex and DeltaIndex against `base`, from the cache where possible;
        when neither is cached, both come from one scan (the expert is read once)."""
        ckpt = open_checkpoint(path)
        index = self._cached_model(ckpt, base_index.block_bytes)
        if index is not None:
            return ckpt, index, self.delta_index(base, base_index, ckpt, index, threads=threads, progress=progress)
        stats = {h.path: self._stat(h.path) for h in ckpt.files}
        index, delta = build_expert_index(base, ckpt, base_index, block_bytes=base_index.block_bytes,
                                          threads=threads, counter=self.index_reads, progress=progress)
        self.builds += 1
        self._save_model(ckpt, index, stats)
        _write_gz_json(self._delta_path(index, base_index), delta.to_json())
        return ckpt, index, delta

    def _delta_path(self, expert_index: ModelIndex, base_index: ModelIndex) -> Path:
        name = (f"{expert_index.content_hash[:32]}-{base_index.content_hash[:32]}-{expert_index.block_bytes}"
                f"-v{DELTA_FORMAT}.json.gz")
        return self.root / "deltas" / name

    def delta_index(self, base: Checkpoint, base_index: ModelIndex, expert: Checkpoint, expert_index: ModelIndex,
                    *, threads: int = 2, progress: bool = False) -> DeltaIndex:
        path = self._delta_path(expert_index, base_index)
        d = _read_gz_json(path)
        if d is not None:
            self.hits += 1
            return DeltaIndex.from_json(d)
        delta = build_delta_index(base, expert, base_index, expert_index, threads=threads, counter=self.index_reads,
                                  progress=progress)
        self.builds += 1
        _write_gz_json(path, delta.to_json())
        return delta
