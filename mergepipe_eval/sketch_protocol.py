"""EVAL.md tables for issue 12's SmolLM2 protocol run of `sketch` against `energy` (4 tasks,
2 fine-tuning seeds): per-seed screens (smollm_screen.py's JSON) and their mean over seeds
(smollm_seeds.py's JSON). Every number comes from those files; the findings sentences and the
targets' verdicts are generated too. Used by sketch_report.render."""
from __future__ import annotations

from mergepipe_eval.smollm_screen import _ci

BUDGET_ORDER = {"full": 0, "25%": 1, "10%": 2, "50%": 3}


def _pts(d: dict) -> str:
    return _ci(d, 100, 1)


def _seed_of(res: dict) -> str:
    return str(res.get("train_seed", "?"))


def _n_line(res: dict) -> str:
    n = res["n"]
    return (f"{sum(n['test'].values())} test examples ({', '.join(f'{t} {k}' for t, k in n['test'].items())}), "
            f"{sum(n['dev'].values())} dev examples, {n['heldout']['sequences']} held-out sequences of "
            f"{n['heldout']['tokens_per_sequence']} tokens")


def mean_table(mean: dict) -> list[str]:
    seeds = ", ".join(str(s) for s in mean["seeds"])
    lines = [f"Mean over fine-tuning seeds {seeds} ({_n_line(mean)}). Test accuracy: per-example correctness "
             f"averaged over the seeds, then a paired bootstrap over examples ({mean['resamples']} resamples, "
             "seed 0); held-out KL averaged per sequence over the seeds; dev label log-likelihood pooled over "
             "(seed, dev example), as each seed has its own dev split.", "",
             "| method | budget | strategy | test acc (mean) | per seed | Δ test acc vs full (points) "
             "| held-out KL (nats/token) | Δ dev label log-lik vs full (nats, pooled) |",
             "|---|---|---|---:|---|---|---:|---|"]
    for r in sorted(mean["rows"], key=lambda r: (r["method"], BUDGET_ORDER.get(r["budget"], 9))):
        acc = f"{100 * r['accuracy']:.1f}" if "accuracy" in r else "–"
        per = " / ".join(f"{100 * a:.1f}" for a in r["accuracy_per_seed"]) if "accuracy_per_seed" in r else "–"
        d = _pts(r["d_accuracy"]) if "d_accuracy" in r else "–"
        kl = f"{r['heldout_kl']['mean']:.3f}" if "heldout_kl" in r else "–"
        dll = _ci(r["d_dev_label_ll_pooled"], 1, 3) if "d_dev_label_ll_pooled" in r else "–"
        lines.append(f"| {r['method']} | {r['budget']} | {r['strategy']} | {acc} | {per} | {d} | {kl} | {dll} |")
    if mean["between"]:
        lines += ["", "Sketch against energy, test accuracy (mean over seeds, paired by example):", "",
                  "| method | budget | Δ test acc (points) |", "|---|---|---|"]
        for b in mean["between"]:
            lines.append(f"| {b['method']} | {b['budget']} | {_pts(b['d_accuracy'])} |")
    if mean["experts"]:
        lines += ["", "Each expert alone, test accuracy on the same examples: " + "; ".join(
            f"{k} {100 * v['mean']:.1f} (seed{'s' if len(v['per_seed']) > 1 else ''} "
            f"{', '.join(sorted(v['per_seed']))})" for k, v in sorted(mean["experts"].items())) + "."]
    return lines


def targets_table(mean: dict) -> list[str]:
    lines = ["| method | budget | strategy | target | measured | margin (points) | met | met by the whole interval |",
             "|---|---|---|---|---:|---:|---|---|"]
    for t in mean["targets"]:
        if t["kind"] == "within":
            target = f"Δ ≥ {t['target']:+.0f} points vs full"
            value = f"{t['value']:+.1f}"
        else:
            target = (f"≥ best single expert ({t['expert']}, {t['target']:.1f}; seed"
                      f"{'s' if len(t['expert_seeds']) > 1 else ''} {', '.join(t['expert_seeds'])})")
            value = f"{t['value']:.1f}"
        lines.append(f"| {t['method']} | {t['budget']} | {t['strategy']} | {target} | {value} | {t['margin']:+.1f} | "
                     f"{'met' if t['met'] else '**missed**'} | {'yes' if t['met_lo'] else 'no'} |")
    return lines


