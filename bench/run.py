"""Benchmark runner: mergepipe against mergekit-yaml, a naive full read, and the
machine's own read bandwidth, measured side by side in one run.

    .venv/bin/python bench/run.py --suite quick     # < 10 min, regression check
    .venv/bin/python bench/run.py --suite full      # Qwen2.5-0.5B-shaped 1 GB models, K = 2, 4, 8
    .venv/bin/python bench/run.py --suite k4        # the full suite's K=4 head-to-head and budget rows
    .venv/bin/python bench/run.py --suite smoke     # tiny family, no mergekit (the harness test)

Every contender runs as its own process (measure.run_measured: wall, user+sys CPU,
peak RSS, /proc/<pid>/io), contenders alternate A B C A B C, and every number in
the report is a median with its min-max. Results land in bench/out/<suite>/:
results.json (every run), report.md (the tables) and *.png (plots).

Sections: machine facts and read bandwidth (cold and page cache); one-time index
cost; head-to-head at full budget (task_arithmetic and ties; warm and cold page
cache); mergepipe at budgets 100..5% (cold runs cross-check the byte counters
against page residency of the expert files); quality per budget (from
`mergepipe sweep`); scaling in K at a fixed absolute budget; sweep economics
(one 5-budget sweep against five mergekit runs); output equivalence with mergekit.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import measure  # noqa: E402
import report  # noqa: E402
from mergepipe.index.cache import MERGES, CacheLayout

WEIGHTS = [1.0, 0.5, 0.7, 0.3, 0.8, 0.4, 0.6, 0.9]
DENSITY = 0.5
METHODS = ("task_arithmetic", "ties")


@dataclass(frozen=True)
class Suite:
    name: str
    preset: str
    family_k: int  # experts generated (the largest K used)
    head_k: int  # K of the head-to-head, budget and sweep sections
    runs: int  # rounds of the head-to-head (warm)
    cold_runs: int  # rounds of the head-to-head with a cold page cache
    budget_runs: int  # rounds of the budget section (each warm and cold)
    budgets: tuple[str, ...] = ("100%", "50%", "25%", "10%", "5%")
    scaling_ks: tuple[int, ...] = (2, 4)
    scaling_budget: str = "512MiB"
    scaling_runs: int = 1
    mergekit: bool = True
    methods: tuple[str, ...] = METHODS
    budget_caches: tuple[str, ...] = ("cold", "warm")
    sections: str = "bandwidth,index,head,budgets,scaling,sweep,equivalence"
    mergekit_ties_max_k: int = 4  # mergekit ties needs ~3 GB RSS per expert GB: not at K=8 on 24 GB
    sweep_mergekit_runs: int = 5
    naive: bool = True
    naive_methods: tuple[str, ...] = METHODS
    timeout_s: float = 3600.0


SUITES = {
    # the harness's own test: every section's machinery, four processes
    "smoke": Suite("smoke", "tiny", family_k=2, head_k=2, runs=1, cold_runs=0, budget_runs=1,
                   budgets=("10%",), scaling_ks=(), scaling_budget="256KiB", mergekit=False,
                   methods=("task_arithmetic",), budget_caches=("cold",), sweep_mergekit_runs=0, timeout_s=120,
                   sections="bandwidth,head,budgets,sweep,equivalence"),
    # regression check, < 10 min: head-to-head at K=2 with the naive baseline for task_arithmetic
    # only, and the sweep's five mergekit runs estimated as 5 x the head-to-head median
    "quick": Suite("quick", "small", family_k=4, head_k=2, runs=3, cold_runs=0, budget_runs=1,
                   scaling_ks=(2, 4), scaling_budget="16MiB", scaling_runs=1, sweep_mergekit_runs=0,
                   naive_methods=("task_arithmetic",), timeout_s=600),
    "full": Suite("full", "bench", family_k=8, head_k=4, runs=3, cold_runs=1, budget_runs=3,
                  scaling_ks=(2, 4, 8), scaling_budget="512MiB", scaling_runs=3, sweep_mergekit_runs=5),
    # the full suite's K=4 rows that issue 4's targets need (~35 min with a cached index): head-to-head
    # against mergekit (one warm and one cold round; no naive baseline), budgets 100..5% (3 rounds,
    # warm and cold), the read-bandwidth limit and output equivalence
    "k4": Suite("k4", "bench", family_k=8, head_k=4, runs=1, cold_runs=1, budget_runs=3, scaling_ks=(),
                naive=False, sweep_mergekit_runs=0, sections="bandwidth,head,budgets,equivalence"),
}


@dataclass
class Env:
    suite: Suite
    out: Path
    family: Path
    cache: Path
    mp: list[str]  # mergepipe command prefix
    py: str  # python of the mergepipe venv
    mergekit_yaml: str | None
    log: Path
    results: dict = field(default_factory=dict)

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------- setup

def machine_facts() -> dict:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    lscpu = sh("lscpu")
    keep = ("Architecture", "Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L2 cache",
            "L3 cache", "Hypervisor vendor", "Flags")
    cpu = {k: v.strip() for k, _, v in (line.partition(":") for line in lscpu.splitlines())
           if k.strip() in keep and k.strip() != "Flags"}
    flags = next((v for k, _, v in (line.partition(":") for line in lscpu.splitlines()) if k.strip() == "Flags"), "")
    cpu["avx512"] = "avx512f" in flags
    mem = sh("free -b | awk '/Mem:/ {print $2}'")
    return {"cpu": cpu, "mem_bytes": int(mem) if mem.isdigit() else None, "kernel": platform.release(),
            "python": platform.python_version(),
            "disk": sh(f"df -h --output=source,fstype,size,avail {ROOT} | tail -1"),
            "block_device": sh("lsblk -d -o NAME,ROTA,SIZE,MODEL 2>/dev/null | head -5"),
            "loadavg_at_start": os.getloadavg()}


def versions(env: Env) -> dict:
    def ver(py: str, mod: str) -> str:
        r = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version('{mod}'))"],
                           capture_output=True, text=True)
        return r.stdout.strip() or "?"
    out = {"mergepipe": ver(env.py, "mergepipe"), "torch (mergepipe venv)": ver(env.py, "torch"),
           "blake3": ver(env.py, "blake3")}
    if env.mergekit_yaml:
        mk_py = str(Path(env.mergekit_yaml).parent / "python")
        out.update({"mergekit": ver(mk_py, "mergekit"), "torch (mergekit venv)": ver(mk_py, "torch"),
                    "transformers (mergekit venv)": ver(mk_py, "transformers")})
    out["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip()
    return out


def ensure_mergekit(venv: Path, env_log) -> str:
    """mergekit-yaml 0.1.5 with torch==2.13.0 in its own venv (created if missing)."""
    exe = venv / "bin" / "mergekit-yaml"
    if exe.exists():
        return str(exe)
    env_log(f"creating {venv} (mergekit==0.1.5, torch==2.13.0)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0", "mergekit==0.1.5"], check=True)
    return str(exe)


def make_family(env: Env) -> dict:
    s = env.suite
    marker = env.family / "family.json"
    want = {"preset": s.preset, "experts": s.family_k, "seed": 0}
    given = [env.family / "base", *(env.family / f"expert_{i}" for i in range(s.family_k))]
    if not marker.exists() and all(measure.model_files(p) for p in given if p.is_dir()) and all(
            p.is_dir() for p in given):
        env.say(f"using the family at {env.family} as given")
        return {"want": want, "given": True, "model_bytes": {
            p.name: sum(f.stat().st_size for f in measure.model_files(p)) for p in given}}
    if marker.exists() and json.loads(marker.read_text()).get("want") == want:
        env.say(f"family {env.family} exists ({s.preset}, K={s.family_k})")
        return json.loads(marker.read_text())
    shutil.rmtree(env.family, ignore_errors=True)
    env.say(f"generating family {s.preset} K={s.family_k} into {env.family}")
    m = measure.run_measured([*env.mp, "demo", str(env.family), "--preset", s.preset, "--experts",
                              str(s.family_k), "--quiet"], log=env.log)
    if m.returncode != 0:
        raise SystemExit(f"demo family failed: {m.stderr_tail}")
    sizes = {p.name: sum(f.stat().st_size for f in measure.model_files(p)) for p in sorted(env.family.iterdir())
             if p.is_dir()}
    info = {"want": want, "generate_s": m.wall_s, "model_bytes": sizes}
    marker.write_text(json.dumps(info, indent=1))
    return info


def model_dirs(env: Env, k: int) -> tuple[Path, list[Path]]:
    return env.family / "base", [env.family / f"expert_{i}" for i in range(k)]


def files_of(env: Env, k: int) -> tuple[list[Path], list[Path]]:
    base, experts = model_dirs(env, k)
    return measure.model_files(base), [f for e in experts for f in measure.model_files(e)]


# ---------------------------------------------------------------- configs

def mp_config(env: Env, method: str, k: int) -> Path:
    base, experts = model_dirs(env, k)
    path = env.out / "configs" / f"mp_{method}_k{k}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {"lambda": 1.0, **({"density": DENSITY} if method == "ties" else {})}
    lines = [f"base: {base}", "experts:"]
    lines += [f"  - {{name: expert_{i}, path: {e}, weight: {WEIGHTS[i]}}}" for i, e in enumerate(experts)]
    # whole-block reads (strategy energy, named: without `plan:` a budget below full gets
    # sketch, whose cost bench/sketch_cost.py measures)
    lines += [f"method: {method}", f"parameters: {json.dumps(params)}", "seed: 0", "budget: full",
              "block_bytes: 1MiB", "plan: {strategy: energy}", f"output: {{dir: {env.out / 'runs' / 'unused'}}}",
              f"cache_dir: {env.cache}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def mk_config(env: Env, method: str, k: int) -> Path:
    base, experts = model_dirs(env, k)
    path = env.out / "configs" / f"mk_{method}_k{k}.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = f", density: {DENSITY}" if method == "ties" else ""
    lines = [f"merge_method: {method}", f"base_model: {base}", "models:"]
    lines += [f"  - {{model: {e}, parameters: {{weight: {WEIGHTS[i]}{extra}}}}}" for i, e in enumerate(experts)]
    lines += ["parameters: {lambda: 1.0}", "dtype: float32", "out_dtype: bfloat16"]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- contenders

@dataclass(frozen=True)
class Contender:
    name: str  # e.g. "mergepipe ties 10%"
    tool: str  # mergepipe | mergekit | naive
    method: str
    k: int
    budget: str | None = None  # mergepipe only

    @property
    def slug(self) -> str:
        return f"{self.tool}-{self.method}-k{self.k}" + (f"-{self.budget.replace('%', 'pct')}" if self.budget else "")


def probe_limit(env: Env, k: int) -> dict | None:
    """The device's cold sequential read bandwidth right now, on family files this run does
    not read (the disk is shared and drifts: 0.18-2 GB/s within an hour here). One reader,
    and two readers on two files, as the merge tools may read with more than one thread."""
    _, experts = model_dirs(env, env.suite.family_k)
    spare = [measure.model_files(e) for e in experts[k:] if len(measure.model_files(e)) == 1]
    if not spare:
        return None
    one = measure.read_bandwidth(spare[0], cold=True)
    two = None
    if len(spare) >= 2:
        files = [spare[0][0], spare[1][0]]
        measure.evict(files)
        results: list[dict] = []
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lambda f=f: results.append(measure.read_bandwidth([f], cold=False)))
                   for f in files]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = sum(r["bytes"] for r in results)
        two = {"bytes": total, "seconds": time.perf_counter() - t0,
               "gb_per_s": total / (time.perf_counter() - t0) / 1e9}
    return {"one_reader_gb_per_s": one["gb_per_s"], "two_readers_gb_per_s": two["gb_per_s"] if two else None}


def run_contender(env: Env, c: Contender, *, cache: str, section: str, round_: int) -> dict:
    out_dir = env.out / "runs" / c.slug
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(CacheLayout(env.cache).folder(MERGES), ignore_errors=True)  # else the store restores an earlier merge
    base_files, expert_files = files_of(env, c.k)
    model = base_files + expert_files
    probe = None
    if cache == "cold":
        probe = probe_limit(env, c.k)
        measure.evict(model)
        before = measure.resident_total(expert_files)
    else:
        measure.warm(model)
        before = measure.resident_total(expert_files)
    run_env = dict(os.environ)
    if c.tool == "mergepipe":
        argv = [*env.mp, "run", str(mp_config(env, c.method, c.k)), "--budget", c.budget or "full",
                "-o", str(out_dir), "-q"]
    elif c.tool == "mergekit":
        argv = [env.mergekit_yaml, str(mk_config(env, c.method, c.k)), str(out_dir), "--lazy-unpickle",
                "--quiet", "--no-write-model-card"]
        run_env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    else:
        base, experts = model_dirs(env, c.k)
        argv = [env.py, str(HERE / "naive_merge.py"), "--method", c.method, "--base", str(base), "-o", str(out_dir)]
        argv += [a for i, e in enumerate(experts) for a in ("--expert", f"{e}:{WEIGHTS[i]}")]
        if c.method == "ties":
            argv += ["--density", str(DENSITY)]
    run_log = env.out / "logs" / f"{c.slug}.log"
    run_log.parent.mkdir(parents=True, exist_ok=True)
    run_log.write_text("")
    m = measure.run_measured(argv, env=run_env, log=run_log, timeout_s=env.suite.timeout_s)
    after = measure.resident_total(expert_files)
    rec = {"section": section, "contender": c.name, "tool": c.tool, "method": c.method, "k": c.k,
           "budget": c.budget, "cache": cache, "round": round_, **m.to_json(),
           "expert_resident_before": before, "expert_resident_after": after,
           "model_bytes": sum(p.stat().st_size for p in model),
           "expert_file_bytes": sum(p.stat().st_size for p in expert_files),
           "base_file_bytes": sum(p.stat().st_size for p in base_files)}
    rec.pop("argv")
    if probe:
        rec["limit_probe"] = probe
    if m.returncode != 0:
        env.say(f"  FAILED {c.name}: rc={m.returncode}: {m.stderr_tail[-500:]}")
    elif c.tool == "mergepipe":
        man = json.loads((out_dir / "manifest.json").read_text())
        from mergepipe.output.run_record import record_path
        run_info = json.loads(record_path(out_dir).read_text())
        rec.update({k: man["bytes"][k] for k in ("expert_bytes_read", "base_bytes_read", "bytes_written",
                                                 "planned_expert_bytes", "total_expert_bytes")})
        rec.update(budget_bytes=man["budget"]["bytes"], bound=man["bound"], merge_s=run_info.get("seconds"),
                   index_bytes_read=run_info.get("index_bytes_read"))
    elif c.tool == "naive":
        for line in reversed(run_log.read_text().splitlines()):
            if line.startswith("{"):
                rec["expert_bytes_read"] = json.loads(line)["bytes_read"] - rec["base_file_bytes"]
                break
    subprocess.run(["sync"])  # write-back of this run's output must not land in the next run
    rss = rec["max_rss_bytes"] / 2**20
    env.say(f"  {section} r{round_} {cache:4s} {c.name:32s} {m.wall_s:7.1f} s  cpu {m.cpu_s:7.1f} s  "
            f"rss {rss:7.0f} MiB  rchar {m.io.get('rchar', 0) / 2**20:8.0f} MiB  "
            f"disk {m.io.get('read_bytes', 0) / 2**20:7.0f} MiB  load {m.loadavg_before:.1f}")
    env.results.setdefault("runs", []).append(rec)
    env.save()
    return rec


def alternate(env: Env, contenders: list[Contender], *, rounds: int, cache: str, section: str) -> None:
    """A B C A B C ...: drift in the machine's state hits every contender alike."""
    for r in range(1, rounds + 1):
        for c in contenders:
            run_contender(env, c, cache=cache, section=section, round_=r)


