"""SmolLM2 plan-strategy screens averaged over fine-tuning seeds (issue 12: "mean over seeds").

Each seed's screen (smollm_screen.run_screen, one family folder per seed) scored the same
test examples (the task splits do not depend on the fine-tuning seed), so for test accuracy
the per-example results are averaged over seeds first and a paired bootstrap resamples
examples (each carrying all its seeds): the interval covers example sampling for these
seeds' experts, as strategies.across_seeds does for MiniLM. Held-out KL is averaged per
held-out sequence (the same sequences for every seed). The dev split differs per seed (the
train examples that seed's experts never saw), so the dev label log-likelihood difference is
pooled over (seed, example) pairs. Everything is read from the score caches the screens
wrote (family/strategies/scores/*.json); no model is loaded.

Targets (issue 12, SmolLM2, mean over seeds, against the same method's full read): 25% within
2 points, 50% within 1 point, 10% at or above the best single expert.

    python -m mergepipe_eval smollm-strategy-seeds --result S0.json --result S1.json --out SEEDS.json
"""
from __future__ import annotations

import json
from pathlib import Path

from mergepipe_eval.smollm_screen import _model_name, per_example
from mergepipe_eval.strategies import paired

# budget -> (kind, value): "within" = budgeted − full ≥ −value points; "expert" = accuracy ≥ the
# best single expert's (mean over the seeds that scored experts)
TARGETS = {"25%": ("within", 2.0), "50%": ("within", 1.0), "10%": ("expert", 0.0)}


def _scores(family: Path, name: str) -> dict | None:
    path = family / "strategies" / "scores" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _avg(vectors: list[list[float]]) -> list[float]:
    if len({len(v) for v in vectors}) != 1:
        raise ValueError("seeds scored different example sets")
    return [sum(v) / len(v) for v in zip(*vectors)]


def _mean(x: list[float]) -> float:
    return sum(x) / len(x)


def across_seeds(results: list[dict], *, methods: list[str], strategies: list[str], budgets: list[str],
                 n_boot: int = 2000, load=_scores) -> dict:
    """Mean over the seeds' screens (`results`, one per seed, in seed order); `load(family,
    name)` returns a model's cached scores or None (tests pass a fake)."""
    fams = [Path(r["family"]) for r in results]
    seeds = [r.get("train_seed", i) for i, r in enumerate(results)]
    rows, between = [], []
    for m in methods:
        fulls = [load(f, f"{m}_full") for f in fams]
        if any(f is None for f in fulls):
            continue
        full_row = {"method": m, "strategy": "-", "budget": "full", "seeds": len(fams)}
        full_acc = None
        if all("test" in f for f in fulls):  # else the screen (dev, KL) only
            full_test = [per_example(f, "test") for f in fulls]
            full_acc = _avg([e["acc"] for e in full_test])
            full_row.update(n=len(full_acc), accuracy=_mean(full_acc),
                            accuracy_per_seed=[_mean(e["acc"]) for e in full_test])
        rows.append(full_row)
        for budget in budgets:
            acc = {}
            for s in strategies:
                scs = [load(f, _model_name(m, s, budget)) for f in fams]
                if any(sc is None for sc in scs):
                    continue
                row = {"method": m, "strategy": s, "budget": budget, "seeds": len(fams)}
                dev = [per_example(sc, "dev", full) for sc, full in zip(scs, fulls)]
                full_dev = [per_example(full, "dev") for full in fulls]
                d_ll = [a - b for d, f in zip(dev, full_dev) for a, b in zip(d["ll"], f["ll"])]
                row["d_dev_label_ll_pooled"] = paired(d_ll, n_boot=n_boot)
                if all("kl" in sc for sc in scs):
                    row["heldout_kl"] = paired(_avg([sc["kl"]["per_sequence"] for sc in scs]), n_boot=n_boot)
                if full_acc is not None and all("test" in sc for sc in scs):
                    ex = [per_example(sc, "test") for sc in scs]
                    acc[s] = _avg([e["acc"] for e in ex])
                    row.update(n=len(acc[s]), accuracy=_mean(acc[s]),
                               accuracy_per_seed=[_mean(e["acc"]) for e in ex],
                               d_accuracy=paired(acc[s], full_acc, n_boot=n_boot))
                rows.append(row)
            for s in strategies:
                if s != "energy" and s in acc and "energy" in acc:
                    between.append({"method": m, "budget": budget, "a": s, "b": "energy", "seeds": len(fams),
                                    "d_accuracy": paired(acc[s], acc["energy"], n_boot=n_boot)})
    experts = _experts(results)
    out = {"families": [f.as_posix() for f in fams], "seeds": seeds, "n": results[0]["n"],
           "tasks": results[0].get("tasks"), "resamples": n_boot, "rows": rows, "between": between,
           "experts": experts, "training": training(fams, seeds),
           "timings": {str(seed): r.get("timings", []) for seed, r in zip(seeds, results)}}
    parts = {str(seed): r["invocations"] for seed, r in zip(seeds, results) if "invocations" in r}
    if parts:  # a seed's screen from several invocations (result files): each one's timings
        out["invocations"] = parts
    out["targets"] = targets(out)
    return out


