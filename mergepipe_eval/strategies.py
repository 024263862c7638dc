"""Plan strategies side by side (issue 12): a continuous, paired screen on MiniLM.

For each merge (method x strategy x budget) of one expert family, every task's test
examples are scored with that task's expert head on the merged encoder, and compared,
example by example, with the same method's full read:

- mean label log-likelihood (log softmax of the label's logit; higher is better);
- KL(full merge || budgeted merge) of the class distributions (0 = the full read's
  predictions exactly);
- accuracy.

Differences are means over the pooled test examples (every task has the same count, so
this is also the mean of the task means), with a paired bootstrap 95% interval
(resampling examples, fixed seed). The same is done between strategies at one (method,
budget): e.g. balanced - energy. Merges are made by the mergepipe CLI (`run`, cached:
an unchanged plan is a no-op) and per-example scores are cached as JSON next to them,
so a rerun only rescores what changed.

    python -m mergepipe_eval strategy-screen --family workflows/real/work/minilm/probe/s0 \
        --base workflows/real/work/minilm/base --tasks-root workflows/real/work/tasks \
        --out workflows/real/results/strategies_minilm.json
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

METHODS = {
    "ta_l0.5": {"method": "task_arithmetic", "parameters": {"lambda": 0.5}},
    "ties": {"method": "ties", "parameters": {"lambda": 1.0, "density": 0.5}},
}
STRATEGIES = {
    "energy": {"strategy": "energy"},  # named: a config without plan: gets sketch below full since b14ef95
    "balanced": {"strategy": "balanced"},
    "compensated": {"strategy": "compensated"},
    "compensated_balanced": {"strategy": "compensated", "select": "balanced"},
    "sketch": {"strategy": "sketch"},  # ternary sketches where a full block does not fit
}
BUDGETS = ["10%", "25%", "50%"]
TASKS = ["noun_cat", "verb_cat", "pos", "shuffled", "topic"]


# CPU-heavy steps (merges, scoring) take this lock, so they never overlap another heavy job
# on a shared machine (`flock /tmp/mergepipe-heavy.lock CMD` does the same from a shell)
HEAVY_LOCK = os.environ.get("MERGEPIPE_HEAVY_LOCK", "/tmp/mergepipe-heavy.lock")


@contextmanager
def heavy():
    with open(HEAVY_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_config(path: Path, *, base: Path, experts: dict[str, Path], method: dict, strategy: dict,
                 cache_dir: Path) -> None:
    def rel(p: Path) -> str:
        return Path(os.path.relpath(p.resolve(), path.parent.resolve())).as_posix()

    cfg = {"base": rel(base),
           "experts": [{"name": n, "path": rel(p), "weight": 1.0} for n, p in experts.items()],
           "method": method["method"], "parameters": method["parameters"], "seed": 0, "budget": "full",
           "block_bytes": "1MiB", "output": {"dir": "unused", "dtype": None, "shard_bytes": None},
           "cache_dir": rel(cache_dir)}
    if strategy:
        cfg["plan"] = strategy
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg, sort_keys=False)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def merge(config: Path, budget: str, out: Path) -> None:
    with heavy():
        subprocess.run(["nice", sys.executable, "-m", "mergepipe", "run", str(config), "--budget", budget,
                        "-o", str(out), "-q"], check=True)


class ExampleScorer:
    """Per-example log-probabilities of every class, per task, with the task's expert head."""

    def __init__(self, base: Path, tasks: dict[str, Path], heads: dict[str, Path], max_len: int = 32):
        from mergepipe_eval.minilm import load_tokenizer, set_threads, tokenize
        from mergepipe_eval.tasks import read_split
        set_threads()
        self.base, self.heads = base, heads
        tok = load_tokenizer(base)
        self.tests = {}
        for t, d in tasks.items():
            texts, y, _ = read_split(d, "test")
            self.tests[t] = (tokenize(tok, texts, max_len), y)

    def logprobs(self, model: Path) -> dict[str, dict]:
        from mergepipe_eval.minilm import features, load_encoder, load_head
        enc = load_encoder(model, config_dir=self.base)
        out = {}
        with torch.no_grad():
            for t, (tokens, y) in self.tests.items():
                lp = torch.log_softmax(load_head(self.heads[t])(features(enc, tokens)).double(), -1)
                out[t] = {"y": y, "logprobs": lp.tolist()}
        return out