def seed_table(res: dict) -> list[str]:
    """One seed's screen: dev/held-out rows for every (method, strategy, budget), test where scored,
    with per-task test accuracy."""
    tasks = list(res["n"]["test"])
    test = {(r["method"], r["strategy"], r["budget"]): r for r in res["test"]["rows"]}
    lines = [f"Seed {_seed_of(res)}: {_n_line(res)}. Δ against the same method's full read, paired bootstrap 95% "
             "interval over examples.", "",
             f"| method | budget | strategy | dev acc | Δ dev label log-lik (nats) | held-out KL | test acc | "
             f"{' | '.join(tasks)} | Δ test acc (points) | McNemar (only this / only full, p) |",
             f"|---|---|---|---:|---|---:|---:|{'---:|' * len(tasks)}---|---|"]
    for r in sorted(res["rows"], key=lambda r: (r["method"], BUDGET_ORDER.get(r["budget"], 9), r["strategy"])):
        t = test.get((r["method"], r["strategy"], r["budget"]))
        dll = _ci(r["d_dev_label_ll"], 1, 3) if "d_dev_label_ll" in r else "–"
        kl = f"{r['heldout_kl']['mean']:.3f}" if "heldout_kl" in r else "–"
        if t and "accuracy" in t:
            acc = f"{100 * t['accuracy']:.1f}"
            cells = " | ".join(f"{100 * t['per_task'][k]:.1f}" for k in tasks)
        else:
            acc, cells = "–", " | ".join("–" for _ in tasks)
        d = _pts(t["d_accuracy"]) if t and "d_accuracy" in t else "–"
        mc = t.get("mcnemar_vs_full") if t else None
        mcs = f"{mc['a_only']} / {mc['b_only']}, p={mc['p']:.2g}" if mc else "–"
        lines.append(f"| {r['method']} | {r['budget']} | {r['strategy']} | {100 * r['dev_accuracy']:.1f} | {dll} | "
                     f"{kl} | {acc} | {cells} | {d} | {mcs} |")
    between = [r for r in res["test"]["rows"] if r["strategy"].endswith(" - energy")]
    if between:
        lines += ["", "| method | budget | sketch − energy, Δ test acc (points) "
                  "| McNemar (only sketch / only energy, p) |",
                  "|---|---|---|---|"]
        for r in between:
            mc = r["mcnemar"]
            lines.append(f"| {r['method']} | {r['budget']} | {_pts(r['d_accuracy'])} | "
                         f"{mc['a_only']} / {mc['b_only']}, p={mc['p']:.2g} |")
    experts = res["test"].get("experts") or {}
    if experts:
        lines += ["", "| expert alone | test acc | " + " | ".join(tasks) + " |",
                  "|---|---:|" + "---:|" * len(tasks)]
        for name, e in sorted(experts.items()):
            lines.append(f"| {name} | {100 * e['accuracy']:.1f} | "
                         + " | ".join(f"{100 * e['per_task'][k]:.1f}" for k in tasks) + " |")
    return lines


def findings(mean: dict, per_seed: list[dict]) -> list[str]:
    """Generated bullets: each method's sketch and energy against the full read per budget
    (mean over seeds and per seed), the targets, and which strategy the numbers favour."""
    out = []
    seeds = {_seed_of(r): r for r in per_seed}
    for m in sorted({r["method"] for r in mean["rows"]}):
        parts = []
        for r in sorted((r for r in mean["rows"] if r["method"] == m and "d_accuracy" in r),
                        key=lambda r: (BUDGET_ORDER.get(r["budget"], 9), r["strategy"])):
            per = []
            for seed, res in seeds.items():
                t = next((x for x in res["test"]["rows"] if (x["method"], x["strategy"], x["budget"])
                          == (m, r["strategy"], r["budget"]) and "d_accuracy" in x), None)
                if t:
                    per.append(f"seed {seed} {100 * t['d_accuracy']['mean']:+.1f}")
            parts.append(f"`{r['strategy']}` at {r['budget']} {_pts(r['d_accuracy'])}"
                         + (f" ({', '.join(per)})" if per else ""))
        full = next((r for r in mean["rows"] if r["method"] == m and r["budget"] == "full"), None)
        if full and "accuracy" in full:
            out.append(f"- **{m}**, test accuracy against its full read ({100 * full['accuracy']:.1f}, mean over "
                       f"seeds), points, mean over seeds [paired 95% interval]: " + "; ".join(parts) + ".")
    for b in mean["between"]:
        d = b["d_accuracy"]
        side = "interval above 0" if d["lo"] > 0 else "interval below 0" if d["hi"] < 0 else "interval includes 0"
        out.append(f"- sketch − energy, {b['method']} at {b['budget']}: {_pts(d)} points ({side}).")
    kls = {}
    for r in mean["rows"]:
        if "heldout_kl" in r:
            kls.setdefault((r["method"], r["budget"]), {})[r["strategy"]] = r["heldout_kl"]["mean"]
    ratios = [v["energy"] / v["sketch"] for v in kls.values() if "energy" in v and "sketch" in v and v["sketch"] > 0]
    if ratios:
        out.append(f"- Held-out KL(full ‖ budgeted), mean over seeds: `energy`'s is {min(ratios):.1f}x to "
                   f"{max(ratios):.1f}x `sketch`'s over every method and budget screened ({len(ratios)} pairs).")
    by_strategy: dict[str, list[dict]] = {}
    for t in mean["targets"]:
        by_strategy.setdefault(t["strategy"], []).append(t)
    for s, ts in sorted(by_strategy.items()):
        met = [t for t in ts if t["met"]]
        missed = [f"{t['method']} {t['budget']} by {-t['margin']:.1f} points" for t in ts if not t["met"]]
        out.append(f"- Targets, `{s}` (mean over seeds): {len(met)} of {len(ts)} met"
                   + (f"; missed: {', '.join(missed)}" if missed else "")
                   + f"; {sum(t['met_lo'] for t in ts)} of {len(ts)} met by the whole interval.")
    return out


