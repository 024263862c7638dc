"""Manifest: what a merge read, computed and wrote, with hashes; and its checks
(`load_manifest`, `verify_outputs`).

Canonical JSON (util.fs.canonical_json: sorted keys, no timestamps, no host), so the
same inputs, config and version give a byte-identical manifest; `manifest_hash` is
blake3 of the canonical JSON without that field. Timings, host, cache statistics and
the stat keys of the published files go to the run record beside the folder
(output/run_record.py), outside the hash. The manifest
is written after the weights and aux files, into the publisher's temp folder, so a
published folder with a manifest is a finished merge.

Format note (kept for compatibility: changing it changes every manifest): the budget
is stored twice, as `budget.spec`/`budget.bytes` and inside `plan` as
`budget`/`budget_bytes`.
"""
from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from blake3 import blake3

from mergepipe import __version__
from mergepipe.checkpoint.json_files import strict_loads
from mergepipe.errors import IntegrityError
from mergepipe.output.manifest_json import pretty_json, write_pretty_json
from mergepipe.output.run_record import published_stat, stat_key
from mergepipe.util.canonical import canonical_blake3
from mergepipe.util.fs import hash_file

if TYPE_CHECKING:  # verify and the no-op run read manifests without pydantic or the plan
    from mergepipe.plan.record import PlanRecord

MANIFEST_SCHEMA = 2  # 2: weight files and tensors hashed as block trees (checkpoint/treehash.py)
MANIFEST = "manifest.json"
# The model-signing signature of the folder (commands/sign.py): it covers the manifest, so no
# manifest records it; the one file an output may hold unrecorded.
SIGNATURE = "model.sig"


def versions() -> dict[str, str]:
    return {"mergepipe": __version__, "torch": version("torch"), "safetensors": version("safetensors")}


def build_manifest(plan: PlanRecord, realized, aux_files: dict[str, str], *, lineage: dict | None = None) -> dict:
    """Args: the plan; engine.Realized; aux file name -> blake3 (config.json, README.md, ...);
    `lineage`: the links to inputs that are mergepipe outputs (output/lineage.py), recorded only
    when there is one, so a merge of plain models has the manifest it always had. The manifest
    holds the plan's JSON (plan_json), whose hash is plan_hash."""
    from mergepipe.plan.record import plan_json
    doc = plan_json(plan)
    planned = plan.bytes
    man = {
        "schema": MANIFEST_SCHEMA,
        "versions": versions(),
        "plan_hash": plan.plan_hash,
        "plan": doc,
        "inputs": {"base": doc["base"], "experts": doc["experts"]},
        "budget": {"spec": plan.budget, "bytes": plan.budget_bytes},
        "bytes": {
            "planned_expert_bytes": planned.planned_expert_bytes,
            "planned_by_expert": planned.planned_by_expert,
            "skipped_identical_by_expert": planned.skipped_identical_by_expert,
            "total_expert_bytes": planned.total_expert_bytes,
            "expert_bytes_read": sum(realized.expert_bytes_read.values()),
            "expert_bytes_read_by_expert": realized.expert_bytes_read,
            "base_bytes_read": realized.base_bytes_read,
            "base_bytes_copied": realized.base_bytes_copied,
            "bytes_written": realized.bytes_written,
        },
        "bound": doc["bound"],
        "outputs": {
            "files": {**realized.files, **{n: {"blake3": h} for n, h in aux_files.items()}},
            "tensors": realized.tensors,
        },
    }
    if planned.planned_sketch_bytes is not None:  # strategy sketch: sketches read in place of expert blocks
        man["bytes"]["planned_sketch_bytes"] = planned.planned_sketch_bytes
        man["bytes"]["sketch_bytes_read"] = realized.sketch_bytes_read
    if lineage:
        man["lineage"] = lineage
    man["manifest_hash"] = manifest_hash(man)
    return man


def manifest_hash(man: dict) -> str:
    # blake3(canonical_json(...)), without the whole text in memory (util/canonical.py)
    return canonical_blake3({k: v for k, v in man.items() if k != "manifest_hash"})


def dumps(man: dict) -> bytes:
    """canonical_json(man, indent=1), the same bytes (output/manifest_json.py: faster for
    a manifest of many tensors)."""
    return pretty_json(man, indent=1)


def write_manifest(path: Path, man: dict) -> None:
    """dumps(man) written to `path` a batch at a time (output/manifest_json.py)."""
    write_pretty_json(path, man, indent=1)


def load_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    try:
        man = strict_loads(path.read_text(encoding="utf-8"))  # what manifest_hash covers, read one way only
    except (FileNotFoundError, NotADirectoryError):
        raise IntegrityError(f"{path}: no manifest; this folder is not a finished mergepipe output") from None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read the manifest: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise IntegrityError(f"{path}: manifest is not valid JSON: {e}") from None
    if not isinstance(man, dict) or man.get("manifest_hash") != manifest_hash(man):
        raise IntegrityError(f"{path}: manifest_hash does not match its content (edited after the merge?)")
    return man


