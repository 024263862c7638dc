"""A manifest anyone can check without mergepipe (issue 27): scripts/check_manifest.py, written
from docs/design.md with only the standard library and blake3, agrees with `mergepipe verify
--deep` on every golden merge and on the layouts they lack (vocabulary blocks, output shards,
lineage), names what was edited, and schemas/manifest.schema.json describes every manifest."""
from __future__ import annotations

import ast
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from mergepipe.cli import main
from mergepipe.output.manifest import MANIFEST, SIGNATURE, dumps, load_manifest, manifest_hash
from tests.helpers.golden import CASES, run_cases
from tests.helpers import write_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_manifest.py"
SCHEMA = ROOT / "schemas" / "manifest.schema.json"


def check(out: Path, *, python: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(python or [sys.executable]), str(SCRIPT), str(out)], capture_output=True,
                          text=True)


def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("golden-standalone")
    run_cases(root, threads=2, torch_path=False)
    return root / "cases"


@pytest.fixture(scope="module")
def layouts(tiny_family, tmp_path_factory) -> dict[str, Path]:
    """Merges of the tiny family the golden cases do not cover: vocabulary blocks with output shards,
    and a merge of that merge (a lineage link)."""
    site = tmp_path_factory.mktemp("standalone-layouts")
    for name in ("emb", "plain", "nested"):
        (site / name).mkdir()
    cfg = write_config(site / "emb", tiny_family, embedding_block_bytes="4KiB")
    params = yaml.safe_load(cfg.read_text())
    params["output"]["shard_bytes"] = "1MiB"
    cfg.write_text(yaml.safe_dump(params, sort_keys=False))
    assert main(["run", str(cfg), "-q"]) == 0
    plain = write_config(site / "plain", tiny_family)
    assert main(["run", str(plain), "-q"]) == 0
    nested = yaml.safe_load(write_config(site / "nested", tiny_family).read_text())
    nested["experts"] = [{"name": "merged", "path": str(site / "emb" / "out"), "weight": 0.5},
                         {"name": "e1", "path": str(Path(tiny_family["root"]) / "expert_1"), "weight": 0.5}]
    (site / "nested" / "params.yaml").write_text(yaml.safe_dump(nested, sort_keys=False))
    assert main(["run", str(site / "nested" / "params.yaml"), "-q"]) == 0
    return {"emb": site / "emb" / "out", "plain": site / "plain" / "out", "nested": site / "nested" / "out"}


def test_the_checker_imports_only_the_standard_library_and_blake3():
    tree = ast.parse(SCRIPT.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= set(sys.stdlib_module_names) | {"blake3"}, names


@pytest.mark.parametrize("case", sorted(CASES))
def test_checker_agrees_with_verify_deep_on_every_golden_merge(golden, case, capsys):
    out = golden / case / "out"
    got = check(out)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"{out}: OK (")
    assert main(["verify", str(out), "--deep", "-q"]) == 0
    assert not list(validator().iter_errors(json.loads((out / MANIFEST).read_text())))


def test_checker_follows_vocabulary_blocks_output_shards_and_lineage(layouts):
    emb, plain, nested = (load_manifest(layouts[k]) for k in ("emb", "plain", "nested"))
    assert len([n for n in emb["outputs"]["files"] if n.endswith(".safetensors")]) > 1
    name = "model.embed_tokens.weight"  # the same bytes at full budget, hashed under smaller blocks
    assert emb["outputs"]["tensors"][name] != plain["outputs"]["tensors"][name]
    assert "lineage" in nested
    for out in layouts.values():
        got = check(out)
        assert got.returncode == 0, got.stderr
        assert not list(validator().iter_errors(load_manifest(out)))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_an_edited_weight_file_is_named_by_file_and_tensor(layouts, tmp_path):
    out = _copy(layouts["plain"], tmp_path / "edited")
    path = out / "model.safetensors"
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        begin = header["model.norm.weight"]["data_offsets"][0]
        f.seek(8 + n + begin)
        byte = f.read(1)
        f.seek(8 + n + begin)
        f.write(bytes([byte[0] ^ 0x40]))
    got = check(out)
    assert got.returncode == 1
    assert f"{path}: tensor 'model.norm.weight' does not match the manifest" in got.stderr
    assert main(["verify", str(out), "--deep", "-q"]) == 6  # mergepipe agrees


def test_a_manifest_edited_or_forged_is_caught(layouts, tmp_path):
    out = _copy(layouts["plain"], tmp_path / "forged")
    man = load_manifest(out)
    man["budget"]["spec"] = "10%"
    (out / MANIFEST).write_bytes(dumps(man))  # edited, hash not recomputed
    assert "manifest_hash does not match its content" in check(out).stderr
    man["plan"]["seed"] = 1
    man["manifest_hash"] = manifest_hash(man)
    (out / MANIFEST).write_bytes(dumps(man))  # the plan edited under a recomputed manifest_hash
    assert "plan_hash does not match the recorded plan" in check(out).stderr


def test_added_missing_and_edited_files_are_named(layouts, tmp_path):
    out = _copy(layouts["plain"], tmp_path / "files")
    (out / SIGNATURE).write_text("{}")  # a signature is the one unrecorded file allowed
    assert check(out).returncode == 0
    (out / "notes.txt").write_text("hi")
    assert f"{out / 'notes.txt'}: not recorded in the manifest" in check(out).stderr
    (out / "notes.txt").unlink()
    (out / "config.json").write_text("{}")
    assert f"{out / 'config.json'}: its blake3 is not the manifest's" in check(out).stderr
    (out / "tokenizer.json").unlink()
    assert f"{out / 'tokenizer.json'}: missing" in check(out).stderr


def test_without_blake3_it_checks_the_structure_and_says_no_hash_was_checked(layouts):
    no_blake3 = [sys.executable, "-c", "import runpy, sys; sys.modules['blake3'] = None; "
                 "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"]
    got = check(layouts["plain"], python=no_blake3)
    assert got.returncode == 3
    assert "structure OK" in got.stderr and "no hash checked" in got.stderr


def test_the_schema_rejects_what_a_manifest_never_holds(layouts):
    v = validator()
    man = load_manifest(layouts["plain"])
    assert not list(v.iter_errors(man))
    bad = json.loads(json.dumps(man))
    bad["outputs"]["files"]["model.safetensors"]["tree"] = "not-a-hash"
    assert list(v.iter_errors(bad))
    bad = json.loads(json.dumps(man))
    bad["plan"]["densty"] = 0.5
    assert list(v.iter_errors(bad))
    bad = json.loads(json.dumps(man))
    bad["outputs"]["files"]["../escape.json"] = {"blake3": "0" * 64}
    assert list(v.iter_errors(bad))


def test_the_schema_is_generated_from_the_plan_record():
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_manifest_schema.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert got.returncode == 0, got.stderr