def timings(mean: dict) -> list[str]:
    """Training, merge and scoring times, from the experts' train.json and the screens' logs."""
    lines = []
    for seed, experts in sorted(mean.get("training", {}).items()):
        lines.append(f"- seed {seed}, training (30 steps each): " + ", ".join(
            f"{k} {v['train_seconds']:.0f} s (loss {v['first_loss']:.2f} → {v['final_loss']:.2f})"
            for k, v in sorted(experts.items())) + ".")
    for seed, experts in sorted(mean.get("training_rebuilt", {}).items()):
        lines.append(f"- seed {seed}, training again (rebuilt work folder, same commands and seeds): " + ", ".join(
            f"{k} {v['train_seconds']:.0f} s (loss {v['first_loss']:.2f} → {v['final_loss']:.2f})"
            for k, v in sorted(experts.items())) + ".")
    logs = []
    for seed, log in sorted(mean.get("timings", {}).items()):
        parts = mean.get("invocations", {}).get(seed)
        if parts:  # one line per result file (invocation) of this seed
            logs += [(seed, p["timings"], ", ".join(p["methods"])) for p in parts]
        else:
            logs.append((seed, log, None))
    for seed, log, methods in logs:
        merges = {}
        for x in log:
            if "merge" in x:
                strat = "full" if x["merge"].endswith("_full") else x["merge"].split("_")[-2]
                merges.setdefault(strat, []).append(x["seconds"])
        scores = {}
        for x in log:
            if "score" in x:
                scores.setdefault("+".join(x["what"]), []).append(x["seconds"])
        if not merges and not scores:
            continue
        parts = [f"{k} merges {min(v):.0f}-{max(v):.0f} s (n={len(v)})" for k, v in sorted(merges.items())]
        parts += [f"scoring {k} {min(v):.0f}-{max(v):.0f} s (n={len(v)})" for k, v in sorted(scores.items())]
        total = sum(x["seconds"] for x in log)
        what = f"screen of {methods}" if methods else "screen"
        lines.append(f"- seed {seed}, {what}, the result file's last invocation (merge times include waiting for the "
                     "heavy-job lock, scoring times do not; a merge or score already cached counts ~0): "
                     + ", ".join(parts) + f"; {total / 60:.0f} min in all.")
    return lines


def plot_axes(mean: dict) -> list[tuple[str, list[dict], str]]:
    """(title, rows, key) series for sketch_report.plot: per method, the mean over seeds."""
    out = []
    for m in sorted({r["method"] for r in mean["rows"]}):
        rows = [r for r in mean["rows"] if r["method"] == m and "d_accuracy" in r]
        out.append((f"SmolLM2 {m}, {len(mean['n']['test'])} tasks (mean of {len(mean['seeds'])} "
                    f"seed{'s' if len(mean['seeds']) > 1 else ''})", rows, "d_accuracy"))
    return out


def section(per_seed: list[dict], mean: dict | None) -> list[str]:
    tasks = list(per_seed[0]["n"]["test"])
    out = [f"## SmolLM2-135M, issue 12 protocol: {len(tasks)} tasks, {len(per_seed)} fine-tuning "
           f"seed{'s' if len(per_seed) > 1 else ''}", ""]
    if mean is not None:
        out += ["### Findings (generated from the results JSON)", "", *findings(mean, per_seed), "",
                "### Targets (issue 12, SmolLM2, mean over seeds, against the same method's full read)", "",
                *targets_table(mean), "", "### Mean over seeds", "", *mean_table(mean), ""]
        tl = timings(mean)
        if tl:
            out += ["### Timings", "", *tl, ""]
    for res in per_seed:
        out += [f"### Seed {_seed_of(res)}", "", *seed_table(res), ""]
    return out
