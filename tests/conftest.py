"""Shared fixtures: a seeded tiny family on disk, and config writing."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from hypothesis import settings

from mergepipe.commands.demo import make_family

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=40)
settings.register_profile("dev", deadline=None, max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory) -> dict:
    """base + 3 bf16 experts (expert_0 sharded), Llama layout, a few MB each."""
    root = tmp_path_factory.mktemp("family")
    info = make_family(root, preset="tiny", n_experts=3, seed=0)
    info["root"] = root
    return info


@pytest.fixture(scope="session")
def tiny_family_f32(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("family32")
    info = make_family(root, preset="tiny", n_experts=2, dtype="float32", tied=True, seed=1)
    info["root"] = root
    return info


def write_config(tmp_path: Path, family: dict, **overrides) -> Path:
    root = Path(family["root"])
    experts = [{"name": f"e{k}", "path": str(root / f"expert_{k}"), "weight": w}
               for k, w in zip(range(len(family["experts"])), [1.0, 0.5, 0.7, 0.3])]
    cfg = {"base": str(root / "base"), "experts": experts, "method": "task_arithmetic",
           "parameters": {"lambda": 1.0}, "seed": 0, "budget": "full", "block_bytes": "16KiB",
           "output": {"dir": str(tmp_path / "out")}, "cache_dir": str(tmp_path / "cache")}
    cfg.update(overrides)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