# ---------------------------------------------------------------- sections

def section_bandwidth(env: Env, tag: str) -> None:
    base_files, expert_files = files_of(env, min(2, env.suite.family_k))
    files = base_files + expert_files[-1:]  # the base and one single-file expert
    cold = measure.read_bandwidth(files, cold=True)
    warm = measure.read_bandwidth(files, cold=False)
    env.results.setdefault("bandwidth", {})[tag] = {"cold": cold, "warm": warm}
    env.say(f"read bandwidth ({tag}): cold {cold['gb_per_s']:.2f} GB/s, page cache {warm['gb_per_s']:.2f} GB/s "
            f"({cold['bytes'] / 1e9:.2f} GB)")
    env.save()


def section_index(env: Env) -> None:
    """One-time cost: index the base and every expert against it (fresh cache, cold files)."""
    shutil.rmtree(env.cache, ignore_errors=True)
    base, experts = model_dirs(env, env.suite.family_k)
    recs = []
    for i, e in enumerate(experts):
        files = measure.model_files(e) + (measure.model_files(base) if i == 0 else [])
        measure.evict(files)
        argv = [*env.mp, "index", str(e), "--base", str(base), "--cache-dir", str(env.cache), "--json", "-q"]
        m = measure.run_measured(argv, log=env.out / "logs" / "index.log")
        rec = {"model": e.name, "with_base": i == 0, **m.to_json()}
        rec.pop("argv")
        recs.append(rec)
        env.say(f"  index {e.name}{' (+ base)' if i == 0 else ''}: {m.wall_s:.1f} s, cpu {m.cpu_s:.1f} s, "
                f"rss {m.max_rss_bytes / 2**20:.0f} MiB, rchar {m.io.get('rchar', 0) / 2**20:.0f} MiB")
    env.results["index"] = recs
    env.save()


