"""Plot issue 13's budget sweep: wall time against budget next to bytes moved against budget.

    .venv/bin/python bench/plot_issue13.py bench/results/issue13-k4.json bench/results/issue13-k16.json \\
        -o bench/img/issue13_sweep.png

Reads the results.json files that bench/issue13.py writes (one per family). Left: median
wall of whole `mergepipe run` processes per budget (task arithmetic, warm; cold where run),
relative to the same family's full read; right: what each run moved by the manifest's
counters (expert and base bytes read, base bytes copied in the kernel, bytes written),
relative to the full read's. Where the two curves part, a fixed cost or a budget-independent
cost (the output's copy and write) dominates.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def series(res: dict, method: str, cache: str) -> tuple[list[float], list[float], list[float]]:
    by: dict[float, list[dict]] = {}
    for r in res["runs"]:
        name, budget = r["name"].rsplit("-", 1)
        if name == method and r["cache"] == cache:
            by.setdefault(float(budget.rstrip("%")), []).append(r)
    budgets = sorted(by)
    walls = [statistics.median(r["wall_s"] for r in by[b]) for b in budgets]
    moved = [by[b][0]["moved"] for b in budgets]
    return budgets, walls, moved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for path in args.results:
        res = json.loads(path.read_text())
        k = res["k"]
        for cache, style in (("warm", "-o"), ("cold", "--s")):
            budgets, walls, moved = series(res, "task_arithmetic", cache)
            if len(budgets) < 2 or budgets[-1] != 100:
                continue
            left.plot(budgets, [w / walls[-1] for w in walls], style,
                      label=f"K={k} {cache} (full {walls[-1]:.1f} s)")
            if cache == "warm":
                right.plot(budgets, [m / moved[-1] for m in moved], style,
                           label=f"K={k} (full {moved[-1] / 2**30:.1f} GiB)")
    for ax, title in ((left, "wall ÷ full read's wall"), (right, "bytes moved ÷ full read's")):
        ax.plot([0, 100], [0, 1], ":", color="grey", label="proportional to budget")
        ax.set_xlabel("budget, % of the full read's expert bytes")
        ax.set_title(title)
        ax.set_xlim(0, 102)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("mergepipe task arithmetic: does the cost follow the budget? (whole `mergepipe run` processes)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
