"""`mergepipe audit` (issue 27): a merge proven on a machine and folder layout that never built
it (inputs found by content hash under --search folders or in the Hugging Face cache, renamed
and re-sharded), each input rehashed, the merge replayed; lineage across merges of merges."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from mergepipe.checkpoint.safetensors import INDEX_JSON, open_checkpoint
from mergepipe.cli import main
from mergepipe.index import build
from mergepipe.output.lineage import output_hash
from mergepipe.output.manifest import MANIFEST, dumps, load_manifest, manifest_hash
from tests.helpers import load_model, write_config

AUX = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch) -> Path:
    """No test reads the user's Hugging Face cache: it is an empty folder unless a test makes one."""
    hub = tmp_path / "hub-empty"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def reshard(src: Path, dst: Path, n_files: int) -> Path:
    """The model in `src` written to `dst` as `n_files` shards of other names (same tensors and bytes)."""
    tensors = load_model(src)
    names = sorted(tensors)
    dst.mkdir(parents=True)
    weight_map = {}
    for k in range(n_files):
        part = names[k::n_files]
        fname = f"weights-part{k}.safetensors" if n_files > 1 else "model.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    if n_files > 1:
        (dst / INDEX_JSON).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in AUX:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def _audit(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["audit", *map(str, args), "-q"])
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.fixture
def built(tiny_family, tmp_path) -> dict:
    """A merge of private copies of the tiny family (base + 3 experts, expert_0 sharded), built in
    tmp/site, which is then gone: the output copied to tmp/download, the inputs moved into
    tmp/tree under other names, the base and expert_0 re-sharded."""
    site = tmp_path / "site"
    family = {"root": site, "experts": tiny_family["experts"]}
    for name in ("base", "expert_0", "expert_1", "expert_2"):
        shutil.copytree(Path(tiny_family["root"]) / name, site / name)
    cfg = write_config(site, family)
    assert main(["run", str(cfg), "-q"]) == 0
    download = tmp_path / "download" / "some-merge"
    shutil.copytree(site / "out", download)
    tree = tmp_path / "tree"
    reshard(site / "base", tree / "org-a" / "the-base", 3)
    reshard(site / "expert_0", tree / "org-b" / "deep" / "ft-zero", 1)
    shutil.copytree(site / "expert_1", tree / "org-b" / "ft-one")
    shutil.copytree(site / "expert_2", tree / "ft-two")
    (tree / "notes").mkdir()
    (tree / "notes" / "readme.txt").write_text("not a model")
    shutil.rmtree(site)
    return {"out": download, "tree": tree, "cache": tmp_path / "audit-cache", "tmp": tmp_path}


def test_audit_proves_a_copied_merge_from_inputs_renamed_and_resharded_elsewhere(built, capsys, monkeypatch):
    builds = []
    real = build.build_model_index
    monkeypatch.setattr(build, "build_model_index", lambda *a, **k: builds.append(a[0].root) or real(*a, **k))
    rc, out, err = _audit(capsys, built["out"], "--search", built["tree"], "--cache-dir", built["cache"])
    assert rc == 0, out + err
    tree = built["tree"]
    for label, folder in (("base", tree / "org-a" / "the-base"), ("expert e0", tree / "org-b" / "deep" / "ft-zero"),
                          ("expert e1", tree / "org-b" / "ft-one"), ("expert e2", tree / "ft-two")):
        line = next(x for x in out.splitlines() if x.strip().startswith(label + " "))
        assert f"found {folder} (--search {tree}); rehashed: matches" in line, out
    assert "output: OK" in out and "replay: identical" in out and out.rstrip().endswith("audit: OK"), out
    first = len(builds)
    builds.clear()
    rc, again, err = _audit(capsys, built["out"], "--search", built["tree"], "--cache-dir", built["cache"])
    assert rc == 0, again + err
    # the second audit finds every candidate in the index cache; only the rehash (4 inputs) reads weights
    assert len(builds) == 4 < first, (builds, first)


