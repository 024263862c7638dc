"""Per-tensor overhead: a checkpoint of many one-element tensors (MoE checkpoints have tens
of thousands of tensors), merged end to end.

    .venv/bin/python bench/many_tensors.py [--tensors 100000] [--rounds 3] [--json out.json]

Writes a base and two experts of N one-element tensors (--dtype BF16, the default, or F32;
every tensor differs from the base; 100,000 tensors = 0.2 MB of bf16 data, ~8 MB with
headers), then, per round,
with a fresh cache each time, times as separate processes:
  run    `mergepipe run params.yaml` (index + plan + merge + verify), cold index cache;
  merge  `mergepipe merge plan.json` with the index cached (the merge engine alone, plus
         interpreter start and imports).
Reports the median (min-max) wall seconds and peak RSS (ru_maxrss) of each.
Target (issue 15): 100,000 tensors merge in <= 5 s and <= 300 MB.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import run_measured  # noqa: E402
from mergepipe.index.cache import MERGES, CacheLayout

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")


def write_model(folder: Path, values: list[float], dtype: str = "F32") -> None:
    """One safetensors file of len(values) tensors t.00000.. of shape [1], F32 or BF16 (written by
    hand: fast, and no torch needed; the values are exact in bf16)."""
    folder.mkdir(parents=True)
    width = len(str(len(values)))
    size = 4 if dtype == "F32" else 2
    header = {"__metadata__": {"format": "pt"}}
    for i in range(len(values)):
        header[f"model.t.{i:0{width}d}.weight"] = {"dtype": dtype, "shape": [1],
                                                    "data_offsets": [size * i, size * i + size]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    data = struct.pack(f"<{len(values)}f", *values)
    if dtype == "BF16":  # the upper half of each fp32
        data = b"".join(data[4 * i + 2:4 * i + 4] for i in range(len(values)))
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--method", default="task_arithmetic")
    ap.add_argument("--dtype", default="BF16", choices=["BF16", "F32"])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    n = args.tensors
    work = Path(tempfile.mkdtemp(prefix="mergepipe-many-"))
    try:
        write_model(work / "base", [float(i % 97) for i in range(n)], args.dtype)
        write_model(work / "e1", [float(i % 97) + 0.5 for i in range(n)], args.dtype)
        write_model(work / "e2", [float(i % 97) - 0.25 for i in range(n)], args.dtype)
        params = {"base": "base", "experts": [{"name": "e1", "path": "e1", "weight": 1.0},
                                              {"name": "e2", "path": "e2", "weight": 0.5}],
                  "method": args.method, "parameters": {}, "seed": 0, "budget": "full",
                  "block_bytes": "1MiB", "output": {"dir": "out"}}
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        results: dict[str, list] = {"run": [], "merge": []}
        for r in range(args.rounds):
            shutil.rmtree(work / ".mergepipe", ignore_errors=True)
            shutil.rmtree(work / "out", ignore_errors=True)
            shutil.rmtree(work / "out2", ignore_errors=True)
            m = run_measured([PY, "-m", "mergepipe", "run", "params.yaml", "-q"], cwd=work, log=work / "log.txt")
            assert m.returncode == 0, m.stderr_tail
            results["run"].append(m)
            m = run_measured([PY, "-m", "mergepipe", "plan", "params.yaml", "-q", "-o", "plan.json"], cwd=work,
                             log=work / "log.txt")
            assert m.returncode == 0, m.stderr_tail
            # no restore: merge for real
            shutil.rmtree(CacheLayout(work / ".mergepipe").folder(MERGES), ignore_errors=True)
            m = run_measured([PY, "-m", "mergepipe", "merge", "plan.json", "-o", "out2", "-q"], cwd=work,
                             log=work / "log.txt")
            assert m.returncode == 0, m.stderr_tail
            results["merge"].append(m)
            print(f"round {r + 1}: run {results['run'][-1].wall_s:.2f} s "
                  f"{results['run'][-1].max_rss_bytes / 1e6:.0f} MB; "
                  f"merge {m.wall_s:.2f} s {m.max_rss_bytes / 1e6:.0f} MB",
                  file=sys.stderr)
        size = (work / "base" / "model.safetensors").stat().st_size
        summary = {"tensors": n, "dtype": args.dtype, "file_bytes": size, "method": args.method,
                   "rounds": args.rounds}
        for what, ms in results.items():
            walls, rss = [m.wall_s for m in ms], [m.max_rss_bytes for m in ms]
            summary[what] = {"wall_s_median": round(statistics.median(walls), 2),
                             "wall_s_min": round(min(walls), 2), "wall_s_max": round(max(walls), 2),
                             "peak_rss_mb_median": round(statistics.median(rss) / 1e6),
                             "load_avg": [round(m.loadavg_before, 2) for m in ms]}
        print(json.dumps(summary, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
