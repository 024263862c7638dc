"""Shared fixtures: seeded tiny families on disk; hypothesis profiles. Plain helpers are in helpers.py."""
from __future__ import annotations

import os

import pytest
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
