"""Issue 13's measurements: does a merge's cost follow its budget?

    flock /tmp/mergepipe-heavy.lock .venv/bin/python bench/issue13.py \\
        --family bench/out/family-bench-k4 --k 4 --rounds 3 --out bench/out/issue13

Whole processes (`mergepipe run`, as a user waits for it), alternated round by round
(each round runs every contender once, the start rotated), medians with min-max:

- fixed costs: a no-op `mergepipe run`, a cached `mergepipe index --base` (whole process);
- budgets: task_arithmetic at 100/50/25/10/5 % and ties at 100/10 %, warm (model files
  read into the page cache first) and, with --cold, cold (the model files evicted first);
  every run writes a fresh output with the store's merges removed (never a restore);
- per run: the bytes it moves by the manifest's counters (expert and base bytes read into
  memory, base bytes copied file to file, bytes written), and the roofline ratio
  wall / (bytes moved / bandwidth), bandwidth = this machine's page-cache (warm) or device
  (cold) sequential read rate measured by bench/measure.read_bandwidth just before.

Writes OUT/results.json and OUT/report.md. The family comes from
`mergepipe demo FAMILY --preset bench --experts K` (made if missing).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402
from mergepipe.index.cache import MERGES, CacheLayout

WEIGHTS = [1.0, 0.5, 0.7, 0.3, 0.9, 0.6, 0.8, 0.4, 1.0, 0.5, 0.7, 0.3, 0.9, 0.6, 0.8, 0.4]
MP = [str(ROOT / ".venv" / "bin" / "python"), "-m", "mergepipe"]


def config(out: Path, family: Path, k: int, method: str, budget: str, name: str) -> Path:
    params = {"lambda": 1.0, **({"density": 0.5} if method == "ties" else {})}
    lines = [f"base: {family / 'base'}", "experts:"]
    lines += [f"  - {{name: expert_{i}, path: {family / f'expert_{i}'}, weight: {WEIGHTS[i]}}}" for i in range(k)]
    # whole-block reads (strategy energy, named: without `plan:` a budget below full gets
    # sketch, whose cost bench/sketch_cost.py measures)
    lines += [f"method: {method}", f"parameters: {json.dumps(params)}", "seed: 0", f"budget: '{budget}'",
              "block_bytes: 1MiB", "plan: {strategy: energy}", f"output: {{dir: {out / 'runs' / name}}}",
              f"cache_dir: {out / 'cache'}"]
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def med(xs: list[float]) -> str:
    if not xs:
        return "–"
    m = statistics.median(xs)
    return f"{m:.2f}" if len(xs) == 1 else f"{m:.2f} ({min(xs):.2f}–{max(xs):.2f})"


# Long: the benchmark's options, then each measured phase in the order the report reads them.
def main() -> int:  # noqa: PLR0915
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", type=Path, required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "issue13")
    ap.add_argument("--cold", action="store_true", help="also cold runs of task_arithmetic 100% and 10%")
    ap.add_argument("--verify-deep", action="store_true", help="also time `mergepipe verify --deep` of a full merge")
    ap.add_argument("--no-warm", action="store_true",
                    help="skip the warm rounds (a family larger than the page cache cannot be warm)")
    ap.add_argument("--budgets", default="100%,50%,25%,10%,5%")
    ap.add_argument("--ties-budgets", default="100%,10%")
    ap.add_argument("--mergekit-runs", type=int, default=0,
                    help="warm runs of mergekit 0.1.5 task_arithmetic (full, K experts), each alternated with "
                         "one of mergepipe's full task_arithmetic (.venv-mergekit, as bench/run.py)")
    ap.add_argument("--mergekit-methods", default="task_arithmetic",
                    help="comma list of task_arithmetic, ties (ties: density 0.5, as ours)")
    args = ap.parse_args()
    out = args.out.resolve()
    family = args.family.resolve()
    # bytecode as an installed package has it (pip compiles site-packages, so mergekit's is): an
    # editable checkout under PYTHONDONTWRITEBYTECODE=1 would compile every module in every run
    subprocess.run([*MP[:1], "-m", "compileall", "-q", str(ROOT / "mergepipe")], check=True, stdout=subprocess.DEVNULL)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench.log"
    if not (family / "base").is_dir():
        m = measure.run_measured([*MP, "demo", str(family), "--preset", "bench", "--experts", str(args.k), "--quiet"],
                                 log=log)
        assert m.returncode == 0, m.stderr_tail
    files = measure.model_files(family / "base") + [f for i in range(args.k)
                                                      for f in measure.model_files(family / f"expert_{i}")]
    res: dict = {"k": args.k, "family": str(family), "rounds": args.rounds, "model_bytes": sum(
        f.stat().st_size for f in files), "loadavg_start": os.getloadavg(),
        "memory_start": measure.first_touch_rate(),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip(), "runs": [], "fixed": {}}

    contenders = [("task_arithmetic", b) for b in args.budgets.split(",") if b] + \
                 [("ties", b) for b in args.ties_budgets.split(",") if b]
    cfgs = {f"{m}-{b}": config(out, family, args.k, m, b, f"{m}-{b.replace('%', 'pct')}") for m, b in contenders}
    # index once (not measured here: the cache is what every run below uses)
    first = next(iter(cfgs.values()))
    t = time.perf_counter()
    m = measure.run_measured([*MP, "plan", str(first), "-q", "-o", str(out / "plan.json")], log=log)
    assert m.returncode == 0, m.stderr_tail
    res["index_s"] = time.perf_counter() - t
    res["index_run"] = m.to_json()  # indexing K+1 models from a fresh cache (wall, CPU, peak RSS)

    def one(name: str, cfg: Path, cache: str, rnd: int) -> None:
        target = out / "runs" / Path(cfg).stem
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(CacheLayout(out / "cache").folder(MERGES), ignore_errors=True)
        if cache == "warm":
            measure.warm(files)
            bw = measure.read_bandwidth(files[:2], cold=False)
        else:
            bw = measure.read_bandwidth(files[-2:], cold=True)  # probe on files this run mostly does not need
            measure.evict(files)
        m = measure.run_measured([*MP, "run", str(cfg), "-q"], log=log)
        assert m.returncode == 0, m.stderr_tail
        man = json.loads((target / "manifest.json").read_text())
        b = man["bytes"]
        moved = b["expert_bytes_read"] + b["base_bytes_read"] + b.get("base_bytes_copied", 0) + b["bytes_written"]
        inputs = b["expert_bytes_read"] + b["base_bytes_read"] + b.get("base_bytes_copied", 0)
        rec = {"name": name, "cache": cache, "round": rnd, **m.to_json(), "bytes": b, "moved": moved,
               "inputs": inputs, "bandwidth": bw, "roofline_s": inputs / (bw["gb_per_s"] * 1e9),
               "roofline_ratio": m.wall_s / (inputs / (bw["gb_per_s"] * 1e9))}
        res["runs"].append(rec)
        (out / "results.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")  # kept if a later run fails
        print(f"[{time.strftime('%H:%M:%S')}] {name} {cache} r{rnd}: {m.wall_s:.2f} s, cpu {m.cpu_s:.2f} s, "
              f"rss {m.max_rss_bytes / 2**20:.0f} MiB, inputs {inputs / 2**20:.0f} MiB, "
              f"ratio {rec['roofline_ratio']:.1f}", flush=True)

    # fixed costs: no-op run and cached index, whole processes
    noop_cfg = cfgs[f"task_arithmetic-{args.budgets.split(',')[-1]}"]
    subprocess.run([*MP, "run", str(noop_cfg), "-q"], check=True)
    noop, idx = [], []
    for _ in range(max(5, args.rounds)):
        m = measure.run_measured([*MP, "run", str(noop_cfg), "-q"], log=log)
        noop.append(m.wall_s)
        m = measure.run_measured([*MP, "index", str(family / "expert_0"), "--base", str(family / "base"),
                                  "--cache-dir", str(out / "cache"), "-q"], log=log)
        idx.append(m.wall_s)
    res["fixed"] = {"noop_run_s": noop, "cached_index_s": idx}
    print(f"no-op run {med(noop)} s; cached index {med(idx)} s", flush=True)

    names = list(cfgs)
    for rnd in range(0 if args.no_warm else args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            one(name, cfgs[name], "warm", rnd)
    if args.cold:
        cold = ["task_arithmetic-100%", "task_arithmetic-10%"]
        for rnd in range(args.rounds):
            for name in (cold if rnd % 2 == 0 else cold[::-1]):
                one(name, cfgs[name], "cold", rnd)
    mk = ROOT / ".venv-mergekit" / "bin" / "mergekit-yaml"
    if args.mergekit_runs and mk.exists():
        res["mergekit"], res["mergekit_by_method"] = [], {}
        for method in args.mergekit_methods.split(","):
            extra = ", density: 0.5" if method == "ties" else ""
            yml = out / "configs" / f"mk_{method}.yml"
            lines = [f"merge_method: {method}", f"base_model: {family / 'base'}", "models:"]
            lines += [f"  - {{model: {family / f'expert_{i}'}, parameters: {{weight: {WEIGHTS[i]}}}}}"
                      for i in range(args.k)]
            yml.write_text("\n".join(lines + [f"parameters: {{lambda: 1.0{extra}}}", "dtype: float32",
                                               "out_dtype: bfloat16"]) + "\n")
            for rnd in range(args.mergekit_runs):
                target = out / "runs" / "mergekit"
                shutil.rmtree(target, ignore_errors=True)
                measure.warm(files)
                m = measure.run_measured([str(mk), str(yml), str(target), "--lazy-unpickle", "--quiet",
                                          "--no-write-model-card"], env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                         "TRANSFORMERS_OFFLINE": "1"}, log=log)
                assert m.returncode == 0, m.stderr_tail
                res["mergekit_by_method"].setdefault(method, []).append(m.to_json())
                if method == "task_arithmetic":
                    res["mergekit"].append(m.to_json())
                print(f"[{time.strftime('%H:%M:%S')}] mergekit {method} warm r{rnd}: {m.wall_s:.2f} s", flush=True)
                # ours, right after, paired: rounds >= 100 (task arithmetic) or >= 200 (ties)
                one(f"{method}-100%", cfgs[f"{method}-100%"], "warm",
                    (100 if method == "task_arithmetic" else 200) + rnd)
    if args.verify_deep:  # the deep verify of one output: every byte reread and rehashed
        name = "task_arithmetic-100%"
        one(name, cfgs[name], "cold" if args.no_warm else "warm", 300)
        m = measure.run_measured([*MP, "verify", str(out / "runs" / Path(cfgs[name]).stem), "--deep"], log=log)
        assert m.returncode == 0, m.stderr_tail
        res["verify_deep"] = m.to_json()
        print(f"verify --deep: {m.wall_s:.2f} s, rss {m.max_rss_bytes / 2**20:.0f} MiB", flush=True)
    res["loadavg_end"] = os.getloadavg()
    res["memory_end"] = measure.first_touch_rate()
    (out / "results.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    (out / "report.md").write_text(report(res))
    print(report(res))
    shutil.rmtree(out / "runs", ignore_errors=True)
    return 0


def report(res: dict) -> str:
    rows = ["| run | cache | wall s | CPU s | peak RSS MiB | expert MiB read | base MiB read | base MiB copied "
            "| MiB written | roofline s | wall ÷ roofline | wall ÷ full |", "|" + "---|" * 12]
    by: dict = {}
    for r in res["runs"]:
        by.setdefault((r["name"], r["cache"]), []).append(r)
    full = {}
    for (name, cache), rs in by.items():
        if name.endswith("-100%"):
            full[(name.split("-")[0], cache)] = statistics.median(r["wall_s"] for r in rs)
    for (name, cache), rs in by.items():
        b = rs[0]["bytes"]
        walls = [r["wall_s"] for r in rs]
        f = full.get((name.split("-")[0], cache))
        rows.append(f"| {name} | {cache} | {med(walls)} | {med([r['cpu_s'] for r in rs])} | "
                    f"{statistics.median(r['max_rss_bytes'] for r in rs) / 2**20:,.0f} | "
                    f"{b['expert_bytes_read'] / 2**20:,.0f} | {b['base_bytes_read'] / 2**20:,.0f} | "
                    f"{b.get('base_bytes_copied', 0) / 2**20:,.0f} | {b['bytes_written'] / 2**20:,.0f} | "
                    f"{statistics.median(r['roofline_s'] for r in rs):.2f} | "
                    f"{statistics.median(r['roofline_ratio'] for r in rs):.1f} | "
                    + (f"{f / statistics.median(walls):.2f}× faster |" if f else "– |"))
    fx = res["fixed"]
    extra = []
    if "index_run" in res:
        ir = res["index_run"]
        extra.append(f"indexing the {res['k'] + 1} models from a fresh cache (`mergepipe plan`): {ir['wall_s']:.1f} s, "
                     f"{res['model_bytes'] / ir['wall_s'] / 1e6:.0f} MB/s of model files, peak RSS "
                     f"{ir['max_rss_bytes'] / 2**20:,.0f} MiB")
    if "verify_deep" in res:
        vd = res["verify_deep"]
        extra.append(f"`mergepipe verify --deep` of the full merge: {vd['wall_s']:.1f} s, peak RSS "
                     f"{vd['max_rss_bytes'] / 2**20:,.0f} MiB")
    by_method = res.get("mergekit_by_method") or ({"task_arithmetic": res["mergekit"]} if res.get("mergekit") else {})
    for method, runs in by_method.items():
        lo = 100 if method == "task_arithmetic" else 200
        mk = [m["wall_s"] for m in runs]
        ours = [r["wall_s"] for r in res["runs"] if lo <= r["round"] < lo + 100]
        rows.append(f"| mergekit {method} (full, paired with ours right after: {med(ours)} s) | warm | "
                    f"{med(mk)} | {med([m['cpu_s'] for m in runs])} | "
                    f"{statistics.median(m['max_rss_bytes'] for m in runs) / 2**20:,.0f} | – | – | – | – | – | – | "
                    f"ours ÷ mergekit {statistics.median(ours) / statistics.median(mk):.3f} |")
    return (f"K={res['k']}, {res['model_bytes'] / 1e9:.2f} GB of model files, git {res['git']}, "
            f"load average {res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end\n\n"
            + "".join(f"memory first touch {m['first_touch_gib_s']:.1f} GiB/s against {m['reused_gib_s']:.1f} "
                      f"reused ({when}; bench/measure.first_touch_rate)\n\n"
                      for when, m in (("start", res.get("memory_start")), ("end", res.get("memory_end"))) if m)
            + f"no-op `mergepipe run`: {med(fx['noop_run_s'])} s; cached `mergepipe index --base`: "
            f"{med(fx['cached_index_s'])} s (whole processes, {len(fx['noop_run_s'])} runs)\n\n"
            + "".join(f"{line}\n\n" for line in extra) + "\n".join(rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
