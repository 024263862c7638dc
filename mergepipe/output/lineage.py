"""Lineage: which inputs of a merge are themselves mergepipe outputs, and the manifest link
that records it (docs/design.md, "Outputs and manifest").

An input is the output of merge M when its folder holds M's manifest.json (its
manifest_hash holds, schema 2) and its tensors hash, under M's block layout, to M's
`outputs.tensors`: compared tensor by tensor, so a re-sharded copy is still M's output.
The link is `{"manifest_hash": M's, "output_hash": output_hash(M)}`; a manifest records
`lineage` only when at least one input has a link, so merges of plain models keep their bytes.
"""
from __future__ import annotations

from pathlib import Path

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.safetensors import Checkpoint
from mergepipe.checkpoint.treehash import hash_weight_file, tensor_digest
from mergepipe.errors import CheckpointError, IntegrityError
from mergepipe.index.columns import DIGEST
from mergepipe.index.records import ModelIndex
from mergepipe.output.manifest import MANIFEST, MANIFEST_SCHEMA, load_manifest
from mergepipe.util.canonical import canonical_blake3


def output_hash(man: dict) -> str:
    """blake3 of the canonical JSON of `outputs.tensors` (name -> tensor hash): the merge's
    weights, whatever the files they are sharded into."""
    return canonical_blake3(man["outputs"]["tensors"])


def manifest_layout(man: dict) -> BlockLayout | None:
    """The block layout a manifest's tensor hashes are under, or None when its plan has none."""
    plan = man.get("plan")
    if not isinstance(plan, dict):
        return None
    bb, emb = plan.get("block_bytes"), plan.get("embedding_block_bytes")
    if type(bb) is not int or bb <= 0 or not (emb is None or (type(emb) is int and emb > 0)):
        return None
    return BlockLayout(bb, emb)


def folder_manifest(folder: Path) -> dict | None:
    """The schema-2 mergepipe manifest in `folder` whose hash holds, or None (none, damaged, edited)."""
    if not (folder / MANIFEST).is_file():
        return None
    try:
        man = load_manifest(folder)
    except IntegrityError:
        return None
    outputs = man.get("outputs")
    if man.get("schema") != MANIFEST_SCHEMA or not isinstance(outputs, dict) \
            or not isinstance(outputs.get("tensors"), dict) or manifest_layout(man) is None:
        return None
    return man


def tensor_hashes(ckpt: Checkpoint, layout: BlockLayout, index: ModelIndex | None = None) -> dict[str, str]:
    """Tensor name -> tree hash (checkpoint/treehash.py) under `layout`: from the index's block
    digests when it has that layout (nothing read), else by reading every weight file.

    Raises:
        CheckpointError: a weight file cannot be read or parsed.
    """
    if index is not None and index.layout == layout:
        cols = index.tensors
        digests, starts = bytes(cols.digests), cols.starts
        return {name: tensor_digest([digests[DIGEST * starts[i]:DIGEST * starts[i + 1]]]).hex()
                for i, name in enumerate(cols.names)}
    out: dict[str, str] = {}
    for h in ckpt.files:
        try:
            out.update(hash_weight_file(h.path, layout)[1])
        except OSError as e:
            raise CheckpointError(f"{h.path}: cannot read: {e.strerror}") from None
    return out


def is_output_of(man: dict, ckpt: Checkpoint, index: ModelIndex | None = None) -> bool:
    """Whether the checkpoint's tensors are exactly the ones manifest `man` records as its outputs."""
    layout = manifest_layout(man)
    return layout is not None and tensor_hashes(ckpt, layout, index) == man["outputs"]["tensors"]


def link_of(man: dict) -> dict:
    return {"manifest_hash": man["manifest_hash"], "output_hash": output_hash(man)}


def input_lineage(base: tuple[Checkpoint, ModelIndex], experts: dict[str, tuple[Checkpoint, ModelIndex]]) -> dict:
    """The manifest's `lineage` for these inputs: {"base": link, "experts": {name: link}}, each
    part only where that input is a mergepipe output; {} when none is."""
    def link(ckpt: Checkpoint, index: ModelIndex) -> dict | None:
        man = folder_manifest(ckpt.root)
        return link_of(man) if man is not None and is_output_of(man, ckpt, index) else None

    out: dict = {}
    base_link = link(*base)
    if base_link is not None:
        out["base"] = base_link
    expert_links = {name: lk for name, pair in experts.items() if (lk := link(*pair)) is not None}
    if expert_links:
        out["experts"] = expert_links
    return out
