"""util/cpu.py: a process loads the widest kernel build its CPU runs and MERGEPIPE_CPU_LEVEL
allows, never a wider one; a bad MERGEPIPE_CPU_LEVEL is one line and exit 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mergepipe.commands.demo import make_family
from mergepipe.errors import ConfigError
from mergepipe.util import cpu

# loads both kernel libraries, runs one call of each, prints the levels they loaded
PROBE = """
import json, numpy as np
from mergepipe.util import cpu
from mergepipe.index import ckernels
from mergepipe.methods import _ckernels
ix, mk = ckernels.kernels(), _ckernels.load()
b, e = np.arange(4099, dtype=np.uint16), np.arange(4099, dtype=np.uint16)[::-1].copy()
assert ix.delta_bf16(b, e, np.empty(4099, np.float32), None)[0] == 4098
out = np.empty(4099, np.uint16)
mk.task_arithmetic_bf16(b, (e,), np.ones(1, np.float32), 1.0, False, 1.0, False, out)
print(json.dumps({"detected": cpu.detected_level(), "index": ix.level, "merge": mk.level}))
"""
BUILT = cpu.build_path("mergepipe.index._indexc") is not None and cpu.build_path("mergepipe.methods._bf16c") is not None
needs_builds = pytest.mark.skipif(not BUILT or cpu.detected_level() == 0,
                                  reason="the C kernels were not built, or not an x86-64 CPU")


def _probe(cap: str | None, prefix: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k != cpu.ENV}
    if cap is not None:
        env[cpu.ENV] = cap
    proc = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected(detected: int, cap: int) -> str:
    return cpu.NAMES[max(v for v in cpu.BUILT if v <= min(detected, cap))]


@needs_builds
@pytest.mark.parametrize("cap", [None, "x86-64", "x86-64-v2", "v3", "x86-64-v4"])
def test_the_widest_build_the_cpu_runs_is_loaded(cap):
    got = _probe(cap)
    want = _expected(got["detected"], cpu.parse_level(cap) if cap else 4)
    assert got["index"] == got["merge"] == want
    assert cpu.parse_level(got["index"]) <= got["detected"]  # never a width this CPU lacks


@needs_builds
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_a_cpu_without_avx512_gets_a_build_it_runs():
    """valgrind's CPU has AVX2 and no AVX-512: the dispatch must read the CPU, not assume it."""
    got = _probe(None, ("valgrind", "-q", "--tool=none"))
    assert got["detected"] <= 3
    assert got["index"] == got["merge"] == _expected(got["detected"], 4)


@pytest.mark.parametrize("text, level", [("x86-64", 1), ("baseline", 1), ("x86-64-v2", 2), ("v3", 3), ("4", 4),
                                         ("X86-64-V4", 4)])
def test_levels_parse(text, level):
    assert cpu.parse_level(text) == level


def test_a_bad_level_is_one_line_naming_the_variable(tmp_path):
    with pytest.raises(ConfigError, match=r"MERGEPIPE_CPU_LEVEL='avx9': not an x86-64 level"):
        cpu.parse_level("avx9")
    env = {**os.environ, cpu.ENV: "avx9"}
    make_family(tmp_path / "d", preset="tiny", n_experts=1, seed=0)
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "index", str(tmp_path / "d" / "expert_0"), "--base",
                           str(tmp_path / "d" / "base"), "--cache-dir", str(tmp_path / "cache"), "-q"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "MERGEPIPE_CPU_LEVEL='avx9'" in proc.stderr
