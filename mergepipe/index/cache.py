"""The cache folder's layout, with one owner (as DVC's cache manager): which entry kinds
there are, the folder each lives in, the file name an entry of a key has, and the names
`gc` may recognise as mergepipe's. Every writer, reader and `gc` asks this module; no other
module joins a kind's folder onto a cache path (tests/test_cache_layout.py checks that).

An entry's key is computed by the module that owns the entry's format (it knows the format
version that goes into the key); this module turns the key into the path. Under `cache_dir`
(default `.mergepipe/`):

  stat/<key32>.json                  a file's stat -> its fingerprint        index/store.py
  models/<key40>.idx                 model index                             index/store.py
  deltas/<e32>-<b32>-<blocks>-v<N>.idx   delta index of expert e against base b  index/store.py
  merges/<plan_hash>/                a finished merge, `store.mac` beside its files  output/merge_store.py
  merges/<plan_hash>.partial-<hex12>/    a save in progress (renamed over the entry)
  parts/part-<I>-of-<N>.safetensors|.json   split-merge part files, when -o is this folder  commands/parts.py
  calibration/<key40>.safetensors    importance artifact                     calibrate/artifact.py
  weighted/<key40>.json              calibrated block energies               index/weighted.py
  joint/<key64>.stats                joint-method statistics                 engine/stats.py
  sketch/<key40>.sk                  ternary delta sketch                    index/sketch.py
  groupquant/<key40>.gq              k-bit group-quantized deltas            index/groupquant.py
  cuts/<key40>.cuts                  exact rank cuts off the index's grid    index/extra_cuts.py

`<blocks>` is `BlockLayout.key` with "/" as "-" (`16384` or `16384-emb4096`). A writer's temp
file is `.<entry name>.<random>.tmp` beside the entry (util/fs.atomic_write_bytes).

A new entry kind: a `Kind` here, added to `KINDS`, and a path method on `CacheLayout`; if gc
prunes it (a derived kind), its content check and its reference check in commands/gc.py
(`WRITTEN_BY_US`, `REFERENCED`). tests/test_cache_layout.py fails until each is there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kind:
    """One kind of cache entry: its folder under the cache and the names mergepipe gives its
    entries; only names that match `entry` are ever removed by `gc` (a cache_dir that is by
    mistake a project folder loses nothing of the user's)."""
    folder: str
    entry: re.Pattern[str]
    derived: bool = False  # rebuilt from what a plan names: gc keeps those a --keep output or plan references
    index: bool = False  # rebuilt by rereading the models: gc removes them only with --indexes
    folders: bool = False  # each entry is a folder (a stored merge), else a file
    pruned: bool = True  # gc visits this kind's folder; False: no plan records these entries yet, so no
    # --keep could name those still needed: gc leaves the folder alone


MERGES = Kind("merges", re.compile(r"[0-9a-f]{64}(\.partial-[0-9a-f]{12})?"), folders=True)
PARTS = Kind("parts", re.compile(r"part-\d+-of-\d+\.(safetensors|json)"))
CALIBRATION = Kind("calibration", re.compile(r"[0-9a-f]{40}\.safetensors"), derived=True)
WEIGHTED = Kind("weighted", re.compile(r"[0-9a-f]{40}\.json"), derived=True)
JOINT = Kind("joint", re.compile(r"[0-9a-f]{64}\.stats"), derived=True)
SKETCH = Kind("sketch", re.compile(r"[0-9a-f]{40}\.sk"), derived=True)
# .json.gz: an earlier index format, never read again (a miss) but still ours to remove
MODELS = Kind("models", re.compile(r"[0-9a-f]{40}\.(?:json\.gz|idx)"), index=True)
DELTAS = Kind("deltas", re.compile(r"[0-9a-f]{32}-[0-9a-f]{32}-\d+(?:-emb\d+)?-v\d+\.(?:json\.gz|idx)"), index=True)
STAT = Kind("stat", re.compile(r"[0-9a-f]{32}\.json"), index=True)
GROUPQUANT = Kind("groupquant", re.compile(r"[0-9a-f]{40}\.gq"), derived=True, pruned=False)
CUTS = Kind("cuts", re.compile(r"[0-9a-f]{40}\.cuts"), derived=True)

KINDS = (MERGES, PARTS, CALIBRATION, WEIGHTED, JOINT, SKETCH, MODELS, DELTAS, STAT, GROUPQUANT, CUTS)  # gc's order

STORE_MAC = "store.mac"  # in a stored merge's folder: its MAC (index/store_key.entry_mac)
JOINT_SUFFIX = ".stats"
_TEMP = re.compile(r"\.(.+)\.[0-9a-z_]+\.tmp")  # atomic_write_bytes's and the artifact writer's temp names


def temp_of(kind: Kind, name: str) -> bool:
    """`name` is a writer's temp file of one of `kind`'s entries."""
    m = _TEMP.fullmatch(name)
    return m is not None and kind.entry.fullmatch(m.group(1)) is not None


def part_stem(i: int, n: int) -> str:
    """The name (without suffix) of part i of n of a split merge, in whatever folder -o names."""
    return f"part-{i}-of-{n}"


def joint_key(name: str) -> str:
    """The statistics key a joint/ entry's name holds."""
    return name[:-len(JOINT_SUFFIX)] if name.endswith(JOINT_SUFFIX) else name


class CacheLayout:
    """Where each entry kind lives under `root` and what an entry of a key is called."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def folder(self, kind: Kind) -> Path:
        return self.root / kind.folder

    def stat(self, key: str) -> Path:
        return self.folder(STAT) / f"{key}.json"

    def model(self, key: str) -> Path:
        return self.folder(MODELS) / f"{key}.idx"

    def delta(self, expert_hash: str, base_hash: str, layout_key: int | str, version: int) -> Path:
        blocks = str(layout_key).replace("/", "-")
        return self.folder(DELTAS) / f"{expert_hash[:32]}-{base_hash[:32]}-{blocks}-v{version}.idx"

    def merge(self, plan_hash: str) -> Path:
        return self.folder(MERGES) / plan_hash

    def merge_staging(self, plan_hash: str, token: str) -> Path:
        """A save's own folder (`token`: 12 random hex digits), renamed over `merge(plan_hash)`."""
        return self.folder(MERGES) / f"{plan_hash}.partial-{token}"

    def calibration(self, key: str) -> Path:
        return self.folder(CALIBRATION) / f"{key}.safetensors"

    def weighted(self, key: str) -> Path:
        return self.folder(WEIGHTED) / f"{key}.json"

    def joint(self, key: str) -> Path:
        return self.folder(JOINT) / f"{key}{JOINT_SUFFIX}"

    def sketch(self, key: str) -> Path:
        return self.folder(SKETCH) / f"{key}.sk"

    def groupquant(self, key: str) -> Path:
        return self.folder(GROUPQUANT) / f"{key}.gq"

    def cuts(self, key: str) -> Path:
        return self.folder(CUTS) / f"{key}.cuts"
