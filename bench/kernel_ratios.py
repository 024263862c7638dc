"""Per-element cost of the bf16 TIES kernel and of eq_limit's scan against task arithmetic's
kernel, at every installed x86-64 build this CPU runs (issue 30: TIES at task arithmetic's
speed). One process, best of 7 calls per kernel, so a busy machine slows all alike; run it on a
quiet one:

    .venv/bin/python bench/kernel_ratios.py [--elements 524288] [--experts 3]
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from mergepipe.methods import _ckernels
from mergepipe.util import cpu


def _ns_per_element(fn, n: int, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e9 / n


def measure(level: int, n: int, k: int) -> dict[str, float]:
    kernels = _ckernels._bind(ctypes.CDLL(str(cpu.build_path(_ckernels.MODULE, level))), cpu.NAMES[level])
    rng = np.random.default_rng(0)
    b = ((rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    bf = (b.astype(np.uint32) << 16).view(np.float32)
    es = tuple(((bf + rng.standard_normal(n).astype(np.float32) * 1e-3).view(np.uint32) >> 16).astype(np.uint16)
               for _ in range(k))
    w = np.linspace(1.0, 0.5, k).astype(np.float32)
    out = np.empty(n, np.uint16)
    ta = _ns_per_element(lambda: kernels.task_arithmetic_bf16(b, es, w, np.float32(w.sum()), False,
                                                              np.float32(1.0), False, out), n)
    ties = _ns_per_element(lambda: kernels.ties_bf16(b, es, w, np.full(k, kernels.CUT, np.int64),
                                                     np.full(k, 1e-3, np.float32), np.full(k, n // 2, np.int64),
                                                     True, np.float32(1.0), False, out), n)
    scan = _ns_per_element(lambda: kernels.eq_limit(b, es[0], np.float32(-1.0), 1), n)
    return {"task_arithmetic_ns": ta, "ties_ns": ties, "eq_limit_ns": scan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 19)
    ap.add_argument("--experts", type=int, default=3)
    args = ap.parse_args()
    print("level        TA ns/el  TIES ns/el  TIES/TA  eq_limit/TA")
    for level in cpu.BUILT:
        if level > cpu.allowed_level() or cpu.build_path(_ckernels.MODULE, level) is None:
            continue
        r = measure(level, args.elements, args.experts)
        print(f"{cpu.NAMES[level]:<12} {r['task_arithmetic_ns']:8.3f}  {r['ties_ns']:10.3f}  "
              f"{r['ties_ns'] / r['task_arithmetic_ns']:7.2f}  {r['eq_limit_ns'] / r['task_arithmetic_ns']:11.2f}")


if __name__ == "__main__":
    main()