def section_head_to_head(env: Env) -> None:
    s, k = env.suite, env.suite.head_k
    contenders = []
    for method in s.methods:
        if s.mergekit:
            contenders.append(Contender(f"mergekit {method}", "mergekit", method, k))
        contenders.append(Contender(f"mergepipe {method} 100%", "mergepipe", method, k, "100%"))
        if s.naive and method in s.naive_methods:
            contenders.append(Contender(f"naive {method}", "naive", method, k))
    env.say(f"head-to-head K={k}: {s.runs} warm round(s), {s.cold_runs} cold")
    alternate(env, contenders, rounds=s.runs, cache="warm", section="head")
    alternate(env, contenders, rounds=s.cold_runs, cache="cold", section="head")


def section_budgets(env: Env) -> None:
    s, k = env.suite, env.suite.head_k
    contenders = [Contender(f"mergepipe {m} {b}", "mergepipe", m, k, b) for m in s.methods for b in s.budgets]
    env.say(f"budgets K={k}: {s.budget_runs} round(s), {' and '.join(s.budget_caches)}")
    for r in range(1, s.budget_runs + 1):
        for c in contenders:
            for cache in s.budget_caches:
                run_contender(env, c, cache=cache, section="budgets", round_=r)


def section_scaling(env: Env) -> None:
    s = env.suite
    contenders = []
    for k in s.scaling_ks:
        contenders.append(Contender(f"mergepipe task_arithmetic {s.scaling_budget} K={k}", "mergepipe",
                                    "task_arithmetic", k, s.scaling_budget))
        contenders.append(Contender(f"mergepipe ties {s.scaling_budget} K={k}", "mergepipe", "ties", k,
                                    s.scaling_budget))
        if s.mergekit and k != s.head_k:  # at head_k the report uses the head-to-head runs
            contenders.append(Contender(f"mergekit task_arithmetic K={k}", "mergekit", "task_arithmetic", k))
    env.say(f"scaling K={s.scaling_ks} at {s.scaling_budget}: {s.scaling_runs} round(s), warm")
    alternate(env, contenders, rounds=s.scaling_runs, cache="warm", section="scaling")


