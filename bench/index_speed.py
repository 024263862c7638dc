"""Index throughput: `mergepipe index` on a base and an expert, warm and cold page cache.

    .venv/bin/python bench/index_speed.py --family bench/out/family-bench-k8 [--rounds 3]
        [--compare-rev fefd0cf] [--json out.json]

Each run is a separate `mergepipe index` process with a fresh index cache, so it
does all the work: the base alone (block hashes), then the expert against the base
(hashes + delta statistics + exact rank cuts; the base index cached), then the same
command again (a stat-cache hit). In-process = the command's own `seconds` (no interpreter
start, imports or numba's cache load, ~0.5 s). Cold runs evict both models' files first. Reports
medians (min-max) of wall time, CPU time and MB/s of expert bytes, and the read
bandwidth of the same files measured in the same run. --compare-rev runs a git
revision of mergepipe (a worktree under /tmp) alternately with this one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import evict, model_files, read_bandwidth, run_measured, warm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")
# runs `mergepipe.cli` from a given source folder, bypassing the editable install's finder
RUNNER = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in "
          "(type(f).__module__ + type(f).__name__).lower()]; sys.path.insert(0, sys.argv.pop(1)); "
          "from mergepipe.cli import main; sys.exit(main())")


def _argv(src: Path, *args: str) -> list[str]:
    return [PY, "-c", RUNNER, str(src), *args]


def _one(src: Path, base: Path, expert: Path, *, cold: bool) -> dict:
    files = model_files(base) + model_files(expert)
    with tempfile.TemporaryDirectory(dir="/tmp") as cache:
        (evict if cold else warm)(files)
        b = run_measured(_argv(src, "index", str(base), "--cache-dir", cache))
        if cold:
            evict(files)
        else:
            warm(files)
        log = Path(cache) / "expert.json"
        e = run_measured(_argv(src, "index", str(expert), "--base", str(base), "--cache-dir", cache, "--json"),
                         log=log)
        seconds = json.loads(log.read_text())["seconds"] if e.returncode == 0 else 0.0
        again = run_measured(_argv(src, "index", str(expert), "--base", str(base), "--cache-dir", cache))
    for m in (b, e, again):
        if m.returncode != 0:
            raise SystemExit(f"index failed ({m.argv}): {m.stderr_tail}")
    return {"base_wall_s": b.wall_s, "expert_wall_s": e.wall_s, "expert_in_process_s": seconds, "expert_cpu_s": e.cpu_s,
            "expert_rss_mib": e.max_rss_bytes / 2**20, "cached_wall_s": again.wall_s,
            "expert_read_bytes": e.io.get("rchar", 0)}


def _median(rows: list[dict], key: str) -> str:
    v = [r[key] for r in rows]
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True, type=Path, help="a demo family with base/ and expert_0/")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare-rev", help="also run this git revision, alternating")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    base, expert = args.family / "base", args.family / "expert_0"
    expert_bytes = sum(p.stat().st_size for p in model_files(expert))
    contenders = {"this": ROOT}
    worktree = None
    if args.compare_rev:
        worktree = Path(tempfile.mkdtemp(prefix="mp-rev-", dir="/tmp"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(worktree),
                        args.compare_rev], check=True, capture_output=True)
        contenders[args.compare_rev] = worktree
    results: dict[str, dict[str, list[dict]]] = {k: {"warm": [], "cold": []} for k in contenders}
    try:
        for r in range(args.rounds):
            for cache in ("warm", "cold"):
                for name, src in contenders.items():
                    row = _one(src, base, expert, cold=cache == "cold")
                    results[name][cache].append(row)
                    print(f"round {r + 1} {cache} {name}: expert {row['expert_wall_s']:.2f} s "
                          f"({expert_bytes / 1e6 / row['expert_wall_s']:.0f} MB/s), cpu {row['expert_cpu_s']:.2f} s, "
                          f"cached rerun {row['cached_wall_s']:.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        files = model_files(base) + model_files(expert)
        bw = {"cold": read_bandwidth(files, cold=True), "warm": read_bandwidth(files, cold=False)}
    finally:
        if worktree:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)
            shutil.rmtree(worktree, ignore_errors=True)
    print(f"\nexpert {expert} ({expert_bytes / 2**20:,.0f} MiB) against its base; medians (min-max) of "
          f"{args.rounds}; MB/s = expert bytes / wall of the whole `mergepipe index` process\n")
    print("| code | cache | expert index wall s | MB/s | in-process s | MB/s | CPU s | peak RSS MiB | cached rerun s "
          "| base alone s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, by_cache in results.items():
        for cache, rows in by_cache.items():
            mbs = statistics.median(expert_bytes / 1e6 / r["expert_wall_s"] for r in rows)
            inner = statistics.median(expert_bytes / 1e6 / r["expert_in_process_s"] for r in rows)
            print(f"| {name} | {cache} | {_median(rows, 'expert_wall_s')} | {mbs:.0f} "
                  f"| {_median(rows, 'expert_in_process_s')} | {inner:.0f} | {_median(rows, 'expert_cpu_s')} "
                  f"| {_median(rows, 'expert_rss_mib')} | {_median(rows, 'cached_wall_s')} "
                  f"| {_median(rows, 'base_wall_s')} |")
    print(f"\nread bandwidth of the same files: {json.dumps(bw)}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "bandwidth": bw, "expert_bytes": expert_bytes},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
