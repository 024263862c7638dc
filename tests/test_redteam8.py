"""Red-team pass 8 (issue 15): calibrated plans' cache entries, gc, sweeps, signals and the
environment. Each test published a model that verify called OK, or lost a user's file,
before its fix."""
from __future__ import annotations

import json
import shutil

from mergepipe.cli import main
from tests.helpers.tiny_llama import calibrated_config as _config


def test_another_experts_weighted_energies_copied_under_this_key_are_rebuilt(llama, tmp_path):
    """A calibrated plan's weighted/ entry (importance-weighted block energies) of another
    expert of the same shapes, copied over this expert's entry, passed every check (format,
    tensors, block counts, its own blake3): the plan chose blocks by the other expert's
    energies and a model of another plan was published that plain verify called OK. An entry
    now records its own key (expert, base, artifact, layout) and is rebuilt when another's."""
    cfg = _config(tmp_path, llama, "30%")
    out = tmp_path / "out-30"
    assert main(["run", str(cfg), "-q"]) == 0
    want = (out / "model.safetensors").read_bytes()
    plan_hash = json.loads((out / "manifest.json").read_text())["plan_hash"]
    entries = sorted((llama / "cache" / "weighted").glob("*.json"))
    assert len(entries) == 2
    shutil.copyfile(entries[0], entries[1])
    shutil.rmtree(out)
    shutil.rmtree(llama / "cache" / "merges")
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["verify", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["plan_hash"] == plan_hash
    assert (out / "model.safetensors").read_bytes() == want


def test_a_demo_rerun_keeps_a_users_model_in_the_demo_folder(tmp_path):
    """Once a folder held demo's marker, a rerun rewrote base/ and expert_*/ whatever they held:
    a user's model put at expert_2/ (then `demo --experts 3`) or a fine-tune saved over
    expert_0/'s weights was replaced. The marker now records the blake3 of every file demo
    wrote; a file of demo's names with other bytes is refused, kept."""
    from mergepipe.commands.demo import make_family
    from mergepipe.errors import OutputError
    import pytest
    out = tmp_path / "demo"
    make_family(out, preset="tiny", n_experts=2, shard_expert=None)
    make_family(out, preset="tiny", n_experts=2, shard_expert=None)  # its own files: rewritten
    (out / "expert_2").mkdir()
    (out / "expert_2" / "model.safetensors").write_bytes(b"a user's model")
    with pytest.raises(OutputError, match="expert_2/model.safetensors"):
        make_family(out, preset="tiny", n_experts=3, shard_expert=None)
    assert (out / "expert_2" / "model.safetensors").read_bytes() == b"a user's model"
    (out / "expert_2" / "model.safetensors").unlink()
    (out / "expert_0" / "model.safetensors").write_bytes(b"a fine-tune")
    with pytest.raises(OutputError, match="expert_0/model.safetensors"):
        make_family(out, preset="tiny", n_experts=3, shard_expert=None, seed=1)
    assert (out / "expert_0" / "model.safetensors").read_bytes() == b"a fine-tune"


def test_an_importance_artifact_of_another_recipe_copied_under_this_key_is_rebuilt(llama, tmp_path):
    """The calibration artifact of the same base and text made with another max_tokens, copied
    over this recipe's file, passed every check (base and text hashes, vectors' blake3): base
    and text do not pin the recipe, and the plan then named the copy, so even --replay agreed.
    The artifact now records its own store key and is rebuilt when it holds another's."""
    arts = llama / "cache" / "calibration"  # (the fixture's cache is shared: other tests' artifacts too)
    shutil.rmtree(arts, ignore_errors=True)
    small = _config(tmp_path / "s", llama, "30%", max_tokens=64)
    assert main(["run", str(small), "-q"]) == 0
    (art_small,) = arts.glob("*.safetensors")
    big = _config(tmp_path / "b", llama, "30%")  # max_tokens 512
    out = tmp_path / "b" / "out-30"
    assert main(["run", str(big), "-q"]) == 0
    want = (out / "model.safetensors").read_bytes()
    plan_hash = json.loads((out / "manifest.json").read_text())["plan_hash"]
    (art_big,) = set(arts.glob("*.safetensors")) - {art_small}
    assert art_big.read_bytes() != art_small.read_bytes()
    shutil.copyfile(art_small, art_big)
    shutil.rmtree(out)
    shutil.rmtree(llama / "cache" / "merges")
    assert main(["run", str(big), "-q"]) == 0
    assert json.loads((out / "manifest.json").read_text())["plan_hash"] == plan_hash
    assert (out / "model.safetensors").read_bytes() == want
