"""Shared fixtures: seeded tiny families on disk; hypothesis profiles. Plain helpers: tests/helpers/."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from mergepipe.commands.demo import make_family
from mergepipe.index.store import Store

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=40)
settings.register_profile("dev", deadline=None, max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter) -> None:
    """Which C kernel builds this run exercised (tests of a wider build skip, saying why)."""
    terminalreporter.write_line(_kernel_levels())


def _kernel_levels() -> str:
    from mergepipe.util import cpu
    detected, allowed = cpu.detected_level(), cpu.allowed_level()
    if detected == 0:
        return "C kernels: not an x86-64 CPU (or not built): baseline build only"
    cap = f", capped by {cpu.ENV}={os.environ[cpu.ENV]}" if allowed < detected else ""
    return f"C kernels: CPU runs {cpu.NAMES[detected]}; kernels load {cpu.NAMES[allowed]}{cap}"


@pytest.fixture(scope="session", autouse=True)
def store_key_file(tmp_path_factory):
    """This session's store key (index/store_key.py), before any fixture merges: tests and the
    CLI processes they start (they inherit os.environ) never read or create ~/.config's."""
    from mergepipe.index.store_key import KEY_ENV
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(tmp_path_factory.getbasetemp() / "store-key" / "store.key")
    yield Path(os.environ[KEY_ENV])
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old


@pytest.fixture(scope="session")
def built_demo(tmp_path_factory):
    """The demo workspace built once a session (tests.helpers.workflow.Built). Read-only: a test
    that runs or edits anything works in its own copy_workspace() of it."""
    from tests.helpers.workflow import build_demo
    return build_demo(tmp_path_factory.mktemp("smk-built") / "ws")


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


@pytest.fixture(scope="session")
def small_family(tmp_path_factory) -> dict:
    """base + 2 bf16 experts of the "small" preset (~48 MB each), one merge ~1-3 s."""
    root = tmp_path_factory.getbasetemp() / "small-family"
    family = {"root": root, "base": root / "base", "experts": [root / "expert_0", root / "expert_1"],
              "cache": root / "cache"}  # indexed at 16 KiB blocks; tests may empty its merges/ store
    if not (root / ".done").exists():
        make_family(root, preset="small", n_experts=2, seed=0)
        store = Store(family["cache"])
        base, base_index = store.model_index(family["base"], block_bytes=16 << 10)
        for path in family["experts"]:
            expert, index = store.model_index(path, block_bytes=16 << 10)
            store.delta_index(base, base_index, expert, index)
        (root / ".done").touch()
    return family


@pytest.fixture(scope="session")
def tiny_cache(tiny_family, tmp_path_factory) -> Path:
    """A cache with the tiny family indexed at 16 KiB blocks (tests that use it empty merges/ first)."""
    root = Path(tiny_family["root"])
    cache = tmp_path_factory.getbasetemp() / "tiny-cache"
    if not (cache / ".done").exists():
        store = Store(cache)
        base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
        for k in range(len(tiny_family["experts"])):
            expert, index = store.model_index(root / f"expert_{k}", block_bytes=16 << 10)
            store.delta_index(base, base_index, expert, index)
        (cache / ".done").touch()
    return cache


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """tests/helpers/tiny_llama.py's family with its calibration text (only some of the vocabulary's
    rows are used); one per test module, so a module's cache is its own."""
    import numpy as np

    from tests.helpers.tiny_llama import WORDS, tiny_llama
    root = tiny_llama(tmp_path_factory.mktemp("llama"))
    rng = np.random.default_rng(0)
    (root / "calib.txt").write_text(" ".join(rng.choice(WORDS[:8], 600)))
    return root
