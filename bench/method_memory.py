"""Issue 14's memory bound: every registered method, full budget, on the bench family.

    nice .venv/bin/python bench/method_memory.py --family bench/out/family-bench-k4 \\
        --out bench/out/method_memory

One whole `mergepipe run` per method (fresh output, the store's merges removed, indexes
and joint statistics cached from a first run so the number is the merge's, not the
index's; the first run's peak is recorded too), with bench/measure.run_measured's peak
RSS (ru_maxrss: anonymous + file-backed pages the process touched). Peak memory does not
depend on what else runs, so this can run on a busy machine; walls there are not
comparable and are reported only as a sanity check. Methods that take at most N experts
get the first N; parameters are each method's mergekit-style defaults plus what it needs.
Writes OUT/results.json and OUT/report.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import measure  # noqa: E402

from mergepipe.methods import METHODS  # noqa: E402
from mergepipe.index.cache import MERGES, CacheLayout

# what a method needs besides its defaults (per-expert knobs go to every expert)
PARAMS = {"slerp": {"t": 0.5}, "nearswap": {"t": 0.01}, "passthrough": {"scale": 1.0},
          "nuslerp": {}, "multislerp": {}, "karcher": {}}
EXPERT_KNOBS = {"ties": {"density": 0.5}, "dare_ties": {"density": 0.5}, "dare_linear": {"density": 0.5},
                "breadcrumbs": {"density": 0.9, "gamma": 0.01}, "breadcrumbs_ties": {"density": 0.9, "gamma": 0.01},
                "della": {"density": 0.5}, "della_linear": {"density": 0.5}}
WEIGHTS = [1.0, 0.5, 0.7, 0.3]


def config(out: Path, family: Path, method: str, k: int) -> Path:
    experts = [{"name": f"expert_{i}", "path": str(family / f"expert_{i}"), "weight": WEIGHTS[i],
                **EXPERT_KNOBS.get(method, {})} for i in range(k)]
    cfg = {"base": str(family / "base"), "experts": experts, "method": method,
           "parameters": PARAMS.get(method, {}), "seed": 0, "budget": "full", "block_bytes": "1MiB",
           "output": {"dir": str(out / "runs" / method)}, "cache_dir": str(out / "cache")}
    path = out / "configs" / f"{method}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--methods", nargs="*", default=None)
    args = ap.parse_args()
    args.family, args.out = args.family.resolve(), args.out.resolve()  # configs live elsewhere
    args.out.mkdir(parents=True, exist_ok=True)
    n_family = len(list(args.family.glob("expert_*")))
    results = {}
    for name in args.methods or sorted(METHODS):
        m = METHODS[name]
        k = min(n_family, m.max_experts or n_family)
        cfg = config(args.out, args.family, name, k)
        argv = [str(ROOT / ".venv" / "bin" / "python"), "-m", "mergepipe", "run", str(cfg), "-q"]
        rows = []
        for attempt in ("first", "merge"):  # first: indexes/statistics may be built; then the merge alone
            shutil.rmtree(args.out / "runs" / name, ignore_errors=True)
            shutil.rmtree(CacheLayout(args.out / "cache").folder(MERGES), ignore_errors=True)
            r = measure.run_measured(argv, log=args.out / f"{name}.log")
            rows.append({"attempt": attempt, "rc": r.returncode, "wall_s": round(r.wall_s, 2),
                         "max_rss_mib": round(r.max_rss_bytes / 2**20, 1),
                         "peak_anon_mib": round(r.peak_rss_anon_bytes / 2**20, 1), "error": r.stderr_tail[-300:]})
            print(name, rows[-1], flush=True)
        results[name] = {"experts": k, "runs": rows}
        shutil.rmtree(args.out / "runs" / name, ignore_errors=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    lines = ["| method | experts | peak RSS, merge (MiB) | anon (MiB) | peak RSS, first run (MiB) | wall, merge (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in sorted(results.items()):
        first, merge = r["runs"]
        ok = "" if merge["rc"] == 0 else f" (exit {merge['rc']})"
        lines.append(f"| {name}{ok} | {r['experts']} | {merge['max_rss_mib']} | {merge['peak_anon_mib']} | "
                     f"{first['max_rss_mib']} | {merge['wall_s']} |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = sorted(n for n, r in results.items() if any(x["rc"] for x in r["runs"]))
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see {args.out}/<method>.log)")


if __name__ == "__main__":
    main()