def cached_logprobs(scorer: ExampleScorer, model: Path, cache: Path) -> dict[str, dict]:
    """Scores of `model`, keyed by its manifest hash (or the folder name for unmerged models)."""
    manifest = model / "manifest.json"
    key = json.loads(manifest.read_text())["manifest_hash"] if manifest.exists() else model.name
    if cache.exists():
        d = json.loads(cache.read_text())
        if d.get("key") == key:
            return d["tasks"]
    with heavy():
        tasks = scorer.logprobs(model)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "tasks": tasks}))
    return tasks


def per_example(scores: dict[str, dict], ref: dict[str, dict] | None = None) -> dict[str, list[float]]:
    """Pooled per-example label log-likelihood, correctness and (vs `ref`) KL(ref || scores)."""
    ll, acc, kl = [], [], []
    for t in TASKS:
        s = scores[t]
        for i, (y, lp) in enumerate(zip(s["y"], s["logprobs"])):
            ll.append(lp[y])
            acc.append(1.0 if max(range(len(lp)), key=lambda j: lp[j]) == y else 0.0)
            if ref is not None:
                rp = ref[t]["logprobs"][i]
                kl.append(sum(math.exp(a) * (a - b) for a, b in zip(rp, lp)))
    out = {"ll": ll, "acc": acc}
    if ref is not None:
        out["kl"] = kl
    return out


