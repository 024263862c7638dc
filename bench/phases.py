"""Where the wall time of one `mergepipe run` goes, by phase of the main thread.

    .venv/bin/python bench/phases.py CONFIG --budget 10% [--cold] [--threads 2]

Runs the same steps as `mergepipe run` in this process (config, plan from the
cached index, merge, verify) with timers around the main thread's work: waiting
for the reader threads, the method's math (the compiled bf16 kernels included),
converting blocks (bf16 -> fp32 and back, deltas: torch path only), writing (merged
blocks; and copied runs where direct writes append them), fsync,
hashing the output (a thread of its own: only what the main thread waits for at the
end shows), verifying. Reader threads overlap the main thread, so their time shows
only as "wait for reads". Prints a
table and JSON; the merge goes to a temporary folder that is deleted.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

T0 = time.perf_counter()
import mergepipe.cli  # noqa: E402,F401  (import cost is a phase of its own; torch is imported only if a block needs it)
from mergepipe.engine import hashing  # noqa: E402
from mergepipe.engine import merge as engine  # noqa: E402
from mergepipe.engine import work as engine_work  # noqa: E402
from mergepipe.output import manifest  # noqa: E402
from mergepipe.commands import pipeline  # noqa: E402
from mergepipe.config.params import load_config  # noqa: E402
from mergepipe.methods import _compiled as compiled, registry  # noqa: E402
from mergepipe.checkpoint.safetensors import SafetensorsWriter  # noqa: E402
from mergepipe.index.store import Store  # noqa: E402
from mergepipe.index.cache import MERGES, CacheLayout

IMPORT_S = time.perf_counter() - T0
spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(name: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] += time.perf_counter() - t
            calls[name] += 1
    return wrapper


# Long: each timed engine phase is patched in, then one run is accounted; patches and sums read together.
def main() -> int:  # noqa: PLR0915
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--budget", default="full")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="evict the model files first")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import measure

    cfg = load_config(args.config, overrides={"budget": args.budget})
    if args.cold:
        files = [f for p in [cfg.base, *(e.path for e in cfg.experts)] for f in measure.model_files(p)]
        measure.evict(files)
    main_thread = __import__("threading").main_thread()
    real_result = Future.result

    def result(self, timeout=None):
        if __import__("threading").current_thread() is not main_thread:
            return real_result(self, timeout)
        t = time.perf_counter()
        try:
            return real_result(self, timeout)
        finally:
            spent["wait for reads (main thread)"] += time.perf_counter() - t

    Future.result = result
    for m in registry.METHODS.values():
        object.__setattr__(m, "fn", timed("method math", m.fn))
    compiled.CompiledCombine.__call__ = timed("method math", compiled.CompiledCombine.__call__)
    hashing.OutputHasher.finish = timed("wait for output hashing", hashing.OutputHasher.finish)
    in_unit = [False]  # a write inside merge_unit (merged blocks) or outside it (copied runs, direct writes)
    real_write = SafetensorsWriter.write_rows

    def write_rows(*a, **kw):
        t = time.perf_counter()
        try:
            return real_write(*a, **kw)
        finally:
            key = "write merged blocks" if in_unit[0] else "write outside units (packs, copied runs)"
            spent[key] += time.perf_counter() - t
    SafetensorsWriter.write_rows = write_rows
    real_unit = engine_work.merge_unit  # as the work items call it

    def merge_unit(*a, **kw):
        in_unit[0] = True
        try:
            return real_unit(*a, **kw)
        finally:
            in_unit[0] = False
    SafetensorsWriter.close = timed("fsync + close", SafetensorsWriter.close)
    engine.hash_file = timed("hash output files", engine.hash_file)
    engine.hash_weight_file = timed("hash output files", engine.hash_weight_file)
    manifest.hash_file = engine.hash_file
    pipeline.hash_file = engine.hash_file
    engine_work.merge_unit = timed("merge_unit (all)", merge_unit)

    out = Path(tempfile.mkdtemp(prefix="mergepipe-phases-"))
    try:
        store = Store(cfg.cache_dir)
        shutil.rmtree(CacheLayout(cfg.cache_dir).folder(MERGES), ignore_errors=True)
        t = time.perf_counter()
        plan, inputs = pipeline.plan_config(cfg, store, threads=args.threads)
        spent["plan (index from cache)"] = time.perf_counter() - t
        t = time.perf_counter()
        man = pipeline.merge_plan(plan, inputs, out / "merged", store, threads=args.threads)
        merge_total = time.perf_counter() - t
        hash_in_merge = spent["hash output files"]
        t = time.perf_counter()
        manifest.verify_outputs(out / "merged")
        spent["verify (rehash output)"] = time.perf_counter() - t
        shutil.rmtree(CacheLayout(cfg.cache_dir).folder(MERGES), ignore_errors=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    spent["hash output files"] = hash_in_merge  # verify's own rehash is in its row
    spent["convert blocks, deltas, cast"] = (spent["merge_unit (all)"] - spent["method math"]
                                             - spent["write merged blocks"])
    del spent["merge_unit (all)"]
    accounted = sum(v for k, v in spent.items() if k not in ("plan (index from cache)", "verify (rehash output)"))
    spent["merge: other (loop, base-only blocks, manifest)"] = merge_total - accounted
    rows = {"import mergepipe (+ numba kernels, torch if used)": IMPORT_S, **spent}
    total = IMPORT_S + spent["plan (index from cache)"] + merge_total + spent["verify (rehash output)"]
    print(f"budget {args.budget}{' (cold)' if args.cold else ''}: expert bytes read "
          f"{man['bytes']['expert_bytes_read'] / 2**20:,.0f} MiB, "
          f"base {man['bytes']['base_bytes_read'] / 2**20:,.0f} MiB, "
          f"written {man['bytes']['bytes_written'] / 2**20:,.0f} MiB; total {total:.2f} s")
    for k, v in rows.items():
        print(f"  {k:48s} {v:7.2f} s  {100 * v / total:5.1f}%")
    print(json.dumps({"budget": args.budget, "cold": args.cold, "total_s": total, "phases_s": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
