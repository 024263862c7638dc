"""The index cache: stat cache, model indexes, delta indexes (where each lives under
`cache_dir`, default `.mergepipe/`, and every other entry kind: index/cache.py).

  stat/<key>.json        (path, size, mtime_ns, ctime_ns, inode, device, block_bytes) -> file fingerprint
  models/<key>.idx       ModelIndex, keyed by the files' fingerprints and block size
  deltas/<expert>-<base>-<block_bytes>-v<N>.idx   DeltaIndex
where "block_bytes" is `BlockLayout.key`: the int block size, or "<bytes>/emb<bytes>" ("-emb"
in file names) for a layout with vocabulary blocks, so plain-layout keys are unchanged.
A model's content hash is its plain layout's (block_bytes alone) in every layout: the index
with vocabulary blocks is anchored to the plain one (same content hash, same entries for
every other tensor), so plans name, and order, the same models either way.
(.idx: index/binfmt.py; older .json.gz entries are not read: misses, rebuilt once.)
Everything is keyed by content, so an unchanged model is never reread and a
changed one (same path, new bytes) never meets a stale index.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from blake3 import blake3

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.errors import CheckpointError, OutputError
from mergepipe.index import binfmt
from mergepipe.index.cache import CacheLayout
from mergepipe.index.columns import delta_describes, describes
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.checkpoint.lora import AdapterCheckpoint, is_adapter, open_adapter
from mergepipe.checkpoint.safetensors import Checkpoint, ReadCounter, open_checkpoint
from mergepipe.checkpoint.vocab import ModelView, VocabCheckpoint
from mergepipe.util.fs import atomic_write_bytes

# index/build.py (numpy, the scan kernels) is imported only when something is (re)built:
# a cached `mergepipe index` and run's plan from cached indexes do not pay for it


def cache_write_error(path: Path, e: OSError) -> OutputError:
    """The one-line error (exit 7) of a cache entry that cannot be written: disk full, quota,
    file size limit, read-only cache, a folder where a file goes. Every cache writer raises
    this one (index entries, sketches, joint statistics, calibration artifacts)."""
    return OutputError(f"{path}: cannot write to the cache: {e.strerror or e}; free space or set cache_dir "
                       "elsewhere")


def _atomic_write(path: Path, data: bytes) -> None:
    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        raise cache_write_error(path, e) from None


def _read_index(path: Path, decode):
    """The decoded cache entry, or None when missing or not a well-formed file of our
    format and version (then it is rebuilt): untrusted input, never an error."""
    try:
        return decode(path.read_bytes())
    except (OSError, ValueError, OverflowError, MemoryError, RecursionError):
        return None


def _model_matches(index: ModelIndex, ckpt: Checkpoint, layout: BlockLayout, anchor: ModelIndex | None = None) -> bool:
    """A cached model index describes this checkpoint: same tensors, dtypes, shapes and block
    layout, block rows that tile each tensor, and a content hash that its block hashes give;
    with vocabulary blocks, the plain index `anchor`'s content hash and entries for every
    tensor whose blocks are the same."""
    if anchor is None:
        return describes(index, ckpt, layout)  # a column at a time (index/columns.py)
    if index.layout != layout or list(index.tensors) != list(ckpt.tensors):
        return False
    for name, t in ckpt.tensors.items():
        e = index.tensors[name]
        if e.dtype != t.dtype or e.shape != tuple(t.shape) or len(e.hashes) != len(e.ranges) \
                or list(e.ranges) != layout.ranges(name, t.shape, t.itemsize):
            return False
        if layout.bytes_for(name, t.shape) == layout.block_bytes and anchor.tensors[name] != e:
            return False
    return index.content_hash == anchor.content_hash


def _delta_matches(delta: DeltaIndex, base_index: ModelIndex, expert_index: ModelIndex) -> bool:
    """A cached delta index is this expert's against this base, with one entry per block."""
    return delta_describes(delta, base_index, expert_index)  # a column at a time (index/columns.py)


def file_fingerprints(ckpt: Checkpoint, index: ModelIndex) -> dict[str, str]:
    """Per file: blake3 over its header bytes and its blocks' hashes in offset order (from the
    decoded index's raw digests, without hex round trips)."""
    cols = index.tensors
    out = {}
    for h in ckpt.files:
        fp = blake3(h.header_bytes)
        names = list(h.table.names)  # data-offset order
        i = cols.index_of(names[0]) if names else 0
        if cols.names[i:i + len(names)] == names:  # the file's tensors in a row of the index: one update
            fp.update(cols.digests[32 * cols.starts[i]:32 * cols.starts[i + len(names)]])
        else:
            for name in names:
                i = cols.index_of(name)
                fp.update(cols.digests[32 * cols.starts[i]:32 * cols.starts[i + 1]])
        out[h.path.name] = fp.hexdigest()
    return out


def _identity(ckpt: Checkpoint) -> str | None:
    """What a virtual checkpoint's cache entries are keyed by (its files are another model's);
    None for a model folder (keyed by its files' fingerprints)."""
    return ckpt.identity if isinstance(ckpt, AdapterCheckpoint | VocabCheckpoint) else None