def paired(a: list[float], b: list[float] | None = None, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """mean(a - b) (or mean(a)) with a paired bootstrap 95% interval over examples."""
    x = torch.tensor(a, dtype=torch.float64)
    if b is not None:
        x = x - torch.tensor(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(x), (n_boot, len(x)), generator=g)
    means = x[idx].mean(1).sort().values
    return {"mean": float(x.mean()), "lo": float(means[int(0.025 * n_boot)]),
            "hi": float(means[int(0.975 * n_boot) - 1]), "n": len(x)}


def run_screen(family: Path, base: Path, tasks_root: Path, out: Path, *, budgets: list[str],
               methods: list[str], strategies: list[str], n_boot: int = 2000) -> dict:
    experts = {t: family / "experts" / t / "model" for t in TASKS}
    heads = {t: family / "experts" / t / "head.safetensors" for t in TASKS}
    work = family / "strategies"
    scorer = ExampleScorer(base, {t: tasks_root / t for t in TASKS}, heads)
    result = {"family": family.as_posix(), "n_examples": None, "bootstrap": {"resamples": n_boot, "seed": 0},
              "methods": {m: METHODS[m] for m in methods}, "strategies": {s: STRATEGIES[s] for s in strategies},
              "rows": [], "between": []}
    for m in methods:
        cfgs = {}
        for s in strategies:
            cfgs[s] = work / "configs" / f"{m}_{s}.yaml"
            write_config(cfgs[s], base=base, experts=experts, method=METHODS[m], strategy=STRATEGIES[s],
                         cache_dir=work / "cache")
        full_dir = work / "models" / f"{m}_full"
        merge(cfgs[strategies[0]], "full", full_dir)
        full = cached_logprobs(scorer, full_dir, work / "scores" / f"{m}_full.json")
        full_ex = per_example(full, full)
        result["n_examples"] = len(full_ex["ll"])
        result["rows"].append({"method": m, "strategy": "-", "budget": "full",
                               "accuracy": sum(full_ex["acc"]) / len(full_ex["acc"]),
                               "label_ll": sum(full_ex["ll"]) / len(full_ex["ll"])})
        for budget in budgets:
            per = {}
            for s in strategies:
                name = f"{m}_{s}_{budget.rstrip('%')}"
                model_dir = work / "models" / name
                merge(cfgs[s], budget, model_dir)
                man = json.loads((model_dir / "manifest.json").read_text())
                scores = cached_logprobs(scorer, model_dir, work / "scores" / f"{name}.json")
                ex = per_example(scores, full)
                per[s] = ex
                result["rows"].append({
                    "method": m, "strategy": s, "budget": budget,
                    "expert_bytes_read": man["bytes"]["expert_bytes_read"],
                    "read_by_expert": man["bytes"]["expert_bytes_read_by_expert"],
                    "bound": man["bound"],
                    "accuracy": sum(ex["acc"]) / len(ex["acc"]),
                    "label_ll": sum(ex["ll"]) / len(ex["ll"]),
                    "d_accuracy": paired(ex["acc"], full_ex["acc"], n_boot=n_boot),
                    "d_label_ll": paired(ex["ll"], full_ex["ll"], n_boot=n_boot),
                    "kl_full_budgeted": paired(ex["kl"], n_boot=n_boot),
                    "per_task_accuracy": _per_task_acc(scores),
                })
                print(json.dumps({k: result["rows"][-1][k] for k in ("method", "strategy", "budget", "accuracy",
                                                                     "label_ll")}), flush=True)
            for s in strategies[1:]:
                result["between"].append({
                    "method": m, "budget": budget, "a": s, "b": strategies[0],
                    "d_accuracy": paired(per[s]["acc"], per[strategies[0]]["acc"], n_boot=n_boot),
                    "d_label_ll": paired(per[s]["ll"], per[strategies[0]]["ll"], n_boot=n_boot),
                    "d_kl": paired(per[s]["kl"], per[strategies[0]]["kl"], n_boot=n_boot),
                })
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def _per_task_acc(scores: dict[str, dict]) -> dict[str, float]:
    out = {}
    for t in TASKS:
        s = scores[t]
        hits = sum(1 for y, lp in zip(s["y"], s["logprobs"]) if max(range(len(lp)), key=lambda j: lp[j]) == y)
        out[t] = hits / len(s["y"])
    return out


def _ci(d: dict, scale: float = 1.0, digits: int = 2, fmt: str = "f") -> str:
    return (f"{d['mean'] * scale:+.{digits}{fmt}} [{d['lo'] * scale:+.{digits}{fmt}}, "
            f"{d['hi'] * scale:+.{digits}{fmt}}]")


def to_markdown(result: dict) -> str:
    """The tables of EVAL.md's strategy section."""
    lines = [f"{result['n_examples']} test examples (5 tasks x 480), paired against the same method's full "
             f"read; 95% intervals from a paired bootstrap over examples ({result['bootstrap']['resamples']} "
             "resamples, seed 0).", "",
             "| method | strategy | budget | accuracy | Δ acc (points) | label log-lik | Δ log-lik (nats) "
             "| KL(full ‖ budgeted) (nats) |",
             "|---|---|---|---:|---|---:|---|---|"]
    for r in result["rows"]:
        if r["budget"] == "full":
            lines.append(f"| {r['method']} | (any) | full | {100 * r['accuracy']:.2f} | – | {r['label_ll']:.4f} "
                         "| – | – |")
            continue
        lines.append(f"| {r['method']} | {r['strategy']} | {r['budget']} | {100 * r['accuracy']:.2f} | "
                     f"{_ci(r['d_accuracy'], 100)} | {r['label_ll']:.4f} | {_ci(r['d_label_ll'], 1, 4)} | "
                     f"{_ci(r['kl_full_budgeted'], 1, 2, 'e')} |")
    lines += ["", "Strategy against energy at the same method and budget (paired, same examples; positive "
              "Δ acc / Δ log-lik and negative Δ KL favour the strategy):", "",
              "| method | budget | strategy − energy | Δ acc (points) | Δ log-lik (nats) | Δ KL (nats) |",
              "|---|---|---|---|---|---|"]
    for b in result["between"]:
        lines.append(f"| {b['method']} | {b['budget']} | {b['a']} − {b['b']} | {_ci(b['d_accuracy'], 100)} | "
                     f"{_ci(b['d_label_ll'], 1, 4)} | {_ci(b['d_kl'], 1, 2, 'e')} |")
    return "\n".join(lines) + "\n"


def across_seeds(families: list[Path], *, methods: list[str], strategies: list[str], budgets: list[str],
                 n_boot: int = 2000) -> dict:
    """Strategy - energy (the first strategy) and budgeted - full, averaged over fine-tuning seeds.

    Every seed's family is scored on the same test examples, so the per-example differences
    are averaged over seeds first and the bootstrap resamples examples (each carrying all
    its seeds): the interval covers example sampling for these seeds' experts. Reads the
    score caches `run_screen` wrote (no model is loaded)."""
    def load(fam: Path, name: str) -> dict:
        return json.loads((fam / "strategies" / "scores" / f"{name}.json").read_text())["tasks"]

    def avg(vectors: list[list[float]]) -> list[float]:
        return [sum(v) / len(v) for v in zip(*vectors)]

    rows = []
    for m in methods:
        fulls = {fam: load(fam, f"{m}_full") for fam in families}
        for budget in budgets:
            ex = {}
            for st_name in strategies:
                per_seed = [per_example(load(fam, f"{m}_{st_name}_{budget.rstrip('%')}"), fulls[fam])
                            for fam in families]
                full_ex = [per_example(fulls[fam], fulls[fam]) for fam in families]
                ex[st_name] = {k: avg([p[k] for p in per_seed]) for k in ("acc", "ll", "kl")}
                ex[st_name]["full_acc"] = avg([f["acc"] for f in full_ex])
                ex[st_name]["full_ll"] = avg([f["ll"] for f in full_ex])
            ref = strategies[0]
            for st_name in strategies:
                e = ex[st_name]
                row = {"method": m, "budget": budget, "strategy": st_name, "seeds": len(families),
                       "d_accuracy_vs_full": paired(e["acc"], e["full_acc"], n_boot=n_boot),
                       "kl_full_budgeted": paired(e["kl"], n_boot=n_boot)}
                if st_name != ref:
                    row["d_accuracy_vs_ref"] = paired(e["acc"], ex[ref]["acc"], n_boot=n_boot)
                    row["d_label_ll_vs_ref"] = paired(e["ll"], ex[ref]["ll"], n_boot=n_boot)
                    row["d_kl_vs_ref"] = paired(e["kl"], ex[ref]["kl"], n_boot=n_boot)
                rows.append(row)
    return {"families": [f.as_posix() for f in families], "reference": strategies[0], "resamples": n_boot,
            "rows": rows}


def seeds_markdown(res: dict) -> str:
    ref = res["reference"]
    lines = [f"Mean over {len(res['families'])} fine-tuning seeds (same 2400 test examples; per-example "
             f"differences averaged over seeds, then a paired bootstrap over examples, {res['resamples']} "
             "resamples, seed 0):", "",
             f"| method | budget | strategy | Δ acc vs full (points) | KL(full ‖ budgeted) (nats) | Δ acc vs {ref} "
             f"(points) | Δ log-lik vs {ref} (nats) | Δ KL vs {ref} (nats) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        vs = ("– | – | –" if "d_accuracy_vs_ref" not in r else
              f"{_ci(r['d_accuracy_vs_ref'], 100)} | {_ci(r['d_label_ll_vs_ref'], 1, 4)} | "
              f"{_ci(r['d_kl_vs_ref'], 1, 2, 'e')}")
        lines.append(f"| {r['method']} | {r['budget']} | {r['strategy']} | {_ci(r['d_accuracy_vs_full'], 100)} | "
                     f"{_ci(r['kl_full_budgeted'], 1, 2, 'e')} | {vs} |")
    return "\n".join(lines) + "\n"


BEGIN = "<!-- strategy-screen: generated by `python -m mergepipe_eval strategy-screen`; begin -->"
END = "<!-- strategy-screen: end -->"


def plot(result: dict, path: Path) -> None:
    """KL(full || budgeted) and accuracy against the full read, per strategy and budget (log scale KL)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = list(result["methods"])
    fig, axes = plt.subplots(2, len(methods), figsize=(6 * len(methods), 7.5), squeeze=False)
    for col, m in enumerate(methods):
        for s in result["strategies"]:
            rows = [r for r in result["rows"] if r["method"] == m and r["strategy"] == s]
            xs = [float(r["budget"].rstrip("%")) for r in rows]
            for row_i, (key, scale) in enumerate((("kl_full_budgeted", 1.0), ("d_accuracy", 100.0))):
                ax = axes[row_i][col]
                ys = [scale * r[key]["mean"] for r in rows]
                err = [[scale * (r[key]["mean"] - r[key]["lo"]) for r in rows],
                       [scale * (r[key]["hi"] - r[key]["mean"]) for r in rows]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=s)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{m}: KL(full merge || budgeted) (nats, 95% CI)")
        axes[1][col].set_title(f"{m}: accuracy − full read (points, paired 95% CI)")
        axes[1][col].axhline(0, color="gray", ls=":")
        for ax in axes[:, col]:
            ax.set_xlabel("budget (% of the full read)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def render_section(results: list[tuple[str, dict]], notes: str = "", plot_name: str | None = None,
                   seeds: dict | None = None) -> str:
    """The EVAL.md section: notes (hand-written analysis), the plot (of the first result),
    each (label, strategy-screen result)'s tables, then, when given, the mean over seeds."""
    figure = [f"![KL and accuracy against the full read, per strategy]({plot_name})", ""] if plot_name else []
    tables = []
    for label, result in results:
        tables += [f"### {label}", "", to_markdown(result).rstrip("\n"), ""]
    extra = ["### Mean over fine-tuning seeds", "", seeds_markdown(seeds).rstrip("\n"), ""] if seeds else []
    return "\n".join([BEGIN, "", "# Plan strategies (issue 12): energy vs balanced vs compensated", "",
                      notes.strip(), "", *figure, *tables, *extra, END]) + "\n"


def splice(markdown: Path, section: str) -> None:
    """Replace this section of `markdown` (between BEGIN and END), or append it."""
    from mergepipe_eval.report import splice_between
    splice_between(markdown, section, BEGIN, END)