def test_audit_names_a_missing_input_and_exits_8(built, capsys):
    shutil.rmtree(built["tree"] / "org-b" / "ft-one")
    rc, out, err = _audit(capsys, built["out"], "--search", built["tree"], "--cache-dir", built["cache"])
    assert rc == 8, out + err
    assert "audit failed: expert e1 (content" in err and "recorded as" in err and "expert_1" in err, err
    assert len(err.strip().splitlines()) == 1
    assert "replay: not run" in out and "MISSING expert e1" in out, out


def test_audit_of_an_input_whose_bytes_changed_names_it(built, capsys):
    victim = built["tree"] / "ft-two" / "model.safetensors"
    t = open_checkpoint(victim).tensors["model.layers.1.mlp.up_proj.weight"]
    flip(victim, t.begin + 6)
    rc, out, err = _audit(capsys, built["out"], "--search", built["tree"], "--cache-dir", built["cache"])
    assert rc == 8 and "expert e2" in err, out + err
    assert f"indexed, matching no input: {built['tree'] / 'ft-two'}" in out, out


def test_audit_of_an_input_changed_at_its_recorded_path_is_a_mismatch(tiny_family, tmp_path, capsys):
    family = {"root": tmp_path, "experts": tiny_family["experts"]}
    for name in ("base", "expert_0", "expert_1", "expert_2"):
        shutil.copytree(Path(tiny_family["root"]) / name, tmp_path / name)
    assert main(["run", str(write_config(tmp_path, family)), "-q"]) == 0
    victim = tmp_path / "expert_1" / "model.safetensors"
    flip(victim, open_checkpoint(victim).tensors["model.norm.weight"].begin)
    rc, out, err = _audit(capsys, tmp_path / "out", "--cache-dir", tmp_path / "audit-cache")
    assert rc == 6, out + err
    assert f"expert e1: {tmp_path / 'expert_1'} holds content" in err and "changed since the merge" in err, err


def test_audit_catches_a_forged_manifest_by_replay(built, capsys):
    """Every hash in the manifest recomputed over a changed tensor: the output verifies, the replay does not."""
    from mergepipe.checkpoint.treehash import hash_weight_file
    out = built["out"]
    model = out / "model.safetensors"
    t = open_checkpoint(model).tensors["model.norm.weight"]
    flip(model, t.begin + 1)
    man = json.loads((out / MANIFEST).read_text())
    digest, tensors = hash_weight_file(model, man["plan"]["block_bytes"])
    man["outputs"]["files"]["model.safetensors"]["tree"] = digest
    man["outputs"]["tensors"][t.name] = tensors[t.name]
    man["manifest_hash"] = manifest_hash(man)
    (out / MANIFEST).write_bytes(dumps(man))
    rc, report, err = _audit(capsys, out, "--search", built["tree"], "--cache-dir", built["cache"])
    assert rc == 6 and f"replay: 1 tensor(s) differ (first {t.name!r})" in err, report + err
    assert "output: OK" in report