def open_model(path: str | Path, base: tuple[Checkpoint, ModelIndex] | None = None,
               view: ModelView | None = None) -> Checkpoint:
    """The checkpoint at `path`: a model folder or file, or, for an expert of `base`, a PEFT LoRA
    adapter folder (checkpoint/lora.py: the base's tensors with the adapter's Δ); with `view`, the
    model seen in the merge's output vocabulary (checkpoint/vocab.py). The one place an input
    is opened.

    Raises:
        CheckpointError: a malformed checkpoint, or an adapter folder opened without its base.
        ConfigError: an adapter that is not of this base or not plain LoRA.
    """
    if view is not None:
        return view.open()
    if is_adapter(path):
        if base is None:
            raise CheckpointError(f"{path}: a PEFT LoRA adapter, which is an expert of a base model, not a "
                                  "model of its own; index it with --base BASE, or list it under experts as "
                                  "adapter:")
        return open_adapter(path, base[0], base[1].content_hash)
    return open_checkpoint(path)


def _identity_key(ckpt: Checkpoint) -> dict[str, str]:
    kind = "adapter" if isinstance(ckpt, AdapterCheckpoint) else "vocabulary"
    return {kind: _identity(ckpt)}


DELTA_FORMAT = 3  # bump when DeltaIndex changes meaning: old cache entries are then ignored


