"""What a `calibrated` plan scores with: the importance artifact of the base on the
calibration text (made once, mergepipe/calibrate/) and each expert's importance-weighted
block energies (one scan per expert and artifact, index/weighted.py), both cached in
the store by content; a cache entry that is damaged, made from other inputs or missing
tensors is rebuilt. Returns the `calibration` mapping `planner.make_plan` takes."""
from __future__ import annotations

from pathlib import Path

from mergepipe.calibrate import artifact
from mergepipe.calibrate.fisher import read_calibration_text
from mergepipe.checkpoint.safetensors import Checkpoint
from mergepipe.errors import IntegrityError
from mergepipe.index import weighted
from mergepipe.index.records import ModelIndex
from mergepipe.index.store import Store, cache_write_error
from mergepipe.util.progress import Progress

RECIPE = "fisher-rank1"


def _cache_write(path: Path, write, *args) -> None:
    """`write(path, *args)`, an OSError (disk full, file-size limit, calibration/ or weighted/ not a
    folder) the store's one line naming the entry."""
    try:
        write(path, *args)
    except OSError as e:
        raise cache_write_error(path, e) from None


def calibration_inputs(options: dict, text_path: Path, store: Store, base: Checkpoint, base_index: ModelIndex,
                       experts: dict[str, tuple[Checkpoint, ModelIndex]], *, progress: bool = False,
                       quiet: bool = False) -> dict:
    """{artifact, text, energies: expert name -> tensor -> [energy per block]}."""
    recipe = {"kind": RECIPE, "max_tokens": options["max_tokens"], "seq_len": options["seq_len"]}
    # hashed whole, kept only as far as max_tokens can reach (a token of 256 characters is absurd)
    text, text_hash = read_calibration_text(text_path, keep_chars=256 * recipe["max_tokens"] + 4096)
    # keyed by the base's content hash, which is the plain layout's in every layout
    # (index/store.py), so a layout with vocabulary blocks reuses the artifact
    path = artifact.artifact_path(store.root, base_index.content_hash, text_hash, recipe)
    # `key`: the file records its own key, so an artifact of another recipe (max_tokens, seq_len)
    # copied under this one's name is rebuilt (base and text alone do not pin the recipe)
    meta = {"base": base_index.content_hash, "text": text_hash, "recipe": RECIPE, "key": path.stem}
    try:
        importance = artifact.load(path, base, expect=meta) if path.exists() else None
    except IntegrityError:
        importance = None  # damaged or another inputs' file: the store is untrusted, rebuilt (design.md)
    if importance is None:
        from mergepipe.calibrate.fisher import fisher
        importance, extra = fisher(base, text, max_tokens=recipe["max_tokens"], seq_len=recipe["seq_len"],
                                   progress=progress, quiet=quiet)
        # the artifact's blake3 goes into the plan, so its bytes must be a function of its
        # inputs only: the pass's wall time (fisher's "seconds") is not written into it
        _cache_write(path, artifact.save, importance, {**meta, **{k: v for k, v in extra.items() if k != "seconds"}})
        importance = artifact.load(path, base, expect=meta)
    art_hash = artifact.artifact_hash(path)
    covered = weighted.covered_tensors(base, base_index, importance)
    energies = {}
    for name, (ckpt, index) in sorted(experts.items()):
        cache = weighted.cache_path(store.root, index.content_hash, base_index.content_hash, art_hash,
                                    base_index.layout.key)
        try:
            found = weighted.load_cached(cache, base_index)
        except IntegrityError:
            found = None  # damaged: rebuilt
        if found is None or set(found) != covered:  # (an entry missing tensors would rank them last)
            total = 2 * sum(base.tensors[n].nbytes for n in covered)
            with Progress(total, f"scoring {name}", progress) as prog:
                found = weighted.block_energies(base, base_index, ckpt, importance, counter=store.index_reads,
                                                progress=prog)
            _cache_write(cache, weighted.save, found, art_hash)
        energies[name] = found
    return {"artifact": art_hash, "text": text_hash, "energies": energies}