def _snapshot(hub: Path, repo: str, rev: str, src: Path, *, main_ref: bool = True) -> Path:
    """`src` stored the way huggingface_hub stores a download: blobs, and links to them in the
    snapshot. A sharded model's files are copies: open_checkpoint refuses a weight_map file
    whose real path leaves the model folder, as a blob's does."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    sharded = (src / INDEX_JSON).exists()
    for f in sorted(src.iterdir()):
        if sharded:
            shutil.copyfile(f, snap / f.name)
            continue
        blob = repo_dir / "blobs" / f"{rev}-{f.name}"
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    if main_ref:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(rev)
    return snap


def test_audit_finds_inputs_in_the_hugging_face_cache_by_hub_id_then_by_hash(tiny_family, tmp_path, capsys,
                                                                             monkeypatch):
    """Built from a Hugging Face cache (the plan records snapshot paths); audited against another
    cache where the same models are other revisions, re-sharded, or under other repo names."""
    root = Path(tiny_family["root"])
    hub_a = tmp_path / "hub-a"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_a))
    base = _snapshot(hub_a, "org/base", "r1", root / "base")
    e0 = _snapshot(hub_a, "org/ft0", "r1", root / "expert_0")
    e1 = _snapshot(hub_a, "org/ft1", "r1", root / "expert_1")
    cfg = write_config(tmp_path, tiny_family, base=str(base), experts=[
        {"name": "e0", "path": str(e0), "weight": 1.0}, {"name": "e1", "path": str(e1), "weight": 0.5}])
    assert main(["run", str(cfg), "-q"]) == 0
    hub_b = tmp_path / "hub-b"
    _snapshot(hub_b, "org/ft0", "r0-old", root / "expert_2")  # refs/main: another model under that id
    _snapshot(hub_b, "org/ft0", "r2", reshard(root / "expert_0", tmp_path / "r-e0", 2), main_ref=False)
    _snapshot(hub_b, "mirror/base-copy", "abc", reshard(root / "base", tmp_path / "r-base", 2))
    _snapshot(hub_b, "someone/renamed", "def", root / "expert_1")
    shutil.rmtree(hub_a)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_b))
    rc, out, err = _audit(capsys, tmp_path / "out", "--cache-dir", tmp_path / "audit-cache")
    assert rc == 0, out + err
    assert f"found {hub_b}/models--org--ft0/snapshots/r2 (Hub id org/ft0)" in out, out
    assert f"found {hub_b}/models--mirror--base-copy/snapshots/abc (Hugging Face cache)" in out, out
    assert f"found {hub_b}/models--someone--renamed/snapshots/def (Hugging Face cache)" in out, out
    assert "replay: identical" in out and out.rstrip().endswith("audit: OK"), out


@pytest.fixture
def merges(tiny_family, tmp_path) -> dict:
    """A (base + e0 + e1) and B (base + A + e2), a merge of a merge, built in tmp/site; then the
    inputs of both (A's output too) moved into tmp/tree under other names and B's output copied."""
    site = tmp_path / "site"
    root = Path(tiny_family["root"])
    for name in ("base", "expert_0", "expert_1", "expert_2"):
        shutil.copytree(root / name, site / name)
    (site / "a").mkdir()
    cfg_a = write_config(site / "a", {"root": site, "experts": [0, 1]}, experts=[
        {"name": "e0", "path": str(site / "expert_0"), "weight": 1.0},
        {"name": "e1", "path": str(site / "expert_1"), "weight": 0.5}])
    assert main(["run", str(cfg_a), "-q"]) == 0
    (site / "b").mkdir()
    cfg_b = write_config(site / "b", {"root": site, "experts": []}, experts=[
        {"name": "merged", "path": str(site / "a" / "out"), "weight": 0.6},
        {"name": "e2", "path": str(site / "expert_2"), "weight": 0.4}])
    assert main(["run", str(cfg_b), "-q"]) == 0
    man_a, man_b = load_manifest(site / "a" / "out"), load_manifest(site / "b" / "out")
    tree = tmp_path / "tree"
    shutil.copytree(site / "b" / "out", tmp_path / "download" / "b")
    shutil.copytree(site / "a" / "out", tree / "merges" / "a-merge")
    reshard(site / "base", tree / "base-model", 2)
    for name, new in (("expert_0", "zero"), ("expert_1", "one"), ("expert_2", "two")):
        shutil.copytree(site / name, tree / "fine-tunes" / new)
    shutil.rmtree(site)
    return {"a": man_a, "b": man_b, "out": tmp_path / "download" / "b", "tree": tree, "tmp": tmp_path}


def test_a_merge_of_plain_models_records_no_lineage_and_a_merge_of_a_merge_links_it(merges):
    a, b = merges["a"], merges["b"]
    assert "lineage" not in a  # its manifest is the one it always was
    assert b["lineage"] == {"experts": {"merged": {"manifest_hash": a["manifest_hash"], "output_hash": output_hash(a)}}}


def test_audit_recursive_walks_the_chain_down_to_the_fine_tunes(merges, capsys):
    tree, cache = merges["tree"], merges["tmp"] / "audit-cache"
    rc, out, err = _audit(capsys, merges["out"], "--search", tree, "--cache-dir", cache)
    assert rc == 0, out + err
    link = f"lineage: expert merged is the output of merge {merges['a']['manifest_hash'][:16]}"
    assert f"{link} (manifest in {tree / 'merges' / 'a-merge'}): weights match" in out, out
    assert "fine-tunes/zero" not in out  # not recursive: A's inputs are not looked for
    rc, out, err = _audit(capsys, merges["out"], "--search", tree, "--cache-dir", cache, "--recursive")
    assert rc == 0, out + err
    lines = out.splitlines()
    nested = lines.index(next(x for x in lines if x.strip().startswith(f"merge {merges['a']['manifest_hash'][:16]}")))
    below = "\n".join(lines[nested + 1:])
    assert f"found {tree / 'fine-tunes' / 'zero'}" in below and f"found {tree / 'fine-tunes' / 'one'}" in below, out
    assert out.count("replay: identical") == 2 and out.rstrip().endswith("audit: OK"), out


def test_audit_catches_a_lineage_link_to_another_manifest(merges, capsys):
    """B's link edited to name another real merge's manifest, B's manifest_hash recomputed."""
    tree = merges["tree"]
    other = merges["tmp"] / "other"
    other.mkdir()
    cfg = write_config(other, {"root": tree / "fine-tunes", "experts": []}, base=str(tree / "base-model"), experts=[
        {"name": "e1", "path": str(tree / "fine-tunes" / "one"), "weight": 0.3}])
    assert main(["run", str(cfg), "-q"]) == 0
    shutil.move(other / "out", tree / "merges" / "other-merge")
    decoy = load_manifest(tree / "merges" / "other-merge")
    man = json.loads((merges["out"] / MANIFEST).read_text())
    man["lineage"]["experts"]["merged"] = {"manifest_hash": decoy["manifest_hash"], "output_hash": output_hash(decoy)}
    man["manifest_hash"] = manifest_hash(man)
    (merges["out"] / MANIFEST).write_bytes(dumps(man))
    rc, out, err = _audit(capsys, merges["out"], "--search", tree, "--cache-dir", merges["tmp"] / "audit-cache")
    assert rc == 6, out + err
    assert f"is the output of merge {decoy['manifest_hash'][:16]}: the manifest in {tree / 'merges' / 'other-merge'}" \
           " does not record this input's tensors as its outputs" in err, err


def test_audit_finds_a_moved_tokenizer_source_by_its_files(tiny_family, tmp_path, capsys):
    root = Path(tiny_family["root"])
    site = tmp_path / "site"
    site.mkdir()
    tok = site / "tok"
    tok.mkdir()
    shutil.copyfile(root / "base" / "config.json", tok / "config.json")
    tokenizer = json.loads((root / "base" / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [*tokenizer.get("added_tokens", []), {"id": 0, "content": "<mine>"}]
    (tok / "tokenizer.json").write_text(json.dumps(tokenizer))
    cfg = write_config(site, tiny_family, output={"dir": str(site / "out"), "tokenizer_source": str(tok)})
    assert main(["run", str(cfg), "-q"]) == 0
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    shutil.move(tok, tmp_path / "elsewhere" / "deep" / "tokenizer-files")
    args = (site / "out", "--cache-dir", tmp_path / "audit-cache")
    rc, out, err = _audit(capsys, *args)
    assert rc == 8 and "tokenizer source (recorded as" in err, out + err
    rc, out, err = _audit(capsys, *args, "--search", tmp_path / "elsewhere")
    assert rc == 0, out + err
    assert f"tokenizer source: found {tmp_path / 'elsewhere' / 'deep' / 'tokenizer-files'}; files match" in out, out
