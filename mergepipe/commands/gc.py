"""`mergepipe gc`: prune the cache folder (default `.mergepipe/`).

What it may remove:
  merges/<plan_hash>/   finished merges kept so that an earlier plan is restored, not recomputed;
                        those referenced by a `--keep` output folder or plan.json stay
  merges/*.partial      store entries a dead process left half written
  parts/                part files of split merges (a finished gather no longer needs them)
  models/ deltas/ stat/ indexes, only with `indexes=True` (they are rebuilt by rereading the models)
Published outputs are separate hardlinks, so removing a store entry never touches them;
the bytes a removal frees are those of files with no other link.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import ConfigError, OutputError
from mergepipe.output.manifest import MANIFEST


@dataclass
class Removal:
    path: Path
    freed: int  # bytes of files with no other hardlink


def plan_hash_of(path: str | Path) -> str:
    """The plan hash recorded by an output folder (its manifest) or a plan.json."""
    p = Path(path)
    src = p / MANIFEST if p.is_dir() else p
    try:
        h = json.loads(src.read_text()).get("plan_hash")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: --keep needs an output folder or a plan.json ({e})") from None
    if not isinstance(h, str):
        raise ConfigError(f"{src}: no plan_hash; --keep needs an output folder or a plan.json")
    return h


def _freed(path: Path) -> int:
    try:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
        return sum(st.st_size for st in (p.stat() for p in files) if st.st_nlink == 1)
    except FileNotFoundError:
        return 0  # removed meanwhile by another process (a second gc)


# Only names mergepipe gives its own cache entries are ever removed: a --cache-dir that is by
# mistake a project folder (its models/, parts/ or merges/ the user's) loses nothing.
_OURS = {
    "merges": re.compile(r"[0-9a-f]{64}(\.partial-[0-9a-f]{12})?"),
    "parts": re.compile(r"part-\d+-of-\d+\.(safetensors|json)"),
    "models": re.compile(r"[0-9a-f]{40}\.(?:json\.gz|idx)"),
    "deltas": re.compile(r"[0-9a-f]{32}-[0-9a-f]{32}-\d+(?:-emb\d+)?-v\d+\.(?:json\.gz|idx)"),
    "stat": re.compile(r"[0-9a-f]{32}\.json"),
}


def collect(cache_dir: str | Path, keep: set[str], *, indexes: bool = False) -> list[Removal]:
    """What gc would remove, in a stable order: store entries, part files and (with `indexes`)
    index files, each recognised by its own name pattern; anything else is left alone."""
    root = Path(cache_dir)
    victims: list[Path] = []
    for sub in ["merges", "parts", *(["models", "deltas", "stat"] if indexes else [])]:
        folder = root / sub
        if not folder.is_dir() or folder.is_symlink():
            continue
        victims += [p for p in sorted(folder.iterdir())
                    if _OURS[sub].fullmatch(p.name) and p.name not in keep and not p.is_symlink()
                    and (p.is_dir() if sub == "merges" else p.is_file())]
    return [Removal(p, _freed(p)) for p in victims]


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