def verify_outputs(out_dir: str | Path, *, deep: bool = False) -> dict:
    """Check the outputs against the manifest; name the first bad tensor.

    Always: the manifest hash, and that exactly the recorded files are there. Each file is
    then rehashed (weight files: their hash tree recomposed from their blocks, every byte
    read), except, without `deep`, a file whose stat key (size, mtime_ns, ctime_ns, inode,
    device) is still the one the run record holds from when it was published: what run recorded
    stands (trusted through the stat key, as the index's stat cache is). `deep` rereads
    every file.

    Raises:
        IntegrityError: manifest edited, file missing/extra/changed.
    """
    out_dir = Path(out_dir)
    man = load_manifest(out_dir)
    outputs = man.get("outputs")
    files = outputs.get("files") if isinstance(outputs, dict) else None
    if (not isinstance(files, dict) or not isinstance(outputs.get("tensors"), dict)
            or not all(isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..") and isinstance(r, dict)
                       and (isinstance(r.get("blake3"), str) or isinstance(r.get("tree"), str))
                       for n, r in files.items())):
        # a consistent manifest_hash but no mergepipe structure: forged, not edited
        raise IntegrityError(f"{out_dir / MANIFEST}: outputs.files/tensors malformed; not a mergepipe manifest")
    present = {p.name for p in out_dir.iterdir() if p.is_file()} - {MANIFEST, SIGNATURE}
    extra = sorted(present - set(files))
    if extra:
        raise IntegrityError(f"{out_dir / extra[0]}: file not recorded in the manifest")
    recorded = {} if deep else published_stat(out_dir)
    for name, rec in sorted(files.items()):
        path = out_dir / name
        if not path.is_file():
            raise IntegrityError(f"{path}: missing (recorded in the manifest)")
        if name in recorded and stat_key(path) == recorded[name] \
                and stat_key(out_dir / MANIFEST) == recorded[MANIFEST]:
            continue  # as published (and the manifest too): what run recorded stands
        if isinstance(rec.get("tree"), str):
            _check_tree(path, rec, man)
        elif hash_file(path) != rec["blake3"]:
            if not name.endswith(".safetensors"):  # config, tokenizer, card, index json: never parsed as weights
                raise IntegrityError(f"{path}: edited since it was published (its blake3 is not the manifest's)")
            raise IntegrityError(f"{path}: {_first_bad_tensor(path, man)} does not match the manifest")
    return man


def refuse_other_replay(out_dir: Path, recorded: dict, again: dict) -> None:
    """A replay's manifest `again` records the outputs `recorded` records, else the error names
    each file whose record differs (a folder whose files are all weights or all small records).

    Raises:
        IntegrityError: naming the output folder and the differing files.
    """
    if again["outputs"] == recorded["outputs"]:
        return
    ours, theirs = again["outputs"]["files"], recorded["outputs"]["files"]
    bad = sorted(n for n in {*ours, *theirs} if ours.get(n) != theirs.get(n))
    raise IntegrityError(f"{out_dir}: replay produced different outputs: {', '.join(bad)}")


def replaced_weight_file(out_dir: Path, man: dict) -> str | None:
    """The first weight file the manifest records that is not the one mergepipe published
    there (a user's weights under a copied manifest, a shard replaced by another file), or None.
    A file at the inode and size the run record holds is ours even if its bytes changed (a flipped
    byte: damage, which a rebuild repairs); any other is ours only if it matches the manifest
    (a folder restored by DVC or copied, without its run record). Missing files and links are
    not checked:
    replacing the folder loses neither."""
    recorded = published_stat(out_dir)
    for name, rec in sorted(man["outputs"]["files"].items()):
        path = out_dir / name
        if not (isinstance(rec, dict) and isinstance(rec.get("tree"), str)) or path.is_symlink() or not path.is_file():
            continue
        key, st = recorded.get(name), os.stat(path)
        if isinstance(key, list) and len(key) == 5 and [st.st_size, st.st_ino, st.st_dev] == [key[0], key[3], key[4]]:
            continue
        try:
            _check_tree(path, rec, man)
        except IntegrityError:
            return name
    return None


def _check_tree(path: Path, rec: dict, man: dict) -> None:
    """A weight file: size, then its hash tree recomposed from every block, against the manifest."""
    from mergepipe.checkpoint.safetensors import CheckpointError
    from mergepipe.checkpoint.blocks import BlockLayout
    from mergepipe.checkpoint.treehash import hash_weight_file
    block_bytes = man.get("plan", {}).get("block_bytes") if isinstance(man.get("plan"), dict) else None
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0:
        raise IntegrityError(f"{path}: manifest has no valid plan block_bytes; not a mergepipe manifest")
    emb = man["plan"].get("embedding_block_bytes")  # only in plans with vocabulary blocks (BlockLayout)
    if emb is not None and (not isinstance(emb, int) or isinstance(emb, bool) or emb <= 0):
        raise IntegrityError(f"{path}: manifest has an invalid plan embedding_block_bytes; not a mergepipe manifest")
    if "size" in rec and path.stat().st_size != rec["size"]:
        raise IntegrityError(f"{path}: size {path.stat().st_size} does not match the manifest ({rec['size']})")
    try:
        digest, tensors = hash_weight_file(path, BlockLayout(block_bytes, emb))
    except CheckpointError as e:
        raise IntegrityError(f"{path}: header ({e}) does not match the manifest") from None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot read: {e}") from None
    if digest != rec["tree"]:
        want = man["outputs"]["tensors"]
        bad = next((n for n, h in tensors.items() if want.get(n) != h), None)
        what = f"tensor {bad!r}" if bad is not None else "header or padding"
        raise IntegrityError(f"{path}: {what} does not match the manifest")


def _first_bad_tensor(path: Path, man: dict) -> str:
    # Imported here: naming the tensor is the rare path, and manifest otherwise needs no weights layer.
    from mergepipe.checkpoint.safetensors import CheckpointError, CheckpointReader, open_checkpoint
    try:
        ckpt = open_checkpoint(path)
    except CheckpointError as e:
        return f"header ({e})"
    with CheckpointReader(ckpt, random_access=False) as r:
        for name, t in ckpt.tensors.items():
            want = man["outputs"]["tensors"].get(name)
            if want is None:
                return f"tensor {name!r} (not in manifest)"
            if blake3(r.read_range(t, t.begin, t.end)).hexdigest() != want:
                return f"tensor {name!r}"
    return "header or padding"
