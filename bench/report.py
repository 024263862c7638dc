"""Tables, target checks and plots from bench/run.py's results.json.

    .venv/bin/python bench/report.py bench/out/full     # rewrite report.md and the PNGs

Every figure is a median over rounds with its min-max; sizes in MiB (2^20) or
GB (10^9) as labelled; bandwidths in GB/s (10^9 bytes per second).
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

MiB = 2**20


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _stats(values: list[float]) -> tuple[float, float, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def _fmt(st: tuple[float, float, float] | None, scale: float = 1.0, digits: int = 1) -> str:
    if st is None:
        return "–"
    med, lo, hi = (v / scale for v in st)
    if lo == hi:
        return f"{med:,.{digits}f}"
    return f"{med:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})"


def _med(st) -> float | None:
    return None if st is None else st[0]


def group(runs: list[dict], section: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        if r["section"] == section and r["returncode"] == 0:
            out[(r["contender"], r["cache"])].append(r)
    return out


def metric(rs: list[dict], key: str):
    if key == "rchar" or key == "read_bytes":
        return _stats([r["io"].get(key) for r in rs])
    return _stats([r.get(key) for r in rs])


def header_bytes(results: dict) -> int:
    return results.get("expert_header_bytes", 0)


def _paired(rs: list[dict], ref: list[dict]) -> list[float]:
    """wall(A) / wall(B) within each round: the machine's load drifts between rounds."""
    by_round = {r["round"]: r["wall_s"] for r in ref}
    return [r["wall_s"] / by_round[r["round"]] for r in rs if r["round"] in by_round]