def keep_from(res: dict, previous: dict, methods: list[str]) -> dict:
    """`res` plus the rows and sketch − energy comparisons of `methods` that `res` lacks (their
    score caches are gone, e.g. a rebuilt work folder) from `previous`, an earlier
    across_seeds result of the same families, examples and bootstrap; targets recomputed over
    all rows (the 10% one against the experts of `res`). Kept methods are listed in `kept`;
    `previous`'s training log is kept (its experts made the kept rows), this one's moves to
    `training_rebuilt`."""
    same = (lambda r: ([Path(f).resolve().as_posix() for f in r["families"]], r["seeds"], r["n"], r["resamples"]))
    if same(res) != same(previous):
        raise ValueError("--keep: another set of families, seeds, examples or bootstrap")
    have = {r["method"] for r in res["rows"]}
    kept = [m for m in methods if m not in have and any(r["method"] == m for r in previous["rows"])]
    out = dict(res)
    out["rows"] = [r for r in previous["rows"] if r["method"] in kept] + res["rows"]
    out["between"] = [b for b in previous["between"] if b["method"] in kept] + res["between"]
    out["kept"] = {"methods": kept, "from": "an earlier mean over seeds (score caches no longer present)"}
    if previous.get("training"):
        out["training_rebuilt"], out["training"] = res["training"], previous["training"]
    out["targets"] = targets(out)
    return out


def training(families: list[Path], seeds: list[int]) -> dict:
    """Each expert's train.json (smollm.train_expert): seconds and first/final loss, per seed."""
    out = {}
    for fam, seed in zip(families, seeds):
        for path in sorted((fam / "experts").glob("*/train.json")):
            info = json.loads(path.read_text())
            out.setdefault(str(seed), {})[path.parent.name] = {
                k: info.get(k) for k in ("train_seconds", "first_loss", "final_loss", "steps", "examples_seen")}
    return out


def _experts(results: list[dict]) -> dict:
    """Each expert's test accuracy per seed (where that seed's screen scored them) and the mean."""
    per: dict[str, dict] = {}
    for r in results:
        for name, e in r["test"].get("experts", {}).items():
            per.setdefault(name, {})[str(r.get("train_seed", 0))] = e["accuracy"]
    return {name: {"per_seed": v, "mean": _mean(list(v.values()))} for name, v in per.items()}


def targets(res: dict) -> list[dict]:
    """Issue 12's SmolLM2 targets for every (method, strategy) with a test row at the budget.
    `margin` (points) > 0: met by that much; < 0: missed by that much. `met_lo`: also met by the
    interval's lower end (for `expert`, the full read's accuracy plus the lower end)."""
    full = {r["method"]: r["accuracy"] for r in res["rows"] if r["budget"] == "full" and "accuracy" in r}
    best = max(res["experts"].items(), key=lambda kv: kv[1]["mean"]) if res["experts"] else None
    out = []
    for r in res["rows"]:
        if r["budget"] not in TARGETS or "d_accuracy" not in r:
            continue
        kind, value = TARGETS[r["budget"]]
        t = {"method": r["method"], "strategy": r["strategy"], "budget": r["budget"], "kind": kind}
        if kind == "within":
            t["target"] = -value
            t["value"] = 100 * r["d_accuracy"]["mean"]
            t["margin"] = t["value"] + value
            t["met_lo"] = 100 * r["d_accuracy"]["lo"] >= -value
        else:
            if best is None:
                continue
            t["target"] = 100 * best[1]["mean"]
            t["expert"] = best[0]
            t["expert_seeds"] = sorted(best[1]["per_seed"])
            t["value"] = 100 * r["accuracy"]
            t["margin"] = t["value"] - t["target"]
            t["met_lo"] = 100 * (full[r["method"]] + r["d_accuracy"]["lo"]) >= t["target"]
        t["met"] = t["margin"] >= 0
        out.append(t)
    return out
