"""LoRA adapter merges: `mergepipe run` of task arithmetic over K PEFT adapters against `cp -r` of
the base's files and mergekit 0.1.5's `mergekit-yaml` on the same `base+adapter` recipe (issue
25's targets: <= 2x cp, <= 0.1x mergekit, peak RSS <= 1.5 GB, K=16 costs less than one more base
copy than K=8).

    flock -x /tmp/cpu.lock .venv/bin/python bench/adapters.py --family bench/out/family-bench-k1 \
        [--preset bench] [--ks 8,16] [--rounds 3] [--mergekit-ks 8] [--rank 16] [--json out.json]

FAMILY is made by `mergepipe demo --preset PRESET --experts 1` unless it holds base/ already; the
adapters (r = RANK on every linear layer, lora_alpha = 2r, fp32 A and B from a seeded generator,
B not zero) are written beside it as PEFT saves them: adapter_model.safetensors with PEFT's key
names and adapter_config.json. Every contender is one child process (bench/measure.py: wall,
user+sys CPU, peak RSS), page cache warm (base and adapters read before each run), contenders
alternated round by round, outputs removed and synced between runs. mergepipe's indexes stay
cached after its first (recorded, untimed-for-the-median) run, as bench/run.py does; its merge
store is emptied before each run. mergekit gets a fresh --lora-merge-cache every run (a kept one
would skip the merges it exists for). Prints medians (min-max) and writes every run to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402
from mergepipe.index.cache import MERGES, CacheLayout

MP = [sys.executable, "-m", "mergepipe"]
MERGEKIT = ROOT / ".venv-mergekit" / "bin" / "mergekit-yaml"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weights(k: int) -> list[float]:
    """Task weights, fixed per adapter index (K=16 extends K=8's)."""
    return [round(0.3 + 0.05 * (i % 9), 2) for i in range(k)]


def linear_shapes(base: Path) -> dict[str, tuple[int, int]]:
    """Every 2-D `*_proj.weight` of the base: module name -> (out, in)."""
    from safetensors import safe_open
    shapes = {}
    for f in measure.model_files(base):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR:
                    shapes[module] = tuple(st.get_slice(key).get_shape())
    return dict(sorted(shapes.items()))


def write_adapter(folder: Path, base: Path, shapes: dict[str, tuple[int, int]], *, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of `base`: A ~ N(0, 1/in), B ~ N(0, 1e-3^2), both fp32."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_out, n_in) in shapes.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
        tensors[f"{prefix}.lora_B.weight"] = 1e-3 * torch.randn(n_out, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in shapes}),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
              "base_model_name_or_path": str(base)}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def make_inputs(family: Path, preset: str, k_max: int, rank: int) -> list[Path]:
    """The family and its adapters, made in a child process: torch imported here would raise
    this process's peak RSS, the floor of every contender's ru_maxrss (see measure.run_measured)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import adapters; "
            "adapters.make_family_and_adapters(adapters.Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), "
            "int(sys.argv[5]))")
    subprocess.run([sys.executable, "-c", code, str(HERE), str(family), preset, str(k_max), str(rank)], check=True)
    return [family / f"adapter_r{rank}_{i}" for i in range(k_max)]


def make_family_and_adapters(family: Path, preset: str, k_max: int, rank: int) -> None:
    if not (family / "base").is_dir():
        subprocess.run([*MP, "demo", str(family), "--preset", preset, "--experts", "1", "--quiet"], check=True)
    base = family / "base"
    shapes = linear_shapes(base)
    for i in range(k_max):
        folder = family / f"adapter_r{rank}_{i}"
        if not (folder / "adapter_config.json").exists():
            write_adapter(folder, base, shapes, rank=rank, seed=1000 + i)


def mp_config(work: Path, base: Path, adapters: list[Path]) -> Path:
    lines = [f"base: {base}", "experts:"]
    lines += [f"  - {{name: a{i}, adapter: {a}, weight: {w}}}" for i, (a, w) in
              enumerate(zip(adapters, weights(len(adapters)), strict=True))]
    lines += ["method: task_arithmetic", "parameters: {lambda: 1.0}", "seed: 0", "budget: full",
              f"output: {{dir: {work / 'unused'}}}", f"cache_dir: {work / 'cache'}"]
    path = work / "configs" / f"mp_k{len(adapters)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def mk_config(work: Path, base: Path, adapters: list[Path]) -> Path:
    lines = ["merge_method: task_arithmetic", f"base_model: {base}", "models:"]
    lines += [f"  - {{model: {base}+{a}, parameters: {{weight: {w}}}}}" for a, w in
              zip(adapters, weights(len(adapters)), strict=True)]
    lines += ["parameters: {lambda: 1.0}", "dtype: float32", "out_dtype: bfloat16"]
    path = work / "configs" / f"mk_k{len(adapters)}.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def argv_of(tool: str, k: int, work: Path, base: Path, adapters: list[Path], out: Path) -> list[str]:
    if tool == "cp":
        return ["cp", "-r", str(base), str(out)]
    if tool == "mergepipe":
        return [*MP, "run", str(mp_config(work, base, adapters[:k])), "-o", str(out), "-q"]
    return [str(MERGEKIT), str(mk_config(work, base, adapters[:k])), str(out), "--lora-merge-cache",
            str(work / "lora-cache"), "--lazy-unpickle", "--quiet", "--no-write-model-card"]


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def run_one(tool: str, k: int, rnd: int, work: Path, base: Path, adapters: list[Path], log: Path) -> dict:
    out = work / "runs" / f"{tool}-k{k}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / "lora-cache", ignore_errors=True)
    shutil.rmtree(CacheLayout(work / "cache").folder(MERGES), ignore_errors=True)  # else a stored merge is restored
    measure.warm(measure.model_files(base) + [a / "adapter_model.safetensors" for a in adapters[:k]])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    m = measure.run_measured(argv_of(tool, k, work, base, adapters, out), env=env, cwd=ROOT, log=log)
    if m.returncode != 0:
        raise SystemExit(f"{tool} K={k} failed ({m.returncode}): {m.stderr_tail[-1500:]}")
    rec = {"tool": tool, "k": k, "round": rnd, "output_bytes": _bytes(out),
           "lora_cache_bytes": _bytes(work / "lora-cache"), **m.to_json()}
    rec.pop("argv")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work / "lora-cache", ignore_errors=True)
    subprocess.run(["sync"], check=False)  # this run's write-back must not land in the next one
    print(f"  r{rnd} {tool:9s} K={k:2d} {m.wall_s:7.2f} s  cpu {m.cpu_s:7.2f} s  "
          f"rss {m.max_rss_bytes / 2**20:7.0f} MiB (sampled anon+file {_sampled(rec) / 2**20:.0f})  "
          f"load {m.loadavg_before:.1f}", flush=True)
    return rec


def _sampled(rec: dict) -> int:
    return rec["peak_rss_anon_bytes"] + rec["peak_rss_file_bytes"]


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({(r["tool"], r["k"]) for r in runs if r["round"] > 0}):
        sel = [r for r in runs if (r["tool"], r["k"]) == key and r["round"] > 0]
        walls = [r["wall_s"] for r in sel]
        rows.append({"tool": key[0], "k": key[1], "n": len(sel), "wall_median_s": statistics.median(walls),
                     "wall_min_s": min(walls), "wall_max_s": max(walls),
                     "cpu_median_s": statistics.median(r["cpu_s"] for r in sel),
                     "max_rss_bytes": max(r["max_rss_bytes"] for r in sel),
                     "sampled_rss_bytes": max(_sampled(r) for r in sel)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", type=Path, required=True)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--ks", default="8,16")
    ap.add_argument("--mergekit-ks", default="8", help="K values mergekit runs at ('' for none)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, help="configs, caches, outputs (default FAMILY/adapter-bench)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    family = args.family.resolve()
    ks = [int(k) for k in args.ks.split(",")]
    mk_ks = [int(k) for k in args.mergekit_ks.split(",") if k]
    if mk_ks and not MERGEKIT.exists():
        print(f"{MERGEKIT} missing: make .venv-mergekit/.installed, or --mergekit-ks ''", file=sys.stderr)
        return 2
    adapters = make_inputs(family, args.preset, max(ks + mk_ks), args.rank)
    base, work = family / "base", (args.work or family / "adapter-bench").resolve()
    log = work / "bench.log"
    work.mkdir(parents=True, exist_ok=True)
    runs = [run_one("mergepipe", k, 0, work, base, adapters, log) for k in ks]  # round 0: indexes made
    contenders = [("cp", 0)] + [("mergepipe", k) for k in ks] + [("mergekit", k) for k in mk_ks]
    for rnd in range(1, args.rounds + 1):
        runs += [run_one(tool, k, rnd, work, base, adapters, log) for tool, k in contenders]
    rows = summary(runs)
    for r in rows:
        print(f"{r['tool']:9s} K={r['k']:2d} n={r['n']} wall {r['wall_median_s']:7.2f} s "
              f"({r['wall_min_s']:.2f}-{r['wall_max_s']:.2f})  cpu {r['cpu_median_s']:7.2f} s  "
              f"max rss {r['max_rss_bytes'] / 2**20:7.0f} MiB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"family": str(family), "preset": args.preset, "rank": args.rank,
                                         "base_bytes": _bytes(base), "adapter_bytes": _bytes(adapters[0]),
                                         "summary": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