class Store:
    def __init__(self, cache_dir: str | Path) -> None:
        self.layout = CacheLayout(cache_dir)
        self.root = self.layout.root
        self.index_reads = ReadCounter()
        self.hits = 0
        self.builds = 0
        self.seen: dict[Path, dict] = {}  # stat of each file whose index was trusted or built (check_unchanged)

    def _stat_path(self, path: Path, layout: BlockLayout) -> Path:
        return self.layout.stat(blake3(f"{path.resolve()}:{layout.key}".encode()).hexdigest()[:32])

    @staticmethod
    def _stat(path: Path) -> dict:
        # ctime_ns: an in-place edit that restores size and mtime (os.utime) cannot restore it
        st = path.stat()
        return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}

    def check_unchanged(self, paths) -> None:
        """Raise if one of `paths` changed since its index was trusted or built here: a merge
        copies the base's bytes file to file and records their hashes from the index, so a base
        edited in place while the merge ran would be published under hashes it no longer has
        (and plain `verify` trusts the stat keys recorded at publication)."""
        for p in paths:
            want = self.seen.get(Path(p))
            if want is not None and self._stat(Path(p)) != want:
                raise CheckpointError(f"{p}: changed while the merge ran (the output would not be the merge of "
                                      "the recorded inputs); nothing published; run again")

    def _model_key(self, fingerprints: dict[str, str], layout: BlockLayout) -> Path:
        key = blake3(json.dumps([sorted(fingerprints.items()), layout.key]).encode()).hexdigest()[:40]
        return self.layout.model(key)

    def _cached_model(self, ckpt: Checkpoint, block_bytes: BlockLayout,
                      anchor: ModelIndex | None = None) -> ModelIndex | None:
        if _identity(ckpt) is not None:  # keyed by the content it is made of: nothing to stat
            index = _read_index(self._model_key(_identity_key(ckpt), block_bytes), binfmt.decode_model)
            if index is None or not _model_matches(index, ckpt, block_bytes, anchor):
                return None
            self.hits += 1
            return index
        fingerprints = {}
        for h in ckpt.files:
            try:
                cached = json.loads(self._stat_path(h.path, block_bytes).read_text())
            except (OSError, ValueError):
                return None
            if cached.get("stat") != self._stat(h.path):
                return None
            self.seen[h.path] = cached["stat"]
            fingerprints[h.path.name] = cached["fingerprint"]
        index = _read_index(self._model_key(fingerprints, block_bytes), binfmt.decode_model)
        if index is None or not _model_matches(index, ckpt, block_bytes, anchor):
            return None
        # another model's index of the same shapes copied under this key is self-consistent:
        # its block hashes must give the fingerprints recorded for these files
        if file_fingerprints(ckpt, index) != fingerprints:
            return None
        self.hits += 1
        return index

    def _save_model(self, ckpt: Checkpoint, index: ModelIndex, stats: dict[Path, dict]) -> ModelIndex:
        """Record `index` for `ckpt`, whose files had `stats` before they were read: a file
        that changed meanwhile was hashed half old, half new, so nothing is recorded.
        Returns the index as saved (decoded: columns, not an object per tensor, like a cached one)."""
        for h in ckpt.files:
            if self._stat(h.path) != stats[h.path]:
                raise CheckpointError(f"{h.path}: changed while it was being indexed; run again")
            self.seen[h.path] = stats[h.path]
        data = binfmt.encode_model(index)
        index = binfmt.decode_model(data)  # what readers get: the columns, as from a cache hit
        if _identity(ckpt) is not None:  # its files are another model's: their stat entries are that one's
            _atomic_write(self._model_key(_identity_key(ckpt), index.layout), data)
            return index
        fingerprints = file_fingerprints(ckpt, index)
        _atomic_write(self._model_key(fingerprints, index.layout), data)
        for h in ckpt.files:
            entry = {"stat": self._stat(h.path), "fingerprint": fingerprints[h.path.name]}
            _atomic_write(self._stat_path(h.path, index.layout), json.dumps(entry, sort_keys=True).encode())
        return binfmt.decode_model(data)

    def model_index(self, path: str | Path, *, block_bytes: int | BlockLayout, threads: int = 2,
                    progress: bool = False, base: tuple[Checkpoint, ModelIndex] | None = None,
                    view: ModelView | None = None) -> tuple[Checkpoint, ModelIndex]:
        """Open a checkpoint and return its index, from the cache when every file is unchanged.
        `base`: the base (and its index) an expert at `path` is of, needed where it is a LoRA adapter;
        `view`: the model in the merge's vocabulary (checkpoint/vocab.py)."""
        block_bytes = BlockLayout.of(block_bytes)
        anchor = None
        if block_bytes.embedding_block_bytes is not None:  # the plain index names the model
            anchor = self.model_index(path, block_bytes=block_bytes.block_bytes, threads=threads,
                                      progress=progress, base=base, view=view)[1]
        ckpt = open_model(path, base, view)
        index = self._cached_model(ckpt, block_bytes, anchor)
        if index is None:
            from mergepipe.index.build import build_model_index
            stats = {h.path: self._stat(h.path) for h in ckpt.files}
            index = build_model_index(ckpt, block_bytes=block_bytes, threads=threads, counter=self.index_reads,
                                      progress=progress)
            if anchor is not None:
                index = replace(index, content_hash=anchor.content_hash)
            self.builds += 1
            index = self._save_model(ckpt, index, stats)
        return ckpt, index

    def expert_index(self, path: str | Path, base: Checkpoint, base_index: ModelIndex, *,
                     threads: int = 2, progress: bool = False,
                     view: ModelView | None = None) -> tuple[Checkpoint, ModelIndex, DeltaIndex]:
        """An expert's ModelIndex and DeltaIndex against `base`, from the cache where possible;
        when neither is cached, both come from one scan (the expert is read once). `view`: the
        expert in the merge's vocabulary (checkpoint/vocab.py)."""
        anchor = None
        if base_index.embedding_block_bytes is not None:  # the plain index names the model
            anchor = self.model_index(path, block_bytes=base_index.block_bytes, threads=threads,
                                      progress=progress, base=(base, base_index), view=view)[1]
        ckpt = open_model(path, (base, base_index), view)
        index = self._cached_model(ckpt, base_index.layout, anchor)
        if index is not None:
            return ckpt, index, self.delta_index(base, base_index, ckpt, index, threads=threads, progress=progress)
        from mergepipe.index.build import build_expert_index
        stats = {h.path: self._stat(h.path) for h in ckpt.files}
        index, delta = build_expert_index(base, ckpt, base_index, block_bytes=base_index.layout,
                                          threads=threads, counter=self.index_reads, progress=progress)
        if anchor is not None:
            index = replace(index, content_hash=anchor.content_hash)
            delta = replace(delta, expert_hash=anchor.content_hash)
        self.builds += 1
        index = self._save_model(ckpt, index, stats)
        return ckpt, index, self._save_delta(self._delta_path(index, base_index), delta)

    def own_models(self, paths: dict[str, Path], *, block_bytes: int, threads: int = 2,
                   progress: bool = False) -> tuple[dict[str, Checkpoint], dict[str, str]]:
        """Each model of `paths` (name -> folder) as its own checkpoint, indexed (cached) in the
        plain layout of `block_bytes`, and its content hash: what names its vocabulary views
        (checkpoint/vocab.py) and orders the models in the output vocabulary."""
        donors, hashes = {}, {}
        for name, path in paths.items():
            donors[name], index = self.model_index(path, block_bytes=block_bytes, threads=threads, progress=progress)
            hashes[name] = index.content_hash
        return donors, hashes

    def _delta_path(self, expert_index: ModelIndex, base_index: ModelIndex) -> Path:
        return self.layout.delta(expert_index.content_hash, base_index.content_hash, expert_index.layout.key,
                                 DELTA_FORMAT)

    def delta_index(self, base: Checkpoint, base_index: ModelIndex, expert: Checkpoint, expert_index: ModelIndex,
                    *, threads: int = 2, progress: bool = False) -> DeltaIndex:
        path = self._delta_path(expert_index, base_index)
        cached = _read_index(path, binfmt.decode_delta)
        if cached is not None and _delta_matches(cached, base_index, expert_index):
            self.hits += 1
            return cached
        from mergepipe.index.build import build_delta_index
        delta = build_delta_index(base, expert, base_index, expert_index, threads=threads, counter=self.index_reads,
                                  progress=progress)
        self.builds += 1
        return self._save_delta(path, delta)

    @staticmethod
    def _save_delta(path: Path, delta: DeltaIndex) -> DeltaIndex:
        """Write `delta` to the cache; returns it as saved (decoded: columns)."""
        data = binfmt.encode_delta(delta)
        _atomic_write(path, data)
        return binfmt.decode_delta(data)
