"""The Snakemake build of an adapter output (output.adapter): the merge rule declares the
adapter's files (adapter_model.safetensors, adapter_config.json, adapter_report.json and the
manifest, no model.safetensors), runs no index or plan job, builds, verifies, and is a no-op the
second time; a changed adapter reruns it."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.workflow import job_counts, make_workspace, pending_jobs, smk

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _family(models: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(models / "base")
    for seed, name in ((1, "a"), (2, "b")):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM.from_pretrained(models / "base")
        lora = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        peft.get_peft_model(model, lora).save_pretrained(models / name)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    ws = make_workspace(tmp_path_factory.mktemp("smk-adapter"))
    _family(ws / "models")
    params = {"base": "models/base", "method": "task_arithmetic", "parameters": {"lambda": 1.0},
              "experts": [{"name": "a", "adapter": "models/a", "weight": 1.0},
                          {"name": "b", "adapter": "models/b", "weight": -0.5}],
              "seed": 0, "budget": "full",
              "output": {"dir": "merged", "adapter": {"combination": "svd", "rank": 2}}, "cache_dir": ".mergepipe"}
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return ws


def test_the_adapter_build_declares_its_files_verifies_and_is_then_a_no_op(ws):
    assert pending_jobs(ws) == {"merge": 1, "verify": 1, "all": 1}  # no index, no plan
    smk(ws)
    out = ws / "merged"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "adapter_report.json", "manifest.json"]
    assert json.loads((out / "manifest.json").read_text())["kind"] == "peft-lora-adapter"
    assert (ws / "logs" / "verify.txt").read_text().startswith("merged: OK")
    assert job_counts(smk(ws)) == {}
    assert job_counts(smk(ws, "merged/adapter_model.safetensors")) == {}


def test_a_changed_adapter_reruns_the_merge_only(ws):
    smk(ws)
    before = (ws / "merged" / "adapter_model.safetensors").read_bytes()
    weights = ws / "models" / "a" / "adapter_model.safetensors"
    stamp = os.stat(ws / "merged" / "manifest.json").st_mtime_ns + 10**9  # newer than the output
    os.utime(weights, ns=(stamp, stamp))
    assert pending_jobs(ws) == {"merge": 1, "verify": 1, "all": 1}
    smk(ws)
    assert (ws / "merged" / "adapter_model.safetensors").read_bytes() == before  # same inputs, same bytes
    assert job_counts(smk(ws)) == {}


def test_merge_parts_is_refused_for_an_adapter_output(ws):
    proc = smk(ws, "-n", "--config", "merge_parts=2", check=False)
    assert proc.returncode != 0
    assert "output.adapter is combined in one job" in proc.stdout + proc.stderr


def test_adapter_experts_of_a_model_output_are_indexed_from_their_files(tmp_path_factory):
    """Adapters as experts of a model output: each is indexed (`mergepipe index ADAPTER --base`),
    planned and merged as a model; a second call is a no-op, a touched adapter file reindexes it."""
    ws = make_workspace(tmp_path_factory.mktemp("smk-adapter-experts"))
    _family(ws / "models")
    params = {"base": "models/base", "method": "task_arithmetic", "parameters": {"lambda": 1.0},
              "experts": [{"name": "a", "adapter": "models/a", "weight": 1.0},
                          {"name": "b", "adapter": "models/b", "weight": 0.5}],
              "seed": 0, "budget": "full", "block_bytes": "1MiB",
              "output": {"dir": "merged"}, "cache_dir": ".mergepipe"}
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert pending_jobs(ws) == {"index_base": 1, "index_expert": 2, "plan": 1, "merge": 1, "verify": 1, "all": 1}
    smk(ws)
    assert (ws / "merged" / "model.safetensors").is_file()
    assert (ws / "logs" / "verify.txt").read_text().startswith("merged: OK")
    assert job_counts(smk(ws)) == {}
    config = ws / "models" / "b" / "adapter_config.json"
    stamp = os.stat(ws / "merged" / "manifest.json").st_mtime_ns + 10**9
    os.utime(config, ns=(stamp, stamp))
    assert pending_jobs(ws).get("index_expert") == 1


def test_an_adapter_given_by_hub_id_is_read_from_the_local_cache(tmp_path_factory, monkeypatch):
    """`adapter: org/name` resolves, in the rules as in `mergepipe run`, to its snapshot in the
    local Hugging Face cache (HF_HUB_CACHE; never the network): indexed, merged, then a no-op;
    an id that is not in the cache is refused in one line naming it."""
    ws = make_workspace(tmp_path_factory.mktemp("smk-adapter-hub"))
    _family(ws / "models")
    hub = tmp_path_factory.mktemp("hf") / "hub"
    repo = hub / "models--someone--lora-b"
    snapshot = repo / "snapshots" / "c0ffee"
    shutil.copytree(ws / "models" / "b", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    shutil.rmtree(ws / "models" / "b")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    params = {"base": "models/base", "method": "task_arithmetic", "parameters": {"lambda": 1.0},
              "experts": [{"name": "a", "adapter": "models/a", "weight": 1.0},
                          {"name": "b", "adapter": "someone/lora-b", "weight": 0.5}],
              "seed": 0, "budget": "full", "output": {"dir": "merged"}, "cache_dir": ".mergepipe"}
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert pending_jobs(ws) == {"index_base": 1, "index_expert": 2, "plan": 1, "merge": 1, "verify": 1, "all": 1}
    smk(ws)
    plan = json.loads((ws / "merged" / "manifest.json").read_text())["plan"]
    assert {e["name"]: e["path"] for e in plan["experts"]}["b"] == snapshot.as_posix()
    assert job_counts(smk(ws)) == {}
    params["experts"][1]["adapter"] = "someone/missing"
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = smk(ws, "-n", check=False)
    assert proc.returncode != 0
    assert ("params.yaml: experts[1].adapter: Hugging Face model 'someone/missing' is neither a local folder nor "
            "in the local Hugging Face cache") in proc.stdout + proc.stderr
