"""Budgeted (sketch, energy) and full merges side by side, with two builds of the bf16 kernels
(issue 30 item 1): whole `mergepipe merge PLAN` processes from made plans (indexes and sketches
cached, page cache warm), every (configuration, kernel) once per round, alternated.

    flock -x /tmp/cpu.lock .venv/bin/python bench/issue30/sketch_ab.py --family DIR --k 4 \
        --klibs old=/tmp/old.so,new=/tmp/new.so --rounds 3 --json bench/results/OUT.json

Each kernel .so is a build of methods/_bf16c.c (bench/issue30/build.sh), swapped in through
runwith.py. Bytecode is cached in --out (PYTHONPYCACHEPREFIX), as an installed package's
is, even where the environment sets PYTHONDONTWRITEBYTECODE. Prints, per configuration and
kernel, the median (min-max) wall, the CPU seconds and the manifest's byte counters.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
import measure  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
WEIGHTS = [1.0, 0.5, 0.7, 0.3, 0.9, 0.6, 0.8, 0.4]
CONFIGS = [("task_arithmetic", "energy", "full"), ("task_arithmetic", "sketch", "10%"),
           ("task_arithmetic", "sketch", "25%"), ("task_arithmetic", "energy", "10%"),
           ("ties", "energy", "full"), ("ties", "sketch", "10%"), ("ties", "sketch", "25%"),
           ("ties", "energy", "10%")]
COUNTERS = ("expert_bytes_read", "sketch_bytes_read", "base_bytes_read", "base_bytes_copied", "bytes_written")


def write_config(out: Path, family: Path, k: int, method: str, strategy: str, budget: str) -> tuple[str, Path]:
    name = f"{method}_{strategy}_{budget.rstrip('%')}"
    lines = [f"base: {family / 'base'}", "experts:"]
    lines += [f"  - {{name: expert_{i}, path: {family / f'expert_{i}'}, weight: {WEIGHTS[i]}}}" for i in range(k)]
    params = "{lambda: 1.0, density: 0.5}" if method == "ties" else "{lambda: 1.0}"
    lines += [f"method: {method}", f"parameters: {params}", "seed: 0", f"budget: '{budget}'", "block_bytes: 1MiB",
              f"plan: {{strategy: {strategy}}}", f"output: {{dir: {out / 'runs' / name}}}",
              f"cache_dir: {out / 'cache'}"]
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return name, path


def one_merge(plan: Path, dest: Path, cache: Path, env: dict, log: Path) -> dict:
    m = measure.run_measured([PY, str(HERE / "runwith.py"), "merge", str(plan), "-o", str(dest), "--cache-dir",
                              str(cache), "-q"], env=env, log=log)
    if m.returncode != 0:
        raise SystemExit(f"merge {plan.name} failed: {m.stderr_tail}")
    man = json.loads((dest / "manifest.json").read_text())["bytes"]
    shutil.rmtree(dest)
    shutil.rmtree(cache / "merges", ignore_errors=True)  # never restored from the store
    return {"wall_s": m.wall_s, "cpu_s": m.cpu_s, "peak_rss_mib": round(m.max_rss_bytes / 2**20),
            **{c: man.get(c, 0) for c in COUNTERS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", type=Path, required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--klibs", required=True, help="label=path.so,label=path.so")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/sketch_ab"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    family, out = args.family.resolve(), args.out.resolve()
    klibs = dict(kv.split("=", 1) for kv in args.klibs.split(","))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(ROOT), PYTHONPYCACHEPREFIX=str(out / "pycache"))
    log = out / "log.txt"
    out.mkdir(parents=True, exist_ok=True)
    plans = {}
    for method, strategy, budget in CONFIGS:
        name, cfg = write_config(out, family, args.k, method, strategy, budget)
        plans[name] = out / "configs" / f"{name}.plan.json"
        m = measure.run_measured([PY, "-m", "mergepipe", "plan", str(cfg), "-o", str(plans[name]), "-q"], env=env,
                                 log=log)
        if m.returncode != 0:
            raise SystemExit(f"plan {name} failed: {m.stderr_tail}")
    runs: dict[tuple[str, str], list[dict]] = {(n, k): [] for n in plans for k in klibs}
    for r in range(args.rounds):
        for name, plan in plans.items():
            for label, lib in klibs.items():
                runs[name, label].append(one_merge(plan, out / "runs" / f"{name}_{label}_{r}", out / "cache",
                                                   {**env, "KLIB": lib}, log))
    print("| configuration | kernel | wall s | CPU s | expert MiB | sketch MiB | base read MiB | base copied MiB |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for (name, label), rs in runs.items():
        ws = [x["wall_s"] for x in rs]
        last = rs[-1]
        rows.append({**last, "name": name, "kernel": label, "walls": ws, "cpu_s": [x["cpu_s"] for x in rs],
                     "wall_s": statistics.median(ws)})
        mib = [last[c] / 2**20 for c in COUNTERS[:4]]
        print(f"| {name} | {label} | {statistics.median(ws):.2f} ({min(ws):.2f}-{max(ws):.2f}) | "
              f"{statistics.median(x['cpu_s'] for x in rs):.2f} | " + " | ".join(f"{v:,.0f}" for v in mib) + " |")
    if args.json:
        args.json.write_text(json.dumps({"family": str(family), "k": args.k, "klibs": klibs, "rounds": args.rounds,
                                         "loadavg": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
