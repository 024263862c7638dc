"""Tampering and corruption (issue 5).

- a flipped byte in any planned expert block, or in the base, aborts the merge with the
  tensor named (blake3 of every block read is checked against the index);
- a flipped byte anywhere in a published output (header, data, aux files, manifest) is
  found by `mergepipe verify`; a manifest edited in any field fails its manifest_hash;
- an input changed after indexing (same path) is re-indexed, never merged with the stale
  index; one changed with its mtime forged is caught when read, or by `verify --inputs`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.output.manifest import MANIFEST, dumps, load_manifest, manifest_hash
from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.index.store import Store
from mergepipe.output.run_record import record_path
from tests.corpus.procs import leftovers, params
from tests.helpers import write_config

BB = 16 << 10


@pytest.fixture
def fam(tiny_family, tmp_path) -> dict:
    """The tiny family with private copies of the base and expert_0 (sharded) and expert_1."""
    root = Path(tiny_family["root"])
    for name in ("base", "expert_0", "expert_1"):
        shutil.copytree(root / name, tmp_path / name)
    return {"base": tmp_path / "base",
            "experts": [tmp_path / "expert_0", tmp_path / "expert_1", root / "expert_2"]}


def flip(path: Path, offset: int, *, hide: bool = True) -> None:
    """XOR one byte in place; with hide, keep size, mtime and inode (the stat cache cannot see it)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
    if hide:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _run(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err


def _planned_blocks(tmp_path: Path, cfg: Path, fam: dict) -> list[tuple[Path, str, int, int]]:
    """(model folder, tensor, byte begin, byte end) of every planned expert block and every base block."""
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    store = Store(tmp_path / "cache")
    by_name = {e["name"]: Path(e["path"]) for e in plan["experts"]}
    out = []
    for ename, reads in plan["reads"].items():
        ckpt, index = store.model_index(by_name[ename], block_bytes=BB)
        for tensor, blocks in reads.items():
            t = ckpt.tensors[tensor]
            for b in blocks:
                r0, r1 = index.tensors[tensor].ranges[b]
                out.append((by_name[ename], tensor, t.begin + r0 * t.row_bytes(), t.begin + r1 * t.row_bytes()))
    out += _base_blocks(store, plan, fam, read=True)
    return out


def _base_blocks(store: Store, plan: dict, fam: dict, *, read: bool) -> list[tuple[Path, str, int, int]]:
    """The base blocks the merge reads (some expert block planned there), or, with read=False,
    those it copies file to file (none planned: the output keeps the base's bytes)."""
    ckpt, index = store.model_index(fam["base"], block_bytes=BB)
    out = []
    for tensor, entry in index.tensors.items():
        t = ckpt.tensors[tensor]
        planned = set().union(*(r.get(tensor, ()) for r in plan["reads"].values()))
        for b, (r0, r1) in enumerate(entry.ranges):
            if (b in planned) == read and r1 > r0:
                out.append((fam["base"], tensor, t.begin + r0 * t.row_bytes(), t.begin + r1 * t.row_bytes()))
    return out


def forge_stat_cache(cache: Path, path: Path) -> None:
    """Make the stat cache believe `path` is unchanged (as a file changed while a merge reads it,
    or a file system without ctime, would): an in-place edit otherwise changes ctime and is re-indexed."""
    for entry in (cache / "stat").glob("*.json"):
        rec = json.loads(entry.read_text())
        if rec["stat"]["path"] == str(path.resolve()):
            rec["stat"] = Store._stat(path)
            entry.write_text(json.dumps(rec, sort_keys=True))


def test_flipped_byte_in_a_read_block_aborts_naming_the_tensor(fam, tmp_path, capsys):
    """12 random positions in planned expert blocks and the base blocks read with them (first,
    last, middle bytes), with the stat cache forged to miss the edit: the blocks read are
    checked against the index."""
    target = tmp_path / "pub" / "out"
    cfg = params(tmp_path / "p.yaml", fam, target, tmp_path / "cache", budget="50%")
    blocks = _planned_blocks(tmp_path, cfg, fam)
    rng = random.Random(11)
    experts = [b for b in blocks if b[0] != fam["base"] and b[0] != fam["experts"][2]]
    base = [b for b in blocks if b[0] == fam["base"]]
    picks = rng.sample(experts, 8) + rng.sample(base, 4)
    for i, (model, tensor, begin, end) in enumerate(picks):
        t = open_checkpoint(model).tensors[tensor]
        offset = [begin, end - 1, rng.randrange(begin, end)][i % 3]
        flip(t.file, offset)
        forge_stat_cache(tmp_path / "cache", t.file)
        rc, err = _run(["run", str(cfg), "-q"], capsys)
        assert rc == 6, err
        assert err.count("\n") == 1 and str(t.file) in err and repr(tensor) in err, err
        assert not target.exists() and leftovers(target) == []
        flip(t.file, offset)  # put it back: the next run merges cleanly from the same index
        forge_stat_cache(tmp_path / "cache", t.file)
    assert main(["run", str(cfg), "-q"]) == 0


@pytest.fixture
def published_out(tiny_family, tiny_cache, tmp_path) -> Path:
    """A published merge, copied (the store keeps hard links to what it publishes)."""
    root = Path(tiny_family["root"])
    family = {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}
    cfg = params(tmp_path / "p.yaml", family, tmp_path / "first", tiny_cache, budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    shutil.copytree(tmp_path / "first", tmp_path / "out")
    return tmp_path / "out"


def test_every_flipped_byte_in_an_output_is_detected(published_out, capsys):
    """64 random positions in the model file (16 in the header, 48 in the data) plus 8 in the
    aux files and the manifest: `verify` fails on every one and names the tensor where it can."""
    out = published_out
    model = out / "model.safetensors"
    ckpt = open_checkpoint(model)
    header_end = ckpt.files[0].data_start
    rng = random.Random(12)
    positions = [(model, rng.randrange(0, header_end)) for _ in range(16)]
    positions += [(model, rng.randrange(header_end, model.stat().st_size)) for _ in range(48)]
    aux = sorted(p for p in out.iterdir() if p.name != "model.safetensors")
    positions += [(p, rng.randrange(0, p.stat().st_size)) for p in rng.choices(aux, k=8)]
    assert main(["verify", str(out)]) == 0
    detected = named = 0
    for path, offset in positions:
        flip(path, offset, hide=False)
        rc, err = _run(["verify", str(out)], capsys)
        flip(path, offset, hide=False)
        assert rc == 6 and err.count("\n") == 1 and "Traceback" not in err, (path.name, offset, err)
        detected += 1
        if path == model and offset >= header_end:
            owner = next(t.name for t in ckpt.tensors.values() if t.begin <= offset < t.end)
            assert f"tensor {owner!r}" in err, (offset, owner, err)
            named += 1
        elif path.name == MANIFEST:
            assert "manifest" in err
    assert (detected, named) == (72, 48)
    assert main(["verify", str(out)]) == 0  # everything put back


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1e-9
    if isinstance(value, str):
        return value[:-1] + ("0" if value[-1:] != "0" else "1")
    return 0


def test_manifest_edited_in_any_field_fails(published_out, capsys):
    """Every top-level field, and 60 random leaves: changed, deleted, or a new key added."""
    out = published_out
    original = (out / MANIFEST).read_bytes()
    man = json.loads(original)
    leaves = [p for p, _ in _leaves(man) if p != ("manifest_hash",)]
    rng = random.Random(13)
    picks = [p for p in leaves if len(p) == 1] + rng.sample(leaves, 60)
    edits = 0
    for i, path in enumerate(picks + [None, ("__extra__",)]):
        edited = json.loads(original)
        if path is None:
            edited["manifest_hash"] = _changed(edited["manifest_hash"])
        elif path == ("__extra__",):
            edited["outputs"]["note"] = "added"
        else:
            node = edited
            for k in path[:-1]:
                node = node[k]
            if i % 5 == 4 and isinstance(node, dict):
                del node[path[-1]]
            else:
                node[path[-1]] = _changed(node[path[-1]])
        (out / MANIFEST).write_text(json.dumps(edited, indent=1, sort_keys=True))
        rc, err = _run(["verify", str(out)], capsys)
        assert rc == 6 and "manifest_hash" in err and err.count("\n") == 1, (path, err)
        edits += 1
    (out / MANIFEST).write_bytes(original)
    assert main(["verify", str(out)]) == 0
    assert edits >= 60


def test_forged_manifest_is_caught_by_replay(published_out, capsys):
    """manifest_hash is a checksum, not a signature: someone who rewrites a tensor AND recomputes
    every hash in the manifest passes a plain `verify`; `verify --replay` rebuilds from the inputs
    and catches it. (Compare manifest_hash against a trusted copy to detect this without a replay.)"""
    out = published_out
    model = out / "model.safetensors"
    ckpt = open_checkpoint(model)
    t = ckpt.tensors["model.norm.weight"]
    flip(model, t.begin + 1, hide=False)
    man = json.loads((out / MANIFEST).read_text())
    from mergepipe.checkpoint.treehash import hash_weight_file
    digest, tensors = hash_weight_file(model, man["plan"]["block_bytes"])
    man["outputs"]["files"]["model.safetensors"]["tree"] = digest
    man["outputs"]["tensors"][t.name] = tensors[t.name]
    man["manifest_hash"] = manifest_hash(man)
    (out / MANIFEST).write_bytes(dumps(man))
    assert main(["verify", str(out), "-q"]) == 0
    rc, err = _run(["verify", str(out), "--replay"], capsys)
    assert rc == 6 and "replay produced different outputs" in err and repr(t.name) in err, err


def test_input_changed_after_indexing_is_reindexed(fam, tmp_path, capsys):
    """Same path, new content: an ordinary write (new mtime) and a replacement by rename with the
    old mtime forged (new inode) are both re-indexed; the output equals a fresh-cache merge."""
    cfg = params(tmp_path / "p.yaml", fam, tmp_path / "out", tmp_path / "cache")
    assert main(["run", str(cfg), "-q"]) == 0
    first = load_manifest(tmp_path / "out")
    victim = fam["experts"][1] / "model.safetensors"
    t = open_checkpoint(victim).tensors["model.layers.2.mlp.up_proj.weight"]
    for how in ("write", "rename"):
        if how == "write":
            flip(victim, t.begin + 10, hide=False)
            os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
        else:
            st = victim.stat()
            data = bytearray(victim.read_bytes())
            data[t.begin + 20] ^= 0x33
            (victim.parent / "new").write_bytes(bytes(data))
            os.replace(victim.parent / "new", victim)
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert main(["run", str(cfg), "-q"]) == 0
        now = load_manifest(tmp_path / "out")
        assert json.loads(record_path(tmp_path / "out").read_text())["index_builds"] >= 1
        assert now["inputs"] != first["inputs"] and now["outputs"] != first["outputs"]
        first = now
    fresh = params(tmp_path / "fresh.yaml", fam, tmp_path / "fresh", tmp_path / "cache-fresh")
    assert main(["run", str(fresh), "-q"]) == 0
    assert load_manifest(tmp_path / "fresh")["outputs"] == now["outputs"]


def test_forged_mtime_on_an_unread_block_is_caught_by_verify_inputs(fam, tmp_path, capsys):
    """An in-place edit with size, mtime and inode kept, made after the merge, in a block the plan
    skips: `verify --inputs` rehashes every input and names it (and the next `run`, which sees the
    new ctime, re-indexes: test_in_place_edit_with_mtime_restored_is_reindexed)."""
    cfg = params(tmp_path / "p.yaml", fam, tmp_path / "out", tmp_path / "cache", budget="10%")
    blocks = _planned_blocks(tmp_path, cfg, fam)
    victim_model = fam["experts"][1]
    planned = {(m, t, b) for m, t, b, _ in blocks if m == victim_model}
    ckpt = open_checkpoint(victim_model)
    store = Store(tmp_path / "cache")
    _, index = store.model_index(victim_model, block_bytes=BB)
    unread = next((name, r) for name, e in index.tensors.items() for r in e.ranges
                  if (victim_model, name, ckpt.tensors[name].begin + r[0] * ckpt.tensors[name].row_bytes())
                  not in planned and ckpt.tensors[name].dtype == "BF16" and r[1] > r[0])
    t = ckpt.tensors[unread[0]]
    assert main(["run", str(cfg), "-q"]) == 0
    flip(t.file, t.begin + unread[1][0] * t.row_bytes())
    rc, err = _run(["verify", str(tmp_path / "out"), "--inputs"], capsys)
    assert rc != 0 and str(victim_model) in err and err.count("\n") == 1, err


@pytest.mark.parametrize("recompute", [False, True])
def test_poisoned_index_cache_is_caught(fam, tmp_path, capsys, recompute):
    """A cache entry rewritten with a wrong block hash, well-formed (checksum resealed): with its
    content hash left as it was, the store finds that the block hashes do not give it and
    rebuilds the index (the merge is right); with the content hash recomputed too (a consistent
    lie), the block hashes no longer give the file fingerprints the stat cache recorded, so it
    is rebuilt too (before pass 7 the merge read the block and aborted naming the tensor)."""
    from mergepipe.index import binfmt
    from mergepipe.index.records import ModelIndex, TensorEntry, content_hash
    cfg = params(tmp_path / "p.yaml", fam, tmp_path / "out", tmp_path / "cache")
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    base_hash = json.loads((tmp_path / "plan.json").read_text())["base"]["content_hash"]
    for entry in (tmp_path / "cache" / "models").glob("*.idx"):
        idx = binfmt.decode_model(entry.read_bytes())
        if idx.content_hash == base_hash:
            first = next(iter(idx.tensors.values()))
            tensors = {**idx.tensors, first.name: TensorEntry(first.name, first.dtype, first.shape, first.ranges,
                                                              ("0" * 64,) + first.hashes[1:])}
            entry.write_bytes(binfmt.encode_model(ModelIndex(content_hash(tensors) if recompute else idx.content_hash,
                                                             idx.block_bytes, tensors)))
            victim = first.name
    assert victim
    rc, err = _run(["run", str(cfg), "-q"], capsys)
    assert rc == 0, err
    assert json.loads(record_path(tmp_path / "out").read_text())["index_builds"] >= 1
    assert main(["verify", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("forge", ["no outputs", "files a list", "file outside", "no blake3", "tensors missing"])
def test_forged_manifest_structure_is_a_clean_error(published_out, capsys, forge):
    """A manifest with a consistent manifest_hash but not mergepipe's structure: one clean line."""
    out = published_out
    man = json.loads((out / MANIFEST).read_text())
    if forge == "no outputs":
        del man["outputs"]
    elif forge == "files a list":
        man["outputs"]["files"] = list(man["outputs"]["files"])
    elif forge == "file outside":
        man["outputs"]["files"]["../../etc/passwd"] = {"blake3": "0" * 64}
    elif forge == "no blake3":
        next(iter(man["outputs"]["files"].values())).pop("blake3")
    else:
        del man["outputs"]["tensors"]
    man["manifest_hash"] = manifest_hash(man)
    (out / MANIFEST).write_bytes(dumps(man))
    rc, err = _run(["verify", str(out)], capsys)
    assert rc == 6 and err.count("\n") == 1 and "malformed" in err, err


# ------------------------------------------------------------------ issue 15: change detection


def test_in_place_edit_with_mtime_restored_is_reindexed(fam, tmp_path, capsys):
    """Size, mtime and inode kept (os.utime): ctime still changes, so the stat cache misses and the
    expert is re-indexed; the merge equals a fresh-cache merge of the edited expert."""
    cfg = params(tmp_path / "p.yaml", fam, tmp_path / "out", tmp_path / "cache")
    assert main(["run", str(cfg), "-q"]) == 0
    first = load_manifest(tmp_path / "out")
    victim = fam["experts"][1] / "model.safetensors"
    t = open_checkpoint(victim).tensors["model.layers.2.mlp.up_proj.weight"]
    st = victim.stat()
    flip(victim, t.begin + 10)  # hide=True: size, mtime, inode as before
    assert (victim.stat().st_size, victim.stat().st_mtime_ns, victim.stat().st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)
    assert main(["run", str(cfg), "-q"]) == 0
    now = load_manifest(tmp_path / "out")
    assert json.loads(record_path(tmp_path / "out").read_text())["index_builds"] >= 1
    assert now["inputs"] != first["inputs"] and now["outputs"] != first["outputs"]
    fresh = params(tmp_path / "fresh.yaml", fam, tmp_path / "fresh", tmp_path / "cache-fresh")
    assert main(["run", str(fresh), "-q"]) == 0
    assert load_manifest(tmp_path / "fresh")["outputs"] == now["outputs"]


@pytest.mark.parametrize("hide", [True, False])
def test_flipped_byte_in_a_published_output_is_rebuilt_by_run(tiny_family, tiny_cache, tmp_path, capsys, hide):
    """`run` on an unchanged config is a no-op only while the output is as published: one flipped
    byte (mtime restored or not) makes it rebuild, and the result verifies."""
    root = Path(tiny_family["root"])
    family = {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}
    cfg = params(tmp_path / "p.yaml", family, tmp_path / "out", tiny_cache, budget="50%")
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-q"]) == 0
    rc, err = _run(["run", str(cfg)], capsys)
    assert rc == 0 and "up to date" in err
    weights = out / "model.safetensors"
    # in place: damage keeps the file (a new file with other bytes would be a user's, which
    # replacing loses: refused, tests/test_output_safety.py); the store's hard link is damaged too,
    # and the rebuild's deep check of it finds that and merges afresh
    flip(weights, weights.stat().st_size - 100, hide=hide)
    rc, err = _run(["run", str(cfg)], capsys)
    assert rc == 0 and "up to date" not in err, err
    assert main(["verify", str(out)]) == 0


def test_relinked_but_unchanged_output_stays_up_to_date(tiny_family, tiny_cache, tmp_path, capsys, monkeypatch):
    """A hard link added to a published file (the store, another target) changes its ctime but
    not its bytes: `run` rehashes once, finds it up to date and records the new stat keys."""
    root = Path(tiny_family["root"])
    family = {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}
    cfg = params(tmp_path / "p.yaml", family, tmp_path / "out", tiny_cache, budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    os.link(tmp_path / "out" / "model.safetensors", tmp_path / "extra-link")
    rc, err = _run(["run", str(cfg)], capsys)
    assert rc == 0 and "up to date" in err, err
    # the rehash recorded the new stat keys: the next runs are fast no-ops, not rehashes
    from mergepipe.commands import pipeline
    rehashes = []
    monkeypatch.setattr(pipeline, "verify_outputs", lambda *a, **k: rehashes.append(a))
    for _ in range(2):
        rc, err = _run(["run", str(cfg)], capsys)
        assert rc == 0 and "up to date" in err, err
    assert rehashes == []
    # and an edit after that is still caught
    weights = tmp_path / "out" / "model.safetensors"
    flip(weights, weights.stat().st_size - 1)  # in place: a new file would be a user's (refused)
    monkeypatch.undo()
    rc, err = _run(["run", str(cfg)], capsys)
    assert rc == 0 and "up to date" not in err, err
    assert main(["verify", str(tmp_path / "out")]) == 0


def test_damaged_store_entry_is_not_restored(tiny_family, tiny_cache, tmp_path, capsys):
    """A stored merge whose weights were changed (its manifest intact) is rebuilt, not published."""
    root = Path(tiny_family["root"])
    family = {"base": root / "base", "experts": [root / f"expert_{k}" for k in range(3)]}
    shutil.rmtree(tiny_cache / "merges", ignore_errors=True)
    cfg = params(tmp_path / "p.yaml", family, tmp_path / "first", tiny_cache, budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    good = load_manifest(tmp_path / "first")
    entry = tiny_cache / "merges" / good["plan_hash"]
    stored = entry / "model.safetensors"
    data = bytearray(stored.read_bytes())
    stored.unlink()  # break the hard link to the first output, then damage the store's copy
    data[-50] ^= 0xFF
    stored.write_bytes(bytes(data))
    assert main(["run", str(cfg), "-q", "-o", str(tmp_path / "second")]) == 0
    assert "restored_from" not in json.loads(record_path(tmp_path / "second").read_text())
    assert main(["verify", str(tmp_path / "second")]) == 0
    assert load_manifest(tmp_path / "second")["outputs"] == good["outputs"]


def test_copied_base_region_is_trusted_by_stat_and_caught_by_verify_deep(fam, tmp_path, capsys):
    """Base blocks that no expert block is planned for are copied file to file and take their
    hashes from the base index (issue 13): trusted through the stat cache. An edit the stat
    cache cannot see (forged here) is copied into the output; plain `verify` accepts what run
    recorded, `verify --deep` rereads the output and names the tensor, `verify --inputs` names
    the base; tampering with the copied region of a published output is caught by `--deep`
    even when the run record's stat keys are forged to match."""
    target = tmp_path / "out"
    cfg = params(tmp_path / "p.yaml", fam, target, tmp_path / "cache", budget="10%")
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    copied = _base_blocks(Store(tmp_path / "cache"), plan, fam, read=False)
    assert copied
    model, tensor, begin, end = copied[len(copied) // 2]
    t = open_checkpoint(model).tensors[tensor]
    flip(t.file, begin + (end - begin) // 2)
    forge_stat_cache(tmp_path / "cache", t.file)
    assert main(["run", str(cfg), "-q"]) == 0
    man = load_manifest(target)
    assert man["bytes"]["base_bytes_copied"] > 0
    assert main(["verify", str(target)]) == 0  # what run recorded
    rc, err = _run(["verify", str(target), "--deep"], capsys)
    assert rc == 6 and repr(tensor) in err and err.count("\n") == 1, err
    rc, err = _run(["verify", str(target), "--inputs"], capsys)
    assert rc != 0 and str(fam["base"]) in err and "changed" in err, err
    flip(t.file, begin + (end - begin) // 2)  # base as indexed again; rebuild elsewhere
    forge_stat_cache(tmp_path / "cache", t.file)
    shutil.rmtree(tmp_path / "cache" / "merges")
    shutil.rmtree(target)
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["verify", str(target), "--deep"]) == 0
    # the output's copied region edited in place, the run record's stat keys forged to match
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").unlink()  # a private copy: the store holds a hard link
    (target / "model.safetensors").write_bytes(data)
    out_t = open_checkpoint(target / "model.safetensors").tensors[tensor]
    flip(target / "model.safetensors", out_t.begin + (begin - t.begin) + 3)
    info = json.loads(record_path(target).read_text())
    info["stat"]["model.safetensors"] = list(_stat(target / "model.safetensors"))
    record_path(target).write_text(json.dumps(info))
    assert main(["verify", str(target)]) == 0  # the stat keys say "as published"
    rc, err = _run(["verify", str(target), "--deep"], capsys)
    assert rc == 6 and repr(tensor) in err, err


def _stat(path: Path) -> tuple[int, ...]:
    st = os.stat(path, follow_symlinks=False)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@pytest.mark.parametrize("direct", [False, True], ids=["kernel-copy", "direct-writes"])
def test_a_base_edited_while_the_merge_runs_is_not_published(tiny_family, tmp_path, capsys, monkeypatch, direct):
    """The base's unmerged regions are copied file to file (or, with direct writes, read and
    appended) and their hashes taken from its index: a base rewritten in place while a merge
    ran (a shared folder, `cp` over a shard) published other bytes under the index's hashes,
    and plain `verify` (and `run`) called it OK. The inputs' stat keys are now checked again
    before publishing."""
    import mergepipe.engine.merge as engine
    import mergepipe.util.fs as fs
    monkeypatch.setenv("MERGEPIPE_DIRECT_WRITES", "1" if direct else "0")
    fam = tmp_path / "fam"
    shutil.copytree(tiny_family["root"], fam)
    cfg = write_config(tmp_path, {**tiny_family, "root": fam}, budget="10%")
    base = fam / "base" / "model.safetensors"
    def edit(offset: int) -> None:  # a user's in-place edit, now
        with open(base, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x5A]))

    if direct and not fs.shares_extents(tmp_path):
        module, attr = engine, "CheckpointReader"  # the engine's own reader: the copied runs' reads
        real = engine.CheckpointReader

        class racing(real):
            def read_range(self, t, begin, end):
                if engine.CheckpointReader is not real:
                    edit(begin)
                    monkeypatch.setattr(module, attr, real)
                return super().read_range(t, begin, end)
    else:
        module, attr = fs, "copy_range"  # the kernel copy's entry point
        real = fs.copy_range

        def racing(src_fd, src_offset, *args, **kw):
            if os.fstat(src_fd).st_ino == base.stat().st_ino:
                edit(src_offset)
                monkeypatch.setattr(module, attr, real)
            return real(src_fd, src_offset, *args, **kw)
    monkeypatch.setattr(module, attr, racing)
    capsys.readouterr()
    assert main(["run", str(cfg), "-q"]) == 3
    assert "changed while the merge ran" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert getattr(module, attr) is real  # the edit happened
    assert main(["run", str(cfg), "-q"]) == 0  # the next run indexes the edited base
    assert main(["verify", str(tmp_path / "out"), "--deep", "-q"]) == 0
