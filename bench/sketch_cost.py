"""What a `sketch` plan costs against `energy` at the same budget: whole `mergepipe merge`
processes from a made plan (indexes and sketches cached, page cache warm), alternated.

    flock /tmp/mergepipe-heavy.lock .venv/bin/python bench/sketch_cost.py \
        --family bench/out/family-bench-k4 [--k 4] [--budgets 10%,25%,full] [--methods task_arithmetic,ties]
        [--rounds 3] [--json out.json]

A sketched block is merged, not copied: the base block is read and the method runs (bf16
task arithmetic and TIES in C) on it, so the CPU follows the blocks touched, not the bytes read. This prints,
per (strategy, budget): the median (min-max) wall, the expert and sketch bytes read, the
base bytes read and copied, and the one-time cost of making the sketches (first plan).
With --cold, the models' and sketches' pages are evicted before every merge (the read
from disk is then part of the time).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402
from mergepipe.index.cache import MERGES, SKETCH, CacheLayout

WEIGHTS = [1.0, 0.5, 0.7, 0.3, 0.9, 0.6, 0.8, 0.4]
MP = [str(ROOT / ".venv" / "bin" / "python"), "-m", "mergepipe"]


def config(out: Path, family: Path, k: int, strategy: str, budget: str, name: str, method: str) -> Path:
    lines = [f"base: {family / 'base'}", "experts:"]
    lines += [f"  - {{name: expert_{i}, path: {family / f'expert_{i}'}, weight: {WEIGHTS[i]}}}" for i in range(k)]
    params = "{lambda: 1.0, density: 0.5}" if method == "ties" else "{lambda: 1.0}"
    lines += [f"method: {method}", f"parameters: {params}", "seed: 0", f"budget: '{budget}'",
              "block_bytes: 1MiB", f"plan: {{strategy: {strategy}}}", f"output: {{dir: {out / 'runs' / name}}}",
              f"cache_dir: {out / 'cache'}"]
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", type=Path, required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budgets", default="10%,25%,full")
    ap.add_argument("--methods", default="task_arithmetic", help="comma-separated: task_arithmetic, ties")
    ap.add_argument("--cold", action="store_true",
                    help="evict the models' and the sketches' pages before every merge (POSIX_FADV_DONTNEED)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "sketch_cost")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.family = args.family.resolve()
    out = args.out.resolve()
    shutil.rmtree(out / "runs", ignore_errors=True)
    runs = [(mt, s, b) for mt in args.methods.split(",") for b in args.budgets.split(",")
            for s in ("energy", "sketch")]
    plans, first = {}, {}
    for mt, s, b in runs:
        name = f"{'ties_' if mt == 'ties' else ''}{s}_{b.rstrip('%')}"
        cfg = config(out, args.family, args.k, s, b, name, mt)
        plans[name] = out / "configs" / f"{name}.plan.json"
        t0 = time.perf_counter()
        m = measure.run_measured([*MP, "plan", str(cfg), "-o", str(plans[name]), "-q"], log=out / "log.txt")
        first[name] = round(time.perf_counter() - t0, 2)
        if m.returncode != 0:
            raise SystemExit(f"plan {name} failed: {m.stderr_tail}")
    walls: dict[str, list[float]] = {n: [] for n in plans}
    info: dict[str, dict] = {}
    inputs = [f for m in ["base", *(f"expert_{i}" for i in range(args.k))]
              for f in measure.model_files(args.family / m)]
    for r in range(args.rounds):
        for name, plan in plans.items():  # alternated: every configuration once per round
            dest = out / "runs" / f"{name}_{r}"
            if args.cold:
                measure.evict(inputs + sorted(CacheLayout(out / "cache").folder(SKETCH).glob("*.sk")))
            m = measure.run_measured([*MP, "merge", str(plan), "-o", str(dest), "--cache-dir", str(out / "cache"),
                                      "-q"], log=out / "log.txt")
            if m.returncode != 0:
                raise SystemExit(f"merge {name} failed: {m.stderr_tail}")
            walls[name].append(m.wall_s)
            man = json.loads((dest / "manifest.json").read_text())["bytes"]
            info[name] = {k: man.get(k, 0) for k in ("expert_bytes_read", "sketch_bytes_read", "base_bytes_read",
                                                       "base_bytes_copied", "bytes_written")}
            info[name]["peak_rss_mib"] = round(m.max_rss_bytes / 2**20)
            shutil.rmtree(dest)
            # never restored from the store
            shutil.rmtree(CacheLayout(out / "cache").folder(MERGES), ignore_errors=True)
    rows = []
    print("| strategy, budget | wall s (median, min-max) | expert MiB | sketch MiB | base read MiB | base copied MiB | "
          "first plan s |")
    print("|---|---|---|---|---|---|---|")
    for name, ws in walls.items():
        i = info[name]
        rows.append({"name": name, "walls": ws, **i, "first_plan_s": first[name]})
        print(f"| {name} | {statistics.median(ws):.2f} ({min(ws):.2f}-{max(ws):.2f}) | "
              f"{i['expert_bytes_read'] / 2**20:,.0f} | {i['sketch_bytes_read'] / 2**20:,.0f} | "
              f"{i['base_bytes_read'] / 2**20:,.0f} | {i['base_bytes_copied'] / 2**20:,.0f} | {first[name]} |")
    if args.json:
        args.json.write_text(json.dumps({"family": str(args.family), "k": args.k, "cold": args.cold, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
