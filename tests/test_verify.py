"""`mergepipe verify` names what differs: an edited non-weight file as edited (never parsed as
weights), and a replay that differs by its layout (weight files, shard split, tensor order),
its first differing tensors with their file, or its non-weight files (commands/verify.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.checkpoint.treehash import hash_weight_file
from mergepipe.cli import main
from mergepipe.engine import merge as engine
from mergepipe.output.manifest import MANIFEST, dumps, manifest_hash
from tests.helpers.golden import make_golden_family

AUX = {"config.json": '{"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}\n',
       "generation_config.json": '{"do_sample": false}\n',
       "tokenizer.json": '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}}\n',
       "tokenizer_config.json": '{"tokenizer_class": "PreTrainedTokenizerFast"}\n'}


def _family(root: Path) -> Path:
    make_golden_family(root, dtype="BF16", seed=3, n_experts=2)
    for name, text in AUX.items():
        (root / "base" / name).write_text(text)
    return root


def _merged(tmp: Path, family: Path, **output) -> Path:
    cfg = {"base": str(family / "base"), "method": "task_arithmetic", "budget": "full", "block_bytes": "4KiB",
           "experts": [{"name": f"e{k}", "path": str(family / f"expert_{k}"), "weight": 0.5} for k in range(2)],
           "output": {"dir": str(tmp / "out"), **output}, "cache_dir": str(tmp / "cache")}
    (tmp / "params.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / "params.yaml"), "-q"]) == 0
    return tmp / "out"


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    return _family(tmp_path_factory.mktemp("verify"))


def _verify(capsys, out: Path, *flags: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["verify", str(out), *flags])
    return rc, capsys.readouterr().err.strip()


def test_an_edited_metadata_file_is_named_as_edited(family, tmp_path, capsys):
    out = _merged(tmp_path, family, shard_bytes="64KiB")
    assert (out / "model.safetensors.index.json").is_file()
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md",
                 "model.safetensors.index.json"]:
        path = out / name
        original = path.read_bytes()
        path.write_bytes(original.replace(b"}", b', "edited": 1}', 1) if name.endswith(".json") else original + b"x")
        rc, err = _verify(capsys, out)
        assert rc == 6, err
        assert err == f"mergepipe: error: {path}: edited since it was published (its blake3 is not the manifest's)"
        path.write_bytes(original)
        assert _verify(capsys, out) == (0, "")


def test_an_edited_weight_file_still_names_its_tensor(family, tmp_path, capsys):
    out = _merged(tmp_path, family)
    weights = out / "model.safetensors"
    t = open_checkpoint(weights).tensors["model.norm.weight"]
    data = bytearray(weights.read_bytes())
    data[t.begin] ^= 1
    weights.write_bytes(bytes(data))
    rc, err = _verify(capsys, out)
    assert rc == 6, err
    assert err == f"mergepipe: error: {weights}: tensor 'model.norm.weight' does not match the manifest"


def _split_in_two(layout, starts):
    (name, tensors), = layout.items()
    half = len(tensors) // 2
    return {"a.safetensors": tensors[:half], "b.safetensors": tensors[half:]}, {}


def _move_one(layout, starts):
    (f1, t1), (f2, t2), *rest = layout.items()
    return {f1: t1[1:], f2: [t1[0], *t2], **dict(rest)}, {}


def _reverse(layout, starts):
    return {f: ts[::-1] for f, ts in layout.items()}, {}


@pytest.mark.parametrize("change, output, expect", [
    (_split_in_two, {}, "layout: weight files ['model.safetensors'], the replay's ['a.safetensors', 'b.safetensors']"),
    (_move_one, {"shard_bytes": "64KiB"}, "shard split: 1 tensors in other files, first 'lm_head.weight' in "
                                          "model-00001-of-00005.safetensors, the replay's in "
                                          "model-00002-of-00005.safetensors"),
    (_reverse, {}, "tensor order of model.safetensors: tensor 0 is 'lm_head.weight', the replay's "
                   "'model.norm.weight'"),
])
def test_a_replay_with_another_layout_says_so(family, tmp_path, capsys, monkeypatch, change, output, expect):
    out = _merged(tmp_path, family, **output)
    real = engine.plan_layout
    monkeypatch.setattr(engine, "plan_layout", lambda plan, tensors: change(*real(plan, tensors)))
    rc, err = _verify(capsys, out, "--replay")
    assert rc == 6 and err == f"mergepipe: error: {out}: replay produced different outputs: {expect}", err


def test_a_replay_names_the_first_differing_tensors_and_their_file(family, tmp_path, capsys):
    """A tensor rewritten and every hash of the manifest recomputed passes a plain verify."""
    out = _merged(tmp_path, family, shard_bytes="64KiB")
    man = json.loads((out / MANIFEST).read_text())
    file_of = {n: h.path.name for h in open_checkpoint(out).files for n in h.table.names}
    for name in ["model.norm.weight", "lm_head.weight"]:
        fname = file_of[name]
        t = open_checkpoint(out / fname).tensors[name]
        data = bytearray((out / fname).read_bytes())
        data[t.begin] ^= 1
        (out / fname).write_bytes(bytes(data))
        digest, tensors = hash_weight_file(out / fname, man["plan"]["block_bytes"])
        man["outputs"]["files"][fname]["tree"] = digest
        man["outputs"]["tensors"][name] = tensors[name]
    man["manifest_hash"] = manifest_hash(man)
    (out / MANIFEST).write_bytes(dumps(man))
    assert _verify(capsys, out, "--deep") == (0, "")
    rc, err = _verify(capsys, out, "--replay")
    assert rc == 6 and err == (f"mergepipe: error: {out}: replay produced different outputs: tensors 'lm_head.weight' "
                               f"({file_of['lm_head.weight']}), 'model.norm.weight' "
                               f"({file_of['model.norm.weight']}) differ (2 in all)"), err


def test_verify_inputs_names_a_metadata_file_the_base_changed_since(tmp_path, capsys):
    """The plan records the base's copied files (base.files): the inputs' check names the file,
    before any replay."""
    family = _family(tmp_path / "family")
    out = _merged(tmp_path, family)
    (family / "base" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "rope_theta": 1}\n')
    for args in (("--inputs",), ("--inputs", "--replay")):
        rc, err = _verify(capsys, out, *args)
        assert rc == 6 and err == (f"mergepipe: error: {family / 'base' / 'config.json'}: changed since the plan "
                                   "was made (the plan hash covers it); re-plan"), err


def test_a_replay_of_other_outputs_names_each_differing_file(tmp_path):
    from mergepipe.errors import IntegrityError
    from mergepipe.output.manifest import refuse_other_replay
    recorded = {"outputs": {"files": {"adapter_model.safetensors": {"blake3": "a"}, "adapter_config.json": "c"}}}
    refuse_other_replay(tmp_path, recorded, {"outputs": {"files": dict(recorded["outputs"]["files"])}})
    again = {"outputs": {"files": {"adapter_model.safetensors": {"blake3": "b"}, "extra.json": "e"}}}
    with pytest.raises(IntegrityError) as e:
        refuse_other_replay(tmp_path, recorded, again)
    assert str(e.value) == (f"{tmp_path}: replay produced different outputs: "
                            "adapter_config.json, adapter_model.safetensors, extra.json")
