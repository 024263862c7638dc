"""Which build of the C kernels runs here: the one owner of "what vector width this CPU gets".

Each kernel library (index/_indexc.c, methods/_bf16c.c) is built once per x86-64 level
(setup.py): `NAME` for the baseline, `NAME_v3` (AVX2) and `NAME_v4` (AVX-512) beside it, where
the compiler can. A process loads the highest build that both the CPU supports (util/_cpu.c
reads CPUID as the compiler runtime does) and `MERGEPIPE_CPU_LEVEL` allows, so an install
made on one node runs on every node of a cluster, and a CPU without AVX-512 can be imitated
on one that has it (`make test-no-avx512`). Every build gives the same bytes
(tests/test_index_kernels.py, tests/test_merge_kernels.py): the level changes speed only.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from mergepipe.errors import ConfigError

ENV = "MERGEPIPE_CPU_LEVEL"
NAMES = {1: "x86-64", 2: "x86-64-v2", 3: "x86-64-v3", 4: "x86-64-v4"}
BUILT = (4, 3, 1)  # the levels setup.py builds (v2 runs the baseline build)
_detected: int | None = None


def detected_level() -> int:
    """The x86-64 level of this CPU and OS (1-4), 0 off x86-64 or where the probe was not built."""
    global _detected
    if _detected is None:
        path = build_path("mergepipe.util._cpu")
        _detected = int(ctypes.CDLL(str(path)).mp_cpu_level()) if path else 0
    return _detected


def allowed_level() -> int:
    """The highest level a kernel build may use here: the CPU's, capped by MERGEPIPE_CPU_LEVEL."""
    level, cap = detected_level(), os.environ.get(ENV, "").strip()
    return min(level, parse_level(cap)) if cap else level


def parse_level(text: str) -> int:
    key = text.lower().removeprefix("x86-64").removeprefix("-").removeprefix("v")
    if key in ("", "1", "2", "3", "4", "baseline"):
        return 1 if key in ("", "baseline") else int(key)
    raise ConfigError(f"{ENV}={text!r}: not an x86-64 level; use one of {', '.join(NAMES.values())}")


def build_path(module: str, level: int = 1) -> Path | None:
    """The shared library of `module`'s build for `level` (the baseline for 1), or None if not built."""
    name = module if level == 1 else f"{module}_v{level}"
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith((".so", ".pyd", ".dylib")):
        return None
    return Path(spec.origin)


def best_build(module: str) -> tuple[Path, str] | None:
    """(library, level name) of the highest build of `module` allowed here, or None if none was built."""
    allowed = allowed_level()
    for level in BUILT:
        if level <= max(allowed, 1) and (path := build_path(module, level)) is not None:
            return path, NAMES[level] if detected_level() else "baseline"
    return None