def contender_table(groups: dict[tuple, list[dict]], order: list[tuple], bw: dict | None, *,
                    ratio_to: dict[str, str] | None = None) -> list[str]:
    lines = ["| contender | cache | runs | wall s | CPU user+sys s | peak RSS MiB | rchar MiB | disk read MiB "
             "| expert MiB read (counter) | expert MiB resident after (cold runs) | effective GB/s | of limit (GB/s) "
             "| wall vs mergekit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in order:
        rs = groups.get(key)
        if not rs:
            continue
        name, cache = key
        wall = metric(rs, "wall_s")
        # bytes the merge had to get through: what it read of base and experts (counter), or the model files
        touched = [((r.get("base_bytes_read") or r["base_file_bytes"]) +
                    (r.get("expert_bytes_read") if r.get("expert_bytes_read") is not None else r["expert_file_bytes"]))
                   / r["wall_s"] / 1e9 for r in rs]
        eff = _stats(touched)
        probes = [r.get("limit_probe") for r in rs if r.get("limit_probe")]
        if cache == "cold" and probes:
            fr = _stats([t * 1e9 / 1e9 / p["one_reader_gb_per_s"] for t, p in zip(touched, probes)])
            frac = f"{_med(fr):.0%} (probe {statistics.median(p['one_reader_gb_per_s'] for p in probes):.2f})"
        else:
            limit = (bw or {}).get("cold" if cache == "cold" else "warm", {}).get("gb_per_s")
            frac = f"{_med(eff) / limit:.0%}" if eff and limit else "–"
        ratio = "–"
        if ratio_to and name in ratio_to and groups.get((ratio_to[name], cache)):
            ref = _med(metric(groups[(ratio_to[name], cache)], "wall_s"))
            ratio = f"{_med(wall) / ref:.2f}×"
            paired = _paired(rs, groups[(ratio_to[name], cache)])
            if paired and len(paired) > 1:
                ratio += f" (per round {_fmt(_stats(paired), 1, 2)})"
        lines.append(f"| {name} | {cache} | {len(rs)} | {_fmt(wall)} | {_fmt(metric(rs, 'cpu_s'))} | "
                     f"{_fmt(metric(rs, 'max_rss_bytes'), MiB, 0)} | {_fmt(metric(rs, 'rchar'), MiB, 0)} | "
                     f"{_fmt(metric(rs, 'read_bytes'), MiB, 0)} | {_fmt(metric(rs, 'expert_bytes_read'), MiB, 0)} | "
                     f"{_fmt(metric(rs, 'expert_resident_after'), MiB, 0) if cache == 'cold' else '–'} | "
                     f"{_fmt(eff, 1, 2)} | {frac} | {ratio} |")
    return lines


# Long: one BENCHMARKS.md section after another, each a table written only where its results exist.
def write_report(results: dict, out: Path) -> dict:  # noqa: C901, PLR0915
    runs = results.get("runs", [])
    lines: list[str] = [f"# Benchmark report: suite `{results['suite']['name']}`", ""]
    m = results["machine"]
    lines += ["## Machine", "", f"- CPU: {m['cpu'].get('Model name', '?')}, {m['cpu'].get('CPU(s)', '?')} CPUs "
              f"({m['cpu'].get('Hypervisor vendor', 'bare metal')} guest), AVX-512: {m['cpu'].get('avx512')}",
              f"- RAM: {m['mem_bytes'] / 2**30:.1f} GiB; disk: `{m['disk']}`; kernel {m['kernel']}; "
              f"Python {m['python']}",
              f"- load average at start: {', '.join(f'{x:.1f}' for x in m['loadavg_at_start'])} "
              "(other work shares these CPUs; see each run's load in results.json)",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), ""]
    fam = results.get("family", {})
    if fam:
        sizes = fam.get("model_bytes", {})
        lines += [f"Family: preset `{fam['want']['preset']}`, K={fam['want']['experts']}, "
                  f"{sizes.get('base', 0) / 1e9:.3f} GB per model (bf16), "
                  f"generated in {fam.get('generate_s', 0):.0f} s.",
                  ""]
    bw = results.get("bandwidth", {})
    if bw:
        lines += ["## Read bandwidth (the limit)", "",
                  "One thread, 8 MiB `preadv`s, the base and one expert file; cold = evicted with "
                  "POSIX_FADV_DONTNEED first.", "", "| when | cold GB/s | page cache GB/s | GB read |",
                  "|---|---|---|---|"]
        for tag, b in bw.items():
            lines.append(f"| {tag} | {b['cold']['gb_per_s']:.2f} | {b['warm']['gb_per_s']:.2f} | "
                         f"{b['cold']['bytes'] / 1e9:.2f} |")
        lines.append("")
    limit = bw.get("start") or next(iter(bw.values()), None)
    idx = results.get("index")
    if idx:
        tot_wall = sum(r["wall_s"] for r in idx)
        lines += ["## One-time index cost", "",
                  "`mergepipe index EXPERT --base BASE` per expert, fresh cache, files evicted first (the base "
                  "is indexed with the first expert). Cached by content afterwards: every later merge, plan or "
                  "sweep on these inputs reads no index bytes.", "",
                  "| model | wall s | CPU s | peak RSS MiB | rchar MiB | disk read MiB |", "|---|---|---|---|---|---|"]
        for r in idx:
            lines.append(f"| {r['model']}{' + base' if r['with_base'] else ''} | {r['wall_s']:.1f} | "
                         f"{r['cpu_s']:.1f} | {r['max_rss_bytes'] / MiB:.0f} | {r['io'].get('rchar', 0) / MiB:,.0f} | "
                         f"{r['io'].get('read_bytes', 0) / MiB:,.0f} |")
        lines += [f"| **total** | {tot_wall:.1f} | {sum(r['cpu_s'] for r in idx):.1f} | "
                  f"{max(r['max_rss_bytes'] for r in idx) / MiB:.0f} | "
                  f"{sum(r['io'].get('rchar', 0) for r in idx) / MiB:,.0f} | "
                  f"{sum(r['io'].get('read_bytes', 0) for r in idx) / MiB:,.0f} |", ""]

    head = group(runs, "head")
    targets: dict[str, dict] = {}
    if head:
        names = sorted({k[0] for k in head}, key=lambda n: (n.split()[1], n.split()[0] != "mergekit", n))
        order = [(n, c) for c in ("warm", "cold") for n in names]
        ratio_to = {n: f"mergekit {n.split()[1]}" for n in names}
        k = next(iter(head.values()))[0]["k"]
        lines += [f"## Head-to-head at full budget (K={k})", "",
                  "warm = model files read into the page cache before the run; cold = evicted before the run "
                  "(code and the index cache stay warm). Effective GB/s = (base + expert bytes the tool read, "
                  "by mergepipe's counters or else the file sizes) / wall; 'of limit' divides by the measured "
                  "cold or page-cache bandwidth. mergepipe numbers are `mergepipe run` end to end (plan from the "
                  "cached index, merge, fsync, verify). mergekit reads its inputs through mmap, which rchar does "
                  "not count: its reads show as disk reads and page residency in cold runs.", ""]
        lines += contender_table(head, order, limit, ratio_to=ratio_to)
        lines.append("")
        for method, goal in (("task_arithmetic", 0.5), ("ties", 0.2)):
            mp = head.get((f"mergepipe {method} 100%", "warm"))
            mk = head.get((f"mergekit {method}", "warm"))
            if mp and mk:
                ratio = _med(metric(mp, "wall_s")) / _med(metric(mk, "wall_s"))
                cpu_ratio = _med(metric(mp, "cpu_s")) / _med(metric(mk, "cpu_s"))
                paired = _paired(mp, mk)
                cold = [r for c in ("cold",) for r in _paired(head.get((f"mergepipe {method} 100%", c), []),
                                                               head.get((f"mergekit {method}", c), []))]
                targets[f"{method} full-budget wall ≤ {goal}× mergekit"] = {
                    "value": f"{ratio:.2f}× (medians, warm; per round {_fmt(_stats(paired), 1, 2)}; "
                             f"CPU {cpu_ratio:.2f}×)"
                             + (f"; cold {_fmt(_stats(cold), 1, 2)}×" if cold else ""),
                    "met": ratio <= goal}
    bud = group(runs, "budgets")
    if bud:
        lines += ["## mergepipe at budgets", "",
                  "Expert bytes: mergepipe's counters (what it preads) next to the page residency of the expert "
                  "files after a cold run (mincore; files evicted first), which shows what the kernel actually "
                  "brought in. Wall and ratios are medians.", "",
                  "| method | budget | budget MiB | expert MiB read (counter) | resident after cold run MiB "
                  "| disk read cold MiB | wall warm s | wall cold s | peak RSS MiB | bytes ÷ full "
                  "| wall ÷ full (warm) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for method in ("task_arithmetic", "ties"):
            full_w = bud.get((f"mergepipe {method} 100%", "warm"))
            for b in results["suite"]["budgets"]:
                w, c = bud.get((f"mergepipe {method} {b}", "warm")), bud.get((f"mergepipe {method} {b}", "cold"))
                if not (w or c):
                    continue
                rs = (w or []) + (c or [])
                w = w or []
                bytes_ratio = wall_ratio = "–"
                if full_w and w:
                    eb = _med(metric(w, "expert_bytes_read"))
                    fb = _med(metric(full_w, "expert_bytes_read"))
                    bytes_ratio = f"1/{fb / eb:.1f}" if eb else "0"
                    wall_ratio = f"1/{_med(metric(full_w, 'wall_s')) / _med(metric(w, 'wall_s')):.2f}"
                lines.append(f"| {method} | {b} | {_fmt(metric(rs, 'budget_bytes'), MiB, 0)} | "
                             f"{_fmt(metric(rs, 'expert_bytes_read'), MiB, 1)} | "
                             f"{_fmt(metric(c or [], 'expert_resident_after'), MiB, 1)} | "
                             f"{_fmt(metric(c or [], 'read_bytes'), MiB, 0)} | {_fmt(metric(w, 'wall_s'))} | "
                             f"{_fmt(metric(c or [], 'wall_s'))} | {_fmt(metric(rs, 'max_rss_bytes'), MiB, 0)} | "
                             f"{bytes_ratio} | {wall_ratio} |")
            ten = bud.get((f"mergepipe {method} 10%", "warm"))
            if full_w and ten:
                br = _med(metric(full_w, "expert_bytes_read")) / max(1, _med(metric(ten, "expert_bytes_read")))
                total_b = ten[0]["expert_file_bytes"] / max(1, _med(metric(ten, "expert_bytes_read")))
                wr = _med(metric(full_w, "wall_s")) / _med(metric(ten, "wall_s"))
                targets[f"{method} at 10%: ≥10× fewer expert bytes than full"] = {
                    "value": f"{br:.1f}× fewer than our full-budget merge (a relative budget is a share of the "
                             f"full merge's reads, which skip byte-identical blocks); {total_b:.1f}× fewer than a "
                             "full read of the experts", "met": br >= 10}
                targets[f"{method} at 10%: ≥5× less wall than full"] = {"value": f"{wr:.2f}×", "met": wr >= 5}
        lines.append("")
        # budget soundness, counters and residency
        worst_counter = max((r["expert_bytes_read"] - r["budget_bytes"] for r in runs
                             if r["tool"] == "mergepipe" and r.get("budget_bytes") is not None), default=None)
        hdr = header_bytes(results)
        cold = [r for r in runs if r["tool"] == "mergepipe" and r["cache"] == "cold" and r.get("budget_bytes")]
        worst_res = max((r["expert_resident_after"] - r["budget_bytes"] for r in cold), default=None)
        excess = max((r["expert_resident_after"] - r["expert_bytes_read"] for r in cold), default=None)
        if worst_counter is not None:
            ok = worst_counter <= 0 and (worst_res is None or worst_res <= hdr + 64 * 4096 + 0.002 * max(
                r["budget_bytes"] for r in cold))
            targets["expert bytes read ≤ budget + headers"] = {
                "value": f"counter − budget ≤ {worst_counter / MiB:+.2f} MiB in every run; resident − budget ≤ "
                         f"{(worst_res or 0) / MiB:+.2f} MiB, resident − counter ≤ {(excess or 0) / MiB:+.2f} MiB "
                         f"after cold runs (expert headers {hdr / MiB:.2f} MiB)", "met": ok}
    rss_all = [r["max_rss_bytes"] for r in runs if r["tool"] == "mergepipe" and r["returncode"] == 0]
    rss_other = [r["max_rss_bytes"] for r in (results.get("index") or [])] + [
        r["max_rss_bytes"] for r in results.get("sweep", {}).values()]
    if rss_all:
        top = max(rss_all + rss_other)
        targets["peak RSS ≤ 1.5 GB (every mergepipe process)"] = {
            "value": f"max {top / 1e9:.2f} GB (merges {max(rss_all) / 1e9:.2f}, index/sweep "
                     f"{max(rss_other, default=0) / 1e9:.2f}); mergekit "
                     f"{max((r['max_rss_bytes'] for r in runs if r['tool'] == 'mergekit'), default=0) / 1e9:.1f} GB",
            "met": top <= 1.5e9}
    if head and limit:
        for method in ("task_arithmetic", "ties"):
            rs = (head.get((f"mergepipe {method} 100%", "cold")) or []) + \
                (group(runs, "budgets").get((f"mergepipe {method} 100%", "cold")) or [])
            if rs:
                effs = [(r["base_bytes_read"] + r["expert_bytes_read"]) / r["wall_s"] / 1e9 for r in rs]
                eff = _med(_stats(effs))
                lims = [r["limit_probe"]["one_reader_gb_per_s"] if r.get("limit_probe") else limit["cold"]["gb_per_s"]
                        for r in rs]
                fr = _med(_stats([e / li for e, li in zip(effs, lims)]))
                targets[f"{method} full-read merge ≥ 70% of cold read bandwidth"] = {
                    "value": f"{eff:.2f} GB/s = {fr:.0%} of the cold sequential bandwidth probed just before each run "
                             f"(median {statistics.median(lims):.2f} GB/s; {len(rs)} cold runs)",
                    "met": fr >= 0.7}
    # quality
    sweep = results.get("sweep", {})
    if sweep:
        lines += ["## Quality per budget", "",
                  "From `mergepipe sweep` (same inputs, K as above). Realized deviation from the full-budget merge, "
                  "relative to the update ‖M_full − W0‖ and to the weights ‖M_full‖, next to the plan's bound "
                  "(certified for task_arithmetic; for ties the same omitted mass is only a heuristic).", "",
                  "| method | budget | expert MiB read | % of expert bytes | bound (rel.) "
                  "| realized ‖M_B−M_full‖/‖M_full−W0‖ "
                  "| ‖M_B−M_full‖/‖M_full‖ | realized ≤ bound |", "|---|---|---|---|---|---|---|---|"]
        for method, rec in sweep.items():
            for row in rec["rows"]:
                bound, real = float(row["bound_relative"]), float(row["deviation_update"])
                lines.append(f"| {method} | {row['budget']} | {int(row['expert_bytes_read']) / MiB:,.1f} | "
                             f"{100 * float(row['read_fraction']):.1f} | {bound:.3g} ({row['bound_kind']}) | "
                             f"{real:.3g} | "
                             f"{float(row['deviation_weights']):.3g} | {'yes' if real <= bound + 1e-12 else 'no'} |")
        lines.append("")
        lines += [f"![sweep {m}](sweep_{m}.png)" for m in sweep] + [""]
    sc = group(runs, "scaling")
    if sc:
        budget = results["suite"]["scaling_budget"]
        lines += [f"## Scaling in K at a fixed budget ({budget})", "",
                  "| K | mergepipe TA expert MiB read | mergepipe TA wall s | mergepipe ties expert MiB read | "
                  "mergepipe ties wall s | mergekit TA wall s | mergekit TA rchar MiB | mergekit TA peak RSS MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for k in results["suite"]["scaling_ks"]:
            ta = sc.get((f"mergepipe task_arithmetic {budget} K={k}", "warm"), [])
            ti = sc.get((f"mergepipe ties {budget} K={k}", "warm"), [])
            mk = sc.get((f"mergekit task_arithmetic K={k}", "warm")) or [
                r for r in group(runs, "head").get(("mergekit task_arithmetic", "warm"), []) if r["k"] == k]
            lines.append(f"| {k} | {_fmt(metric(ta, 'expert_bytes_read'), MiB)} | {_fmt(metric(ta, 'wall_s'))} | "
                         f"{_fmt(metric(ti, 'expert_bytes_read'), MiB)} | {_fmt(metric(ti, 'wall_s'))} | "
                         f"{_fmt(metric(mk, 'wall_s'))} | {_fmt(metric(mk, 'rchar'), MiB, 0)} | "
                         f"{_fmt(metric(mk, 'max_rss_bytes'), MiB, 0)} |")
        lines.append("")
    if sweep:
        mk = group(runs, "sweep").get(("mergekit task_arithmetic", "warm"), [])
        total_exp = int(next(iter(sweep.values()))["rows"][0]["total_expert_bytes"])
        used = {f"expert_{i}" for i in range(results["suite"]["head_k"])}
        idx = [r for r in (idx or []) if r["model"] in used]
        idx_rchar = sum(r["io"].get("rchar", 0) for r in idx)
        idx_wall = sum(r["wall_s"] for r in idx)
        lines += ["## Sweep economics", "",
                  f"{len(results['suite']['budgets'])} budget(s) ({', '.join(results['suite']['budgets'])}). "
                  "mergepipe: one `mergepipe sweep` process "
                  "(index cached; plans and merges for every budget, plus the deviation table and plot). mergekit has "
                  "no budget: five runs of the same full merge. One full read of the experts = "
                  f"{total_exp / MiB:,.0f} MiB.", "",
                  "| | processes | total wall s | total CPU s | expert MiB read (counter) | rchar MiB "
                  "| ÷ one full expert read |",
                  "|---|---|---|---|---|---|---|"]
        for method, rec in sweep.items():
            exp = sum(int(r["expert_bytes_read"]) for r in rec["rows"])
            lines.append(f"| mergepipe sweep {method} | 1 | {rec['wall_s']:.1f} | {rec['cpu_s']:.1f} | "
                         f"{exp / MiB:,.0f} | "
                         f"{rec['io'].get('rchar', 0) / MiB:,.0f} | {exp / total_exp:.2f} (rchar "
                         f"{rec['io'].get('rchar', 0) / total_exp:.2f}) |")
            if method == "task_arithmetic":
                targets["sweep expert reads ≤ 2× one full read"] = {
                    "value": f"{exp / total_exp:.2f}×; with the one-time index {(exp + idx_rchar) / total_exp:.2f}×",
                    "met": exp <= 2 * total_exp}
        if idx:
            lines.append(f"| + one-time index (base and these {len(idx)} experts) | {len(idx)} | {idx_wall:.1f} | "
                         f"{sum(r['cpu_s'] for r in idx):.1f} | – | {idx_rchar / MiB:,.0f} | "
                         f"{idx_rchar / total_exp:.2f} |")
        n = len(results["suite"]["budgets"])
        if mk:
            mk_exp = sum(r["expert_file_bytes"] for r in mk)
            lines.append(f"| mergekit task_arithmetic ×{len(mk)} | {len(mk)} | {sum(r['wall_s'] for r in mk):.1f} | "
                         f"{sum(r['cpu_s'] for r in mk):.1f} | {mk_exp / MiB:,.0f} (whole files) | "
                         f"{sum(r['io'].get('rchar', 0) for r in mk) / MiB:,.0f} | {mk_exp / total_exp:.2f} |")
        elif head.get(("mergekit task_arithmetic", "warm")):
            hk = head[("mergekit task_arithmetic", "warm")]
            lines.append(f"| mergekit task_arithmetic ×{n} (estimated: {n} × the head-to-head median) | {n} | "
                         f"{n * _med(metric(hk, 'wall_s')):.1f} | {n * _med(metric(hk, 'cpu_s')):.1f} | "
                         f"{n * hk[0]['expert_file_bytes'] / MiB:,.0f} (whole files) | "
                         f"{n * _med(metric(hk, 'rchar')) / MiB:,.0f} | "
                         f"{n * hk[0]['expert_file_bytes'] / total_exp:.2f} |")
        lines.append("")
    eq = results.get("equivalence")
    if eq:
        lines += ["## Output equivalence", "", "| pair | ‖A−B‖/‖B−W0‖ | max abs diff |", "|---|---|---|"]
        for pair, d in eq.items():
            lines.append(f"| {pair} | {d['relative_update']:.3g} | {d['max_abs']:.3g} |")
        lines.append("")
    if targets:
        lines += ["## Targets (issue 4)", "", "| target | measured | met |", "|---|---|---|"]
        for name, t in targets.items():
            lines.append(f"| {name} | {t['value']} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in sorted(out.glob("*.png"))
                                 if not p.name.startswith("sweep_")] + [""]
    results["targets"] = targets
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    plots(results, out)
    lines = [line for line in lines]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return targets


# Long: one figure after another, each skipped where its results are absent.
def plots(results: dict, out: Path) -> None:  # noqa: C901, PLR0915
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = results.get("runs", [])
    head = group(runs, "head")
    if head:
        names = sorted({k[0] for k in head if k[1] == "warm"}, key=lambda n: (n.split()[1], n))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
        for ax, key, scale, label in ((a1, "wall_s", 1, "wall s (median, min–max)"),
                                      (a2, "max_rss_bytes", 2**30, "peak RSS GiB")):
            meds, los, his = [], [], []
            for n in names:
                st = metric(head[(n, "warm")], key)
                meds.append(st[0] / scale)
                los.append((st[0] - st[1]) / scale)
                his.append((st[2] - st[0]) / scale)
            colors = ["tab:red" if n.startswith("mergekit") else "tab:blue" if n.startswith("mergepipe")
                      else "tab:gray" for n in names]
            ax.barh(names, meds, xerr=[los, his], color=colors)
            ax.set_xlabel(label)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(alpha=0.3, axis="x")
        a2.set_yticklabels([])
        fig.suptitle("full budget, warm page cache", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "head_to_head.png")
        plt.close(fig)
    bud = group(runs, "budgets")
    if bud:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
        for method, marker in (("task_arithmetic", "o-"), ("ties", "s-")):
            pts = []
            for b in results["suite"]["budgets"]:
                w = bud.get((f"mergepipe {method} {b}", "warm"))
                c = bud.get((f"mergepipe {method} {b}", "cold"))
                if w:
                    pts.append((_med(metric(w, "expert_bytes_read")) / 2**30, _med(metric(w, "wall_s")),
                                _med(metric(c, "wall_s")) if c else None, b))
            pts.sort()
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=f"{method} warm")
            if all(p[2] is not None for p in pts):
                a1.plot([p[0] for p in pts], [p[2] for p in pts], marker.replace("-", "--"), label=f"{method} cold")
            a2.plot([p[0] for p in pts], [float(p[3].rstrip("%")) for p in pts], marker, label=method)
        a1.set_xlabel("expert GiB read")
        a1.set_ylabel("wall s")
        a1.legend(fontsize=7)
        a1.grid(alpha=0.3)
        a2.set_xlabel("expert GiB read")
        a2.set_ylabel("budget %")
        a2.grid(alpha=0.3)
        fig.suptitle("mergepipe: wall and reads by budget", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "budgets.png")
        plt.close(fig)
    sc = group(runs, "scaling")
    if sc:
        ks = results["suite"]["scaling_ks"]
        budget = results["suite"]["scaling_budget"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
        series = [(f"mergepipe task_arithmetic {budget} K={{k}}", "mergepipe TA " + budget, "o-"),
                  (f"mergepipe ties {budget} K={{k}}", "mergepipe ties " + budget, "s-"),
                  ("mergekit task_arithmetic K={k}", "mergekit TA", "^-")]
        for pattern, label, marker in series:
            xs, walls, reads = [], [], []
            for k in ks:
                rs = sc.get((pattern.format(k=k), "warm"))
                if not rs and pattern.startswith("mergekit"):
                    rs = [r for r in head.get(("mergekit task_arithmetic", "warm"), []) if r["k"] == k]
                if rs:
                    xs.append(k)
                    walls.append(_med(metric(rs, "wall_s")))
                    eb = _med(metric(rs, "expert_bytes_read"))
                    reads.append((eb if eb is not None else rs[0]["expert_file_bytes"]) / 2**30)
            if xs:
                a1.plot(xs, reads, marker, label=label)
                a2.plot(xs, walls, marker, label=label)
        a1.set_xlabel("K experts")
        a1.set_ylabel("expert GiB read")
        a2.set_xlabel("K experts")
        a2.set_ylabel("wall s")
        for a in (a1, a2):
            a.set_xticks(ks)
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.suptitle(f"scaling in K at a fixed budget ({budget})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "scaling.png")
        plt.close(fig)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    res = json.loads((folder / "results.json").read_text())
    for name, t in write_report(res, folder).items():
        print(f"{'MET ' if t['met'] else 'MISS'} {name}: {t['value']}")
