"""Where `mergepipe audit` finds a manifest's inputs: model folders identified by content hash
(index/records.py::content_hash, sharding-independent), whatever their name or sharding.

Candidates, in this order: the path the plan records; the local Hugging Face cache's
snapshots of the Hub id that path names (`.../models--org--name/snapshots/<rev>`, or an id
`org/name`); every model folder (config.json and a *.safetensors file) under the `--search`
folders, recursively; every snapshot in the Hugging Face cache. Each is indexed through the
given Store (the project's content-addressed cache, keyed by the files' stat), so a second
audit does not reread them. The output folder being audited is never a candidate.
Reads only: nothing here writes outside the Store.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.lora import is_adapter
from mergepipe.checkpoint.safetensors import Checkpoint, open_checkpoint
from mergepipe.config.hf_cache import hub_cache, looks_like_hub_id
from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.index.records import ModelIndex
from mergepipe.index.store import Store
from mergepipe.output.lineage import folder_manifest
from mergepipe.output.manifest import MANIFEST

_HUB_PATH = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def hub_id_of(path: str) -> str | None:
    """The Hub id a recorded input path names: a Hugging Face cache snapshot folder's repo, or
    the path itself when it is an id `org/name`; else None."""
    m = _HUB_PATH.search(path.replace(os.sep, "/"))
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    return path if looks_like_hub_id(path) else None


def is_model_folder(folder: Path) -> bool:
    try:
        return (folder / "config.json").is_file() and any(
            p.name.endswith(".safetensors") and p.is_file() for p in folder.iterdir())
    except OSError:
        return False


def folders(root: Path) -> Iterator[Path]:
    """`root` and every folder under it, in name order; a linked folder is followed once."""
    seen: set[str] = set()
    stack = [root]
    while stack:
        folder = stack.pop()
        real = os.path.realpath(folder)
        if real in seen:
            continue
        seen.add(real)
        yield folder
        try:
            subs = sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True)
        except OSError:
            continue
        stack.extend(subs)


def model_folders(root: Path) -> Iterator[Path]:
    """Model folders and LoRA adapter folders (an expert of a base) under `root`."""
    return (f for f in folders(root) if is_model_folder(f) or is_adapter(f))


def hub_snapshots(model_id: str) -> list[Path]:
    """Every cached snapshot folder of `model_id`, the one refs/main names first."""
    repo = hub_cache() / ("models--" + model_id.replace("/", "--"))
    try:
        found = sorted(p for p in (repo / "snapshots").iterdir() if p.is_dir())
    except OSError:
        return []
    try:
        main = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    return sorted(found, key=lambda p: p.name != main)


def all_hub_snapshots() -> list[Path]:
    try:
        repos = sorted(p for p in hub_cache().iterdir() if p.name.startswith("models--"))
    except OSError:
        return []
    return [s for r in repos for s in hub_snapshots(r.name[len("models--"):].replace("--", "/", 1))]


@dataclass(frozen=True, slots=True)
class Found:
    folder: Path
    how: str  # "recorded path", "Hub id org/name", "--search DIR", "Hugging Face cache"


@dataclass
class Finder:
    """Finds inputs by content hash among the candidates; remembers what it indexed."""

    store: Store
    search: list[Path]
    exclude: list[Path]
    threads: int = 2
    indexed: dict[str, str] = field(default_factory=dict)  # real path -> content hash (for the report)
    _hashes: dict[tuple[str, int], str | None] = field(default_factory=dict)
    _searched: list[tuple[Path, str]] | None = None

    def searched(self) -> list[tuple[Path, str]]:
        """(model folder, how) under the --search folders, walked once."""
        if self._searched is None:
            self._searched = [(f, f"--search {d}") for d in self.search for f in model_folders(d)]
        return self._searched

    def candidates(self, recorded: str) -> Iterator[tuple[Path, str]]:
        hub_id = hub_id_of(recorded)
        yield Path(recorded).expanduser(), "recorded path"
        if hub_id is not None:
            yield from ((s, f"Hub id {hub_id}") for s in hub_snapshots(hub_id))
        yield from self.searched()
        yield from ((s, "Hugging Face cache") for s in all_hub_snapshots())

    def content_hash(self, folder: Path, block_bytes: int,
                     base: tuple[Checkpoint, ModelIndex] | None = None) -> str | None:
        """The folder's content hash (cached in the Store), or None when it is not a readable
        checkpoint; a LoRA adapter folder's is that of the expert it makes of `base` (None without one)."""
        key = (os.path.realpath(folder), block_bytes, None if base is None else base[1].content_hash)
        if key not in self._hashes:
            try:
                _, index = self.store.model_index(folder, block_bytes=block_bytes, threads=self.threads, base=base)
                self._hashes[key] = self.indexed[key[0]] = index.content_hash
            except (CheckpointError, ConfigError, OSError):  # ConfigError: an adapter not of this base
                self._hashes[key] = None
        return self._hashes[key]

    def find(self, content_hash: str, recorded: str, layout: BlockLayout, *,
             like: Checkpoint | None = None, base: tuple[Checkpoint, ModelIndex] | None = None) -> Found | None:
        """The first candidate with this content hash. `like`: an input already found; the
        inputs of one merge share tensor names, dtypes and shapes, so a candidate whose headers
        differ from its is skipped without reading its weights. `base`: the merge's base, found,
        of which an adapter folder is an expert (it has no headers of its own to compare)."""
        excluded = {os.path.realpath(p) for p in self.exclude}
        tried: set[str] = set()
        for folder, how in self.candidates(recorded):
            real = os.path.realpath(folder)
            if real in tried or real in excluded or not folder.is_dir():
                continue
            tried.add(real)
            if like is not None and not is_adapter(folder) and not _same_tensors(folder, like):
                continue
            if self.content_hash(folder, layout.block_bytes, base) == content_hash:
                return Found(folder, how)
        return None

    def holding(self, names: list[str]) -> Iterator[Path]:
        """Folders under the --search folders that hold files of all these names."""
        for d in self.search:
            yield from (f for f in folders(d) if all((f / n).is_file() for n in names))

    def manifest(self, manifest_hash: str, first: Path | None = None) -> tuple[Path, dict] | None:
        """A folder holding the mergepipe manifest with this hash: `first` if it does, else a
        searched folder (a merge's output, wherever it was copied)."""
        folders = [first] if first is not None else []
        folders += [f for d in self.search for f in _manifest_folders(d)]
        for folder in folders:
            man = folder_manifest(folder)
            if man is not None and man["manifest_hash"] == manifest_hash:
                return folder, man
        return None


def _manifest_folders(root: Path) -> Iterator[Path]:
    return (f for f in model_folders(root) if (f / MANIFEST).is_file())


def _same_tensors(folder: Path, like: Checkpoint) -> bool:
    try:
        ckpt = open_checkpoint(folder)
    except (CheckpointError, OSError):
        return False
    if len(ckpt.tensors) != len(like.tensors):
        return False
    for name, t in ckpt.tensors.items():
        other = like.tensors.get(name)
        if other is None or (other.dtype, tuple(other.shape)) != (t.dtype, tuple(t.shape)):
            return False
    return True

