"""Importance-weighted delta energy per block: the `calibrated` plan strategy's scores.

For a tensor W (rows x cols, 1-D tensors as rows x 1) with a factored diagonal Fisher of
the base, F_ij ~ rows_i * cols_j (mergepipe/calibrate/), the second-order loss change of
adding expert k's delta is ~ 1/2 sum_ij F_ij delta_ij^2; its share in block b is

    energy_kb = sum_{i in b} rows_i * sum_j cols_j * delta_ij^2

(index/kernels.py `weighted_energy`, fixed-order fp64). It needs the delta itself, so each
(expert, importance artifact) pair is scanned once, reading the expert and the base in
full, and cached by (expert content, base content, artifact hash, block size): a plan
that uses it reads no weights. Tensors the artifact does not cover get no entry; the
strategy decides what to do with them. A cache entry records the artifact it was made with
(so `gc` knows what references it) and the blake3 of its energies (so an entry edited in
place, still well-formed, is caught and rebuilt). No torch here (index layer).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from blake3 import blake3

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, CheckpointReader
from mergepipe.errors import IntegrityError
from mergepipe.index.cache import CacheLayout
from mergepipe.index.records import ModelIndex
from mergepipe.index.scan import _decode
from mergepipe.util.fs import atomic_write_bytes, canonical_json
from mergepipe.util.progress import Progress

WEIGHTED_FORMAT = 2  # 2: `artifact` and the `blake3` of the energies
Importance = dict[str, tuple[np.ndarray, np.ndarray]]  # tensor -> (rows fp32, cols fp32)
BlockEnergy = dict[str, list[float]]  # tensor -> energy per block (the index's ranges)


def covered_tensors(base: Checkpoint, base_index: ModelIndex, importance: Importance) -> set[str]:
    """The tensors `block_energies` gives energies for (a cache entry must have exactly these)."""
    return {name for name in base_index.tensors if name in importance
            and base.tensors[name].dtype in FLOAT_DTYPES and base.tensors[name].numel != 0}


def block_energies(base: Checkpoint, base_index: ModelIndex, expert: Checkpoint, importance: Importance, *,
                   counter=None, progress: Progress | None = None) -> BlockEnergy:
    """energy_kb for every block of every float tensor that `importance` covers; `progress`
    counts the base and expert bytes read."""
    out: BlockEnergy = {}
    covered = covered_tensors(base, base_index, importance)
    from mergepipe.index import kernels
    with CheckpointReader(base, counter=counter, random_access=False) as br, \
            CheckpointReader(expert, counter=counter, random_access=False) as er:
        for name, entry in base_index.tensors.items():
            t = base.tensors[name]
            if name not in covered:
                continue
            rows, cols = importance[name]
            energies = []
            for r0, r1 in entry.ranges:
                n = (r1 - r0) * cols.size
                b = _decode(br.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32))
                e = _decode(er.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32))
                energies.append(float(kernels.weighted_energy(b, e, rows[r0:r1], cols)))
                if progress:
                    progress.step(2 * n * t.itemsize)
            out[name] = energies
    return out


def cache_path(root: Path, expert_hash: str, base_hash: str, artifact: str, block_bytes: int | str) -> Path:
    """`block_bytes`: the index's `BlockLayout.key` (an int for the plain layout)."""
    key = blake3(f"{expert_hash}:{base_hash}:{artifact}:{block_bytes}:v{WEIGHTED_FORMAT}".encode()).hexdigest()[:40]
    return CacheLayout(root).weighted(key)


def load_cached(path: Path, base_index: ModelIndex) -> BlockEnergy | None:
    """A cached result, or None when absent; IntegrityError when it is not one of ours
    (a cache entry is untrusted: its energies must hash to its `blake3`, every tensor must
    be the base's, with one finite, non-negative energy per block)."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path}: unreadable calibrated-energy cache entry ({e}); delete it") from None
    # `key`: the entry's own name (its expert's, base's, artifact's and layout's hash), so an entry of
    # another expert copied under this one's key (same shapes, self-consistent) is rebuilt, never used
    ok = (isinstance(data, dict) and data.get("format") == WEIGHTED_FORMAT and data.get("key") == path.stem
          and isinstance(data.get("tensors"), dict))
    if ok:
        for name, values in data["tensors"].items():
            entry = base_index.tensors.get(name)
            ok = (entry is not None and isinstance(values, list) and len(values) == len(entry.ranges)
                  and all(isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                          for v in values))
            if not ok:
                break
    if ok and _digest(data["tensors"]) != data.get("blake3"):
        raise IntegrityError(f"{path}: calibrated energies do not match their recorded blake3; "
                             "damaged or edited; delete it")
    if not ok:
        raise IntegrityError(f"{path}: not a valid calibrated-energy cache entry; delete it")
    return {k: [float(v) for v in vs] for k, vs in data["tensors"].items()}


def _digest(energies: dict) -> str:
    return blake3(canonical_json(energies)).hexdigest()


def save(path: Path, energies: BlockEnergy, artifact: str) -> None:
    """`artifact`: the importance artifact's blake3 these energies were made with."""
    atomic_write_bytes(path, canonical_json({"format": WEIGHTED_FORMAT, "key": path.stem, "artifact": artifact,
                                             "tensors": energies, "blake3": _digest(energies)}))


def recorded_artifact(path: Path) -> str | None:
    """The artifact hash an entry records (gc's reference), or None for anything else."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    art = data.get("artifact") if isinstance(data, dict) else None
    return art if isinstance(art, str) else None