def section_sweep(env: Env) -> None:
    """One `mergepipe sweep` per method (index cached, files warm) and N mergekit runs."""
    s, k = env.suite, env.suite.head_k
    base_files, expert_files = files_of(env, k)
    out = {}
    for method in s.methods:
        sweep_dir = env.out / "runs" / f"sweep-{method}"
        shutil.rmtree(sweep_dir, ignore_errors=True)
        shutil.rmtree(CacheLayout(env.cache).folder(MERGES), ignore_errors=True)
        measure.warm(base_files + expert_files)
        argv = [*env.mp, "sweep", str(mp_config(env, method, k)), "--budgets", ",".join(s.budgets),
                "-o", str(sweep_dir), "-q"]
        m = measure.run_measured(argv, log=env.out / "logs" / f"sweep-{method}.log", timeout_s=s.timeout_s)
        if m.returncode != 0:
            env.say(f"  FAILED sweep {method}: {m.stderr_tail[-800:]}")
            continue
        rows = report.read_csv(sweep_dir / "sweep.csv")
        rec = {"method": method, **m.to_json(), "rows": rows}
        rec.pop("argv")
        out[method] = rec
        shutil.copyfile(sweep_dir / "sweep.png", env.out / f"sweep_{method}.png")
        env.say(f"  sweep {method}: {m.wall_s:.1f} s, cpu {m.cpu_s:.1f} s, rss {m.max_rss_bytes / 2**20:.0f} MiB, "
                f"expert reads {sum(int(r['expert_bytes_read']) for r in rows) / 2**20:.0f} MiB")
        shutil.rmtree(sweep_dir / "models", ignore_errors=True)
    env.results["sweep"] = out
    if s.mergekit and s.sweep_mergekit_runs:
        c = Contender("mergekit task_arithmetic", "mergekit", "task_arithmetic", k)
        env.say(f"  {s.sweep_mergekit_runs} mergekit runs (one per budget: mergekit has no budget)")
        alternate(env, [c], rounds=s.sweep_mergekit_runs, cache="warm", section="sweep")
    env.save()


