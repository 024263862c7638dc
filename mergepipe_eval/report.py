"""EVAL.md tables, the accuracy-vs-bytes plot and a compact JSON summary from score files.

Reads `<results_dir>/<recipe>/s<seed>/scores/**.json` (written by `score`) and
`<results_dir>/probes/*.json`; never touches models.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

MiB = 1024 * 1024
BUDGET_ORDER = {"b05": 0, "b10": 1, "b25": 2, "b50": 3, "full": 4}
TARGETS = {"b25": 1.0, "b50": 0.3}  # largest allowed loss of mean accuracy vs full, points


def _load(results_dir: Path, seeds: list[int] | None = None,
          ) -> tuple[list[dict], dict[str, dict]]:
    rows = []
    for path in sorted(results_dir.glob("*/s*/scores/**/*.json")):
        row = json.loads(path.read_text())
        if seeds is None or row["seed"] in seeds:
            rows.append(row)
    probes = {p.stem: json.loads(p.read_text()) for p in sorted((results_dir / "probes").glob("*.json"))}
    return rows, probes


def _se_mean(row: dict) -> float:
    """Binomial standard error of the mean accuracy over tasks (independent test sets)."""
    acc, n = row["accuracy"], row["n_test"]
    return math.sqrt(sum(acc[t] * (1 - acc[t]) / n[t] for t in acc)) / len(acc)


def _avg(rows: list[dict]) -> dict:
    """Average rows over seeds: accuracies, mean, bytes; SE across seeds if several, else binomial."""
    first = rows[0]
    tasks = list(first["accuracy"])
    out = dict(first)
    out["accuracy"] = {t: sum(r["accuracy"][t] for r in rows) / len(rows) for t in tasks}
    means = [r["mean_accuracy"] for r in rows]
    out["mean_accuracy"] = sum(means) / len(means)
    if len(rows) > 1:
        var = sum((m - out["mean_accuracy"]) ** 2 for m in means) / (len(rows) - 1)
        out["se"] = math.sqrt(var / len(rows))
        out["se_kind"] = f"across {len(rows)} seeds"
    else:
        out["se"] = _se_mean(first)
        out["se_kind"] = "binomial"
    for key in ("expert_bytes_read", "realized_relative_deviation"):
        if key in first:
            out[key] = sum(r[key] for r in rows) / len(rows)
    if "bound" in first:
        out["bound_relative"] = sum(r["bound"]["relative"] for r in rows) / len(rows)
        out["bound_kind"] = first["bound"]["kind"]
    out["n_seeds"] = len(rows)
    return out


def _group(tensor: str) -> str:
    """Coarse part of a BERT encoder or a Llama decoder (5 layers per group) a tensor belongs to."""
    if tensor.startswith("model.embed_tokens"):
        return "embeddings (tied with lm_head)"
    if tensor.startswith("model.layers."):
        first = int(tensor.split(".")[2]) // 5 * 5
        part = ("attention" if ".self_attn." in tensor else "MLP" if ".mlp." in tensor
                else "norms")
        return f"layers {first}-{first + 4} {part}"
    if tensor.startswith("model.norm"):
        return "final norm"
    if tensor.startswith("embeddings.word_embeddings"):
        return "word embeddings"
    if tensor.startswith("embeddings."):
        return "other embeddings + LN"
    if tensor.startswith("encoder.layer."):
        layer = tensor.split(".")[2]
        part = "attention" if ".attention." in tensor else "FFN"
        return f"layer {layer} {part}"
    return tensor.split(".")[0]


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_shares(manifest: Path, base_model: Path) -> dict[str, float]:
    """Share of each tensor group's expert bytes that a merge read, from its manifest's plan."""
    from mergepipe.checkpoint.blocks import block_ranges
    plan = json.loads(manifest.read_text())["plan"]
    header = _header(base_model)
    n_experts = len(plan["experts"])
    total: dict[str, int] = defaultdict(int)
    read: dict[str, int] = defaultdict(int)
    block_sizes = {}
    for name, info in header.items():
        if info["dtype"] == "I64":
            continue
        begin, end = info["data_offsets"]
        rows = info["shape"][0] if info["shape"] else 1
        row_bytes = (end - begin) // max(1, rows)
        ranges = block_ranges(info["shape"], row_bytes // max(1, math.prod(info["shape"][1:])),
                              plan["block_bytes"])
        block_sizes[name] = [(r1 - r0) * row_bytes for r0, r1 in ranges]
        total[_group(name)] += n_experts * (end - begin)
    for tensors in plan["reads"].values():
        for name, blocks in tensors.items():
            read[_group(name)] += sum(block_sizes[name][b] for b in blocks)
    return {g: read[g] / total[g] for g in total}


def _delta(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def summarize(results_dir: Path, *, seeds: list[int] | None = None) -> dict:
    rows, probes = _load(results_dir, seeds)
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        key = (r["recipe"], r["kind"], r.get("expert") or r.get("merge") or "", r.get("budget_tag", ""))
        by_key[key].append(r)
    fams: dict[str, dict] = defaultdict(lambda: {"experts": {}, "merges": defaultdict(dict)})
    for (recipe, kind, name, budget), group in by_key.items():
        avg = _avg(group)
        if kind == "base":
            fams[recipe]["base"] = avg
        elif kind == "expert":
            fams[recipe]["experts"][name] = avg
        else:
            fams[recipe]["merges"][name][budget] = avg
    summary = {"probes": {t: p["probe_test_acc"] for t, p in probes.items()}, "families": {}}
    for recipe, fam in fams.items():
        tasks = list(fam["base"]["accuracy"])
        best = max(fam["experts"].items(), key=lambda kv: kv[1]["mean_accuracy"],
                   default=("(not scored)", {"accuracy": {}, "mean_accuracy": float("nan")}))
        own = {t: fam["experts"][t]["accuracy"][t] for t in tasks if t in fam["experts"]}
        merges = {}
        for name, budgets in fam["merges"].items():
            any_row = next(iter(budgets.values()))
            full = fam["merges"].get(any_row.get("reference", name), {}).get("full")
            merges[name] = {}
            for tag in sorted(budgets, key=BUDGET_ORDER.get):
                m = budgets[tag]
                merges[name][tag] = {
                    "method": m["method"], "parameters": m["parameters"],
                    "block_bytes": m["block_bytes"], "budget": m["budget"],
                    "accuracy": m["accuracy"], "mean_accuracy": m["mean_accuracy"],
                    "se": m["se"], "se_kind": m["se_kind"],
                    "expert_bytes_read": m.get("expert_bytes_read"),
                    "total_expert_bytes": m.get("total_expert_bytes"),
                    "bound_relative": m.get("bound_relative"), "bound_kind": m.get("bound_kind"),
                    "realized_relative_deviation": m.get("realized_relative_deviation"),
                    "delta_vs_full_points": (100 * (m["mean_accuracy"] - full["mean_accuracy"])
                                             if full else None),
                    "n_seeds": m["n_seeds"], "reference": m.get("reference", name)}
        summary["families"][recipe] = {
            "tasks": tasks, "base": fam["base"]["accuracy"],
            "base_mean": fam["base"]["mean_accuracy"],
            "own_expert": own, "own_expert_mean": sum(own.values()) / max(1, len(own)),
            "best_single_expert": {"expert": best[0], "accuracy": best[1]["accuracy"],
                                   "mean_accuracy": best[1]["mean_accuracy"]},
            "experts": {k: v["accuracy"] for k, v in fam["experts"].items()},
            "n_test": fam["base"]["n_test"], "merges": merges}
    for recipe, fam in summary["families"].items():
        base_model = results_dir / "base" / "model.safetensors"
        for name in ("ta_l0.5", "ties"):
            for tag in fam["merges"].get(name, {}):
                manifest = results_dir / recipe / "s0" / "merges" / name / tag / "manifest.json"
                if manifest.exists() and base_model.exists():
                    fam["merges"][name][tag]["read_shares"] = read_shares(manifest, base_model)
    return summary


def _skip_table(fam: dict, name: str) -> list[str]:
    budgets = fam["merges"].get(name, {})
    tags = [t for t in sorted(budgets, key=BUDGET_ORDER.get) if "read_shares" in budgets[t]]
    if not tags:
        return []
    groups = list(budgets[tags[0]]["read_shares"])
    out = [f"Share of each part's expert bytes read by `{name}` (seed 0), %:", "",
           "| part | " + " | ".join(budgets[t]["budget"] for t in tags) + " |",
           "|---|" + "---|" * len(tags)]
    for g in groups:
        out.append(f"| {g} | " + " | ".join(f"{100 * budgets[t]['read_shares'][g]:.0f}"
                                             for t in tags) + " |")
    return out + [""]


def _targets(fam: dict) -> list[str]:
    lines = []
    for name, budgets in fam["merges"].items():
        for tag, limit in TARGETS.items():
            if tag in budgets and budgets[tag]["delta_vs_full_points"] is not None:
                d = budgets[tag]["delta_vs_full_points"]
                ok = "met" if d >= -limit else "**missed**"
                lines.append(f"| {name} | {budgets[tag]['budget']} | {d:+.2f} | within -{limit} | {ok} |")
    return lines


def _plot(summary: dict, path: Path, *, model: str = "MiniLM",
          base_label: str = "base (expert heads)") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fams = summary["families"]
    fig, axes = plt.subplots(1, len(fams), figsize=(6.5 * len(fams), 4.8), squeeze=False)
    for ax, (recipe, fam) in zip(axes[0], sorted(fams.items())):
        for name, budgets in sorted(fam["merges"].items()):
            tags = sorted(budgets, key=BUDGET_ORDER.get)
            xs = [budgets[t]["expert_bytes_read"] / MiB for t in tags]
            ys = [100 * budgets[t]["mean_accuracy"] for t in tags]
            es = [100 * budgets[t]["se"] for t in tags]
            style = "--" if "tensor" in name else "-"
            ax.errorbar(xs, ys, yerr=es, marker="o", ls=style, capsize=2, label=name)
        ax.axhline(100 * fam["base_mean"], color="gray", ls=":", label=base_label)
        if fam["experts"]:
            ax.axhline(100 * fam["best_single_expert"]["mean_accuracy"], color="black", ls="-.",
                       label=f"best single expert ({fam['best_single_expert']['expert']})")
            ax.axhline(100 * fam["own_expert_mean"], color="green", ls=":",
                       label="each expert on its own task")
        ax.set_title(f"{model}, recipe '{recipe}': mean accuracy over {len(fam['tasks'])} tasks")
        ax.set_xlabel("expert bytes read (MiB)")
        ax.set_ylabel("mean accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _merge_table(fam: dict) -> list[str]:
    tasks = fam["tasks"]
    out = ["Merges (accuracy %; ± is the standard error of the mean; Δ full is the "
           "change of mean accuracy against the same method's full read, in points; "
           "bound: certified relative bound for task arithmetic, heuristic omitted mass "
           "for TIES/DARE; deviation: realized ‖θ_B − θ_full‖ / ‖θ_full − θ_0‖):", "",
           "| merge | budget | expert MiB read | " + " | ".join(tasks)
           + " | mean ± se | Δ full | bound (rel) | deviation (rel) |",
           "|---|---|---|" + "---|" * len(tasks) + "---|---|---|---|"]
    for name, budgets in sorted(fam["merges"].items()):
        for tag in sorted(budgets, key=BUDGET_ORDER.get):
            m = budgets[tag]
            read = m["expert_bytes_read"] / MiB
            share = m["expert_bytes_read"] / m["total_expert_bytes"]
            bound = m["bound_relative"]
            kind = "" if m["bound_kind"] == "certified" else " (h)"
            out.append(
                f"| {name} | {m['budget']} | {read:.1f} ({100 * share:.0f}%) | "
                + " | ".join(_pct(m["accuracy"][t]) for t in tasks)
                + f" | {_pct(m['mean_accuracy'])} ± {_pct(m['se'])} | "
                f"{_delta(m['delta_vs_full_points'])} | "
                f"{'–' if bound is None else f'{bound:.3f}{kind}'} | "
                f"{m['realized_relative_deviation']:.3f} |")
    return out


def render(summary: dict, *, notes: str = "", plot_name: str = "") -> str:
    out = ["# EVAL: real experts, real tasks (issue 6)", "",
           "Generated by `python -m mergepipe_eval report` from the score files of "
           "`workflows/real/Snakefile`; numbers below are not edited by hand.", ""]
    if notes:
        out += [notes.strip(), ""]
    probes = summary["probes"]
    for recipe, fam in sorted(summary["families"].items()):
        tasks = fam["tasks"]
        out += [f"## Family `{recipe}`", "",
                "References (accuracy %, test examples per task: "
                + ", ".join(f"{t} {fam['n_test'][t]}" for t in tasks) + "):", "",
                "| reference | " + " | ".join(tasks) + " | mean |",
                "|---|" + "---|" * (len(tasks) + 1)]

        out += _reference_rows(fam, [("base encoder + expert heads", fam["base"]), ("base linear probe", probes)])
        out += ["", *_merge_table(fam)]
        out += ["", "Targets (mean accuracy against the full read, points):", "",
                "| merge | budget | Δ full | target | |", "|---|---|---|---|---|", *_targets(fam)]
        full = {n: b["full"]["mean_accuracy"] for n, b in fam["merges"].items() if "full" in b}
        if "ties" in full:
            ta = {n: v for n, v in full.items() if n.startswith("ta_") and "tensor" not in n}
            best_ta = max(ta.items(), key=lambda kv: kv[1]) if ta else None
            if best_ta:
                diff = 100 * (full["ties"] - best_ta[1])
                out += ["", f"TIES at full budget: {_pct(full['ties'])} vs best task arithmetic "
                        f"({best_ta[0]}) {_pct(best_ta[1])}: {diff:+.2f} points "
                        f"({'ties above' if diff > 0 else 'ties not above'})."]
        out.append("")
        out += _skip_table(fam, "ta_l0.5")
    if plot_name:
        out += [f"![mean accuracy against expert bytes read]({plot_name})", ""]
    return "\n".join(out)


def _reference_rows(fam: dict, leading: list[tuple[str, dict]]) -> list[str]:
    """References table rows: `leading` (label, accuracy) first, then each expert on its own
    task, the best single expert and every expert on all tasks."""
    tasks = fam["tasks"]
    rows = [_ref_row(label, acc, tasks) for label, acc in leading]
    rows.append(_ref_row("each expert on its own task", fam["own_expert"], tasks))
    if fam["experts"]:
        b = fam["best_single_expert"]
        rows.append(_ref_row(f"best single expert ({b['expert']}) on all tasks", b["accuracy"], tasks))
    rows += [_ref_row(f"expert {name} on all tasks", acc, tasks) for name, acc in sorted(fam["experts"].items())]
    return rows


def _ref_row(label: str, acc: dict, tasks: list[str]) -> str:
    """One references-table row: accuracy per task (– where missing) and their mean."""
    vals = [acc.get(t) for t in tasks]
    mean = sum(v for v in vals if v is not None) / max(1, sum(v is not None for v in vals))
    return f"| {label} | " + " | ".join("–" if v is None else _pct(v) for v in vals) + f" | {_pct(mean)} |"


def render_smollm(summary: dict, *, notes: str = "", plot_name: str = "") -> str:
    """The SmolLM2 section: references without heads or probes (the LM answers by itself)."""
    out = ["# SmolLM2-135M-Instruct: generative classification", ""]
    if notes:
        out += [notes.strip(), ""]
    for recipe, fam in sorted(summary["families"].items()):
        tasks = fam["tasks"]
        out += [f"## SmolLM2 family `{recipe}`", "",
                "References (accuracy %, test examples per task: "
                + ", ".join(f"{t} {fam['n_test'][t]}" for t in tasks) + "; chance: "
                "noun_cat 16.7, pos 25, topic 25):", "",
                "| reference | " + " | ".join(tasks) + " | mean |",
                "|---|" + "---|" * (len(tasks) + 1)]

        out += _reference_rows(fam, [("base (zero-shot)", fam["base"])])
        out += ["", *_merge_table(fam)]
        out += ["", "Against the full read, with the MiniLM targets for reference "
                "(mean accuracy, points):", "",
                "| merge | budget | Δ full | target | |", "|---|---|---|---|---|", *_targets(fam)]
        full = {n: b["full"]["mean_accuracy"] for n, b in fam["merges"].items() if "full" in b}
        if "ties" in full:
            ta = {n: v for n, v in full.items() if n.startswith("ta_")}
            if ta:
                best_ta = max(ta.items(), key=lambda kv: kv[1])
                diff = 100 * (full["ties"] - best_ta[1])
                out += ["", f"TIES at full budget: {_pct(full['ties'])} vs best task arithmetic "
                        f"({best_ta[0]}) {_pct(best_ta[1])}: {diff:+.2f} points."]
        out.append("")
        out += _skip_table(fam, "ta_l0.5")
    if plot_name:
        out += [f"![SmolLM2: mean accuracy against expert bytes read]({plot_name})", ""]
    return "\n".join(out)


def seed_check(results_dir: Path, *, recipe: str, seeds: list[int]) -> list[str]:
    """Per-seed Δ full (points) for every merge/budget scored under more than the main seeds."""
    rows, _ = _load(results_dir)
    by: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["recipe"] == recipe and r["kind"] == "merge":
            by[(r["merge"], r["budget_tag"])][r["seed"]] = r["mean_accuracy"]
    extra = sorted({sd for v in by.values() for sd in v} - set(seeds))
    if not extra:
        return []
    all_seeds = sorted(set(seeds) | set(extra))
    out = [f"### Second fine-tuning seed, family `{recipe}`", "",
           "Δ full (points) of each seed's merge against the same seed's full read; the main "
           "tables above use seed " + ", ".join(map(str, seeds)) + " only.", "",
           "| merge | budget | " + " | ".join(f"seed {sd}: mean, Δ full" for sd in all_seeds)
           + " | mean Δ full over seeds |", "|---|---|" + "---|" * (len(all_seeds) + 1)]
    for (name, tag), per_seed in sorted(by.items(), key=lambda kv: (kv[0][0], BUDGET_ORDER[kv[0][1]])):
        if tag == "full" or not set(extra) & set(per_seed):
            continue
        cells, deltas = [], []
        for sd in all_seeds:
            full = by.get((name, "full"), {}).get(sd)
            if sd in per_seed and full is not None:
                d = 100 * (per_seed[sd] - full)
                deltas.append(d)
                cells.append(f"{_pct(per_seed[sd])}, {d:+.2f}")
            else:
                cells.append("–")
        mean = f"{sum(deltas) / len(deltas):+.2f}" if len(deltas) == len(all_seeds) else "–"
        label = {"b05": "5%", "b10": "10%", "b25": "25%", "b50": "50%"}.get(tag, tag)
        out.append(f"| {name} | {label} | " + " | ".join(cells) + f" | {mean} |")
    return out + [""]


def write_report(results_dir: Path, markdown: Path, plot: Path, summary_path: Path, *,
                 notes: Path | None = None, seeds: list[int] | None = None,
                 seed_check_recipe: str | None = None,
                 smollm: tuple[Path, Path, Path, Path | None] | None = None) -> None:
    """EVAL.md from the MiniLM results (and, when given, the SmolLM2 section after it).

    smollm: (results_dir, plot, summary_path, notes) of the SmolLM2 family.
    """
    import os
    summary = summarize(results_dir, seeds=seeds)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    _plot(summary, plot)
    rel_plot = os.path.relpath(plot, markdown.parent)
    text = render(summary, notes=notes.read_text() if notes else "")
    if seed_check_recipe and seeds is not None:
        check = seed_check(results_dir, recipe=seed_check_recipe, seeds=seeds)
        if check:
            text = text.rstrip("\n") + "\n\n" + "\n".join(check)
    text = text.rstrip("\n") + f"\n\n![mean accuracy against expert bytes read]({rel_plot})\n"
    if smollm is not None:
        sm_dir, sm_plot, sm_summary_path, sm_notes = smollm
        sm_summary = summarize(sm_dir)
        sm_summary_path.write_text(json.dumps(sm_summary, indent=1, sort_keys=True) + "\n")
        _plot(sm_summary, sm_plot, model="SmolLM2-135M-Instruct", base_label="base (zero-shot)")
        text = text.rstrip("\n") + "\n\n" + render_smollm(
            sm_summary, notes=sm_notes.read_text() if sm_notes else "",
            plot_name=os.path.relpath(sm_plot, markdown.parent))
    markdown.write_text(text)


def splice_between(markdown: Path, section: str, begin: str, end: str) -> None:
    """Replace the part of `markdown` from `begin` through `end` with `section` (which carries
    both markers), or append it when either marker is absent."""
    text = markdown.read_text() if markdown.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    markdown.write_text(text)
