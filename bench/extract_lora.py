"""LoRA extraction: `mergepipe extract-lora` against `mergekit-extract-lora` on one expert of a
family (issue 25's target: a ~1 GB expert at rank 64 in <= 1.5 GB RSS, faster than mergekit).

    .venv/bin/python bench/extract_lora.py FAMILY [--expert expert_0] [--rank 64] [--runs 3]

FAMILY holds base/ and the expert folder (bench/run.py's layout). Each tool runs as a child
process, warm page cache (the inputs are read once before the first run), its wall, CPU and
peak RSS of the whole process measured (bench/measure.py), output written to a temporary folder
and removed. mergekit runs with its defaults (embeddings in modules_to_save, as ours keeps a
changed embedding whole), on the CPU. Results: a table on stdout and --out JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import measure  # noqa: E402

MERGEKIT = ROOT / ".venv-mergekit" / "bin" / "mergekit-extract-lora"


def commands(base: Path, expert: Path, out: Path, *, rank: int, threads: int) -> dict[str, list[str]]:
    ours = [sys.executable, "-m", "mergepipe", "extract-lora", "-q", "--threads", str(threads), str(expert),
            "--base", str(base), "--rank", str(rank), "-o", str(out / "ours")]
    theirs = [str(MERGEKIT), "--model", str(expert), "--base-model", str(base), "--out-path", str(out / "mergekit"),
              "--max-rank", str(rank), "--quiet"]
    return {"mergepipe": ours, "mergekit": theirs}


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", type=Path)
    p.add_argument("--expert", default="expert_0", help="the expert folder inside FAMILY (default %(default)s)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="mergepipe's --threads (default %(default)s)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--skip-mergekit", action="store_true")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    base, expert = args.family / "base", args.family / args.expert
    tools = ["mergepipe"] + ([] if args.skip_mergekit else ["mergekit"])
    if "mergekit" in tools and not MERGEKIT.exists():
        print(f"{MERGEKIT} missing: make .venv-mergekit/.installed, or --skip-mergekit", file=sys.stderr)
        return 2
    measure.warm(measure.model_files(base) + measure.model_files(expert))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        work = Path(tmp)
        for run in range(args.runs):
            for tool in tools:
                argv_ = commands(base, expert, work, rank=args.rank, threads=args.threads)[tool]
                m = measure.run_measured(argv_, log=work / f"{tool}.log", cwd=ROOT)
                if m.returncode != 0:
                    print(f"{tool} failed ({m.returncode}): {m.stderr_tail}", file=sys.stderr)
                    return 1
                folder = work / ("ours" if tool == "mergepipe" else "mergekit")
                results.append({"tool": tool, "run": run, "rank": args.rank, "adapter_bytes": _size(folder),
                                **m.to_json()})
                shutil.rmtree(folder)
    expert_bytes = sum(f.stat().st_size for f in measure.model_files(expert))
    print(f"expert {expert} ({expert_bytes / 2**30:.2f} GiB), rank {args.rank}")
    print(f"{'tool':10} {'run':>3} {'wall s':>8} {'cpu s':>8} {'max RSS MiB':>12} {'adapter MiB':>12}")
    for r in results:
        print(f"{r['tool']:10} {r['run']:>3} {r['wall_s']:8.2f} {r['cpu_s']:8.2f} {r['max_rss_bytes'] / 2**20:12.1f} "
              f"{r['adapter_bytes'] / 2**20:12.1f}")
    if args.out:
        args.out.write_text(json.dumps({"expert": str(expert), "expert_bytes": expert_bytes, "runs": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