def section_equivalence(env: Env) -> None:
    """How far each tool's full merge is from mergekit's (relative to mergekit's update)."""
    sys.path.insert(0, str(ROOT))
    from mergepipe.commands.sweep import deviation
    k = env.suite.head_k
    base, _ = model_dirs(env, k)
    out = {}
    for method in env.suite.methods:
        ref = env.out / "runs" / Contender("", "mergekit", method, k).slug
        if not (ref / "model.safetensors").exists():
            ref = env.out / "runs" / Contender("", "naive", method, k).slug
        for tool, budget in (("mergepipe", "100%"), ("naive", None)):
            other = env.out / "runs" / Contender("", tool, method, k, budget).slug
            if other == ref or not other.exists() or not ref.exists():
                continue
            d = deviation(other, ref, base)
            out[f"{tool} vs {ref.name.split('-')[0]} ({method})"] = d
            env.say(f"  {tool} {method} vs {ref.name}: relative {d['relative_update']:.3g}, "
                    f"max |diff| {d['max_abs']:.3g}")
    env.results["equivalence"] = out
    env.save()


def cleanup_outputs(env: Env) -> None:
    shutil.rmtree(env.out / "runs", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=sorted(SUITES), default="quick")
    ap.add_argument("--out", type=Path, help="results folder (default bench/out/<suite>)")
    ap.add_argument("--family", type=Path, help="family folder (default bench/out/family-<preset>-k<K>)")
    ap.add_argument("--mergekit-venv", type=Path, default=ROOT / ".venv-mergekit")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--runs", type=int, help="override the head-to-head rounds")
    ap.add_argument("--sections", help="comma-separated subset to run (default: the suite's)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep merged models under OUT/runs")
    ap.add_argument("--delete-family", action="store_true", help="delete the generated family at the end")
    args = ap.parse_args(argv)
    suite = SUITES[args.suite]
    if args.no_mergekit:
        suite = replace(suite, mergekit=False, sweep_mergekit_runs=0)
    if args.runs:
        suite = replace(suite, runs=args.runs)
    out = (args.out or HERE / "out" / suite.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    family = (args.family or HERE / "out" / f"family-{suite.preset}-k{suite.family_k}").resolve()
    venv_bin = Path(sys.executable).parent
    mp = [str(venv_bin / "mergepipe")] if (venv_bin / "mergepipe").exists() else [sys.executable, "-m", "mergepipe"]
    env = Env(suite, out, family, out / "cache", mp, sys.executable, None, out / "bench.log")
    env.log.write_text("")
    (out / "logs").mkdir(exist_ok=True)
    if suite.mergekit:
        env.mergekit_yaml = ensure_mergekit(args.mergekit_venv.resolve(), env.say)
    t0 = time.monotonic()
    env.results = {"suite": suite.__dict__, "machine": machine_facts(), "versions": versions(env),
                   "drop_caches_allowed": os.access("/proc/sys/vm/drop_caches", os.W_OK),
                   "commands": {"suite": f".venv/bin/python bench/run.py --suite {suite.name}"}}
    env.results["family"] = make_family(env)
    _, head_experts = files_of(env, suite.head_k)
    env.results["expert_header_bytes"] = sum(8 + int.from_bytes(f.open("rb").read(8), "little") for f in head_experts)
    sections = (args.sections or suite.sections).split(",")
    steps = [("bandwidth", lambda: section_bandwidth(env, "start")), ("index", lambda: section_index(env)),
             ("head", lambda: section_head_to_head(env)), ("budgets", lambda: section_budgets(env)),
             ("scaling", lambda: section_scaling(env)), ("sweep", lambda: section_sweep(env)),
             ("equivalence", lambda: section_equivalence(env)),
             ("bandwidth", lambda: section_bandwidth(env, "end"))]
    for name, fn in steps:
        if name in sections:
            fn()
    env.results["total_s"] = time.monotonic() - t0
    env.save()
    report.write_report(env.results, out)
    env.say(f"done in {env.results['total_s'] / 60:.1f} min: {out / 'report.md'}")
    if not args.keep_outputs:
        cleanup_outputs(env)
    if args.delete_family:
        shutil.rmtree(family, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
