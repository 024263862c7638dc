"""Real LoRA adapters against dense experts on SmolLM2-135M (issue 25, item 6).

One seed's family: the dense `sft30` experts (smollm.train_expert) and LoRA adapters of the
same tasks, recipe and seed (smollm_lora.train_adapter). Everything is merged by the mergepipe
CLI (`mergepipe run`, `mergepipe extract-lora`) and scored on the same test examples (the first
`test_per_class` test examples of each class), per example, then compared in pairs:

- **adapter merge vs dense merge** of the same tasks, same method and budget (experts as
  `adapter:` against the dense experts as `path:`);
- **merged adapter vs merged model**: `output.adapter` (`cat`, and `svd` at each rank) of the
  adapters' task arithmetic, applied to the base, against the adapters' merged model;
- **extracted adapter vs its dense expert**: `extract-lora` of each dense expert at each rank,
  applied to the base, against the dense expert itself;
- each adapter alone against its dense expert, and budgeted merges against their full read.

A single adapter is "applied" by a task-arithmetic merge of it alone (weight 1, λ 1) into a
model of the base's dtype, as `merge_and_unload` and saving would. Differences are means over
pooled examples with a paired bootstrap 95% interval and McNemar's exact p; `label_kl` is
KL(b ‖ a) of the label distributions. Merges are mergepipe's (an unchanged plan is a no-op),
extractions are kept once their manifest exists, and scores are cached by the model's manifest
hash, so a rerun only does what changed. The result is rewritten after every model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from mergepipe_eval.smollm_screen import (
    METHODS, by_length, mcnemar, per_example, per_task_acc, prefix_logprobs, shared_prefix)
from mergepipe_eval.strategies import heavy, paired

SCORING = "adapter-protocol-v1"  # how label scores are computed; a cache made otherwise is redone


class TestSet:
    """The first per_class test examples per class of each task, encoded as smollm.encode does."""

    def __init__(self, base: Path, task_dirs: dict[str, Path], per_class: dict[str, int], *,
                 max_text_tokens: int = 48, batch_size: int = 16):
        from mergepipe_eval.smollm import encode, load_tokenizer, set_threads
        set_threads()
        self.base, self.batch_size = base, batch_size
        self.tok = load_tokenizer(base)
        self.tests = {t: encode(self.tok, d, "test", max_text_tokens=max_text_tokens,
                                per_class=per_class[t]) for t, d in task_dirs.items()}
        for task, data in self.tests.items():
            if any(len(lab) != 1 for lab in data.labels):
                raise ValueError(f"{task}: every label must be one token, got {data.labels}")

    def n(self) -> dict[str, int]:
        return {t: len(d.y) for t, d in self.tests.items()}

    @torch.no_grad()
    def scores(self, model_dir: Path) -> dict:
        """{"test": {task: {"y", "label_logprobs"}}}: full-vocabulary log p of each label token."""
        from mergepipe_eval.smollm import load_model
        model = load_model(model_dir, config_dir=self.base)
        model.eval()
        out = {}
        for task, data in self.tests.items():
            rows: list = [None] * len(data.y)
            order = by_length(data.prompts)
            k = shared_prefix(data.prompts)
            label_ids = [lab[0] for lab in data.labels]
            for i in range(0, len(data.y), self.batch_size):
                idx = order[i:i + self.batch_size]
                lp = prefix_logprobs(model, data.prompts[0][:k], [data.prompts[j][k:] for j in idx],
                                     self.tok.pad_token_id)
                for j, row in zip(idx, lp[:, label_ids].double().tolist()):
                    rows[j] = row
            out[task] = {"y": list(data.y), "label_logprobs": rows}
        return {"test": out}


def model_key(model_dir: Path) -> str:
    """A merge's manifest hash; a trained expert (no manifest) by its weights file's size and mtime."""
    manifest = model_dir / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())["manifest_hash"]
    st = (model_dir / "model.safetensors").stat()
    return f"{model_dir.as_posix()}:{st.st_size}:{st.st_mtime_ns}"


def cached_scores(tests: TestSet, model_dir: Path, cache: Path, log: list[dict]) -> dict:
    """model_dir's label scores, from `cache` when it holds this model's (key) on these examples."""
    key = model_key(model_dir)
    if cache.exists():
        d = json.loads(cache.read_text())
        if d.get("key") == key and d.get("scoring") == SCORING and d.get("n") == tests.n():
            return d
    t0 = time.monotonic()
    with heavy():
        d = {"key": key, "scoring": SCORING, "n": tests.n(), **tests.scores(model_dir)}
    d["seconds"] = round(time.monotonic() - t0, 1)
    log.append({"score": cache.stem, "seconds": d["seconds"]})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(d))
    print(f"scored {cache.stem} in {d['seconds']} s", file=sys.stderr, flush=True)
    return d


def write_config(path: Path, *, base: Path, experts: dict[str, tuple[str, Path]], method: dict,
                 cache_dir: Path, adapter_out: dict | None = None) -> Path:
    """A params.yaml (paths relative to it); experts: name -> ("path" | "adapter", folder)."""
    def rel(p: Path) -> str:
        return Path(os.path.relpath(Path(p).resolve(), path.parent.resolve())).as_posix()

    output: dict = {"dir": "unused", "dtype": None}
    if adapter_out is not None:
        output["adapter"] = adapter_out
    cfg = {"base": rel(base),
           "experts": [{"name": n, kind: rel(p), "weight": 1.0} for n, (kind, p) in experts.items()],
           "method": method["method"], "parameters": method["parameters"], "seed": 0, "budget": "full",
           "block_bytes": "1MiB", "output": output, "cache_dir": rel(cache_dir)}
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg, sort_keys=False)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def _mergepipe(args: list[str], log: list[dict], what: str) -> None:
    t0 = time.monotonic()
    with heavy():
        subprocess.run(["nice", "-n", "19", sys.executable, "-m", "mergepipe", *args], check=True)
    log.append({what: args[-1] if what == "extract" else args[1], "seconds": round(time.monotonic() - t0, 1)})


def merge(config: Path, budget: str, out: Path, log: list[dict]) -> Path:
    _mergepipe(["run", str(config), "--budget", budget, "-o", str(out), "-q", "--threads", "1"], log, "merge")
    return out


def extract(expert: Path, base: Path, rank: int, out: Path, log: list[dict]) -> Path:
    if not (out / "manifest.json").exists():  # extract-lora has no no-op: kept once written
        _mergepipe(["extract-lora", str(expert), "--base", str(base), "--rank", str(rank), "-q",
                    "--threads", "1", "-o", str(out)], log, "extract")
    return out


def compare(a: dict, b: dict, *, n_boot: int) -> dict:
    """a against b on the same examples: accuracies, paired Δ acc and Δ label log-lik, McNemar,
    KL(b ‖ a) of the label distributions."""
    ea, eb = per_example(a, "test", ref=b), per_example(b, "test")
    return {"acc_a": sum(ea["acc"]) / len(ea["acc"]), "acc_b": sum(eb["acc"]) / len(eb["acc"]),
            "acc_diff": paired(ea["acc"], eb["acc"], n_boot=n_boot),
            "ll_diff": paired(ea["ll"], eb["ll"], n_boot=n_boot),
            "mcnemar": mcnemar(ea["acc"], eb["acc"]),
            "label_kl": paired(ea["kl"], n_boot=n_boot),
            "per_task_a": per_task_acc(a, "test"), "per_task_b": per_task_acc(b, "test")}


def _adapter_report(folder: Path) -> dict:
    """Per-module truncation error of an `svd` output (adapter_report.json), summarized."""
    path = folder / "adapter_report.json"
    if not path.exists():
        return {}
    rep = json.loads(path.read_text())
    errors = [m["relative_error"] for m in rep["modules"].values() if m.get("relative_error") is not None]
    if not errors:
        return {"modules": len(rep["modules"])}
    return {"modules": len(errors), "error_mean": sum(errors) / len(errors), "error_max": max(errors)}


def _extract_report(folder: Path) -> dict:
    """Retained energy of the factored modules (extract_report.json), summarized."""
    rep = json.loads((folder / "extract_report.json").read_text())
    energies = [m["energy"] for m in rep["modules"].values()]
    return {"modules": len(energies), "energy_mean": sum(energies) / len(energies),
            "energy_min": min(energies), "whole": sorted(rep.get("whole", {}))}


def budget_tag(budget: str) -> str:
    return "full" if budget == "full" else "b" + budget.rstrip("%")


class Family:
    """One seed's models: where each lives, how it is made, its cached scores; the result JSON."""

    def __init__(self, dense: Path, lora: Path, work: Path, base: Path, tests: TestSet, out: Path,
                 result: dict, n_boot: int):
        self.dense, self.lora, self.work, self.base = dense, lora, work, base
        self.tests, self.out, self.result, self.n_boot = tests, out, result, n_boot
        self.log: list[dict] = result["timings"]
        self._scores: dict[str, dict] = {}

    def config(self, name: str, experts: dict[str, tuple[str, Path]], method: str,
               adapter_out: dict | None = None) -> Path:
        return write_config(self.work / "configs" / f"{name}.yaml", base=self.base, experts=experts,
                            method=METHODS[method], cache_dir=self.work / "cache", adapter_out=adapter_out)

    def applied(self, name: str, adapter: Path) -> Path:
        """The base with one adapter merged in (task arithmetic, weight 1, λ 1)."""
        cfg = self.config(f"apply_{name}", {name: ("adapter", adapter)}, "ta_l1.0")
        return merge(cfg, "full", self.work / "models" / name, self.log)

    def add(self, name: str, model_dir: Path, **info) -> dict:
        """Score model_dir under `name` (cached), record its accuracy, rewrite the result."""
        scores = cached_scores(self.tests, model_dir, self.work / "scores" / f"{name}.json", self.log)
        self._scores[name] = scores
        correct = per_example(scores, "test")["acc"]
        # per-example correctness (pooled, TASKS order): the report's mean over seeds pairs them
        self.result["models"][name] = {"path": model_dir.as_posix(), "acc": sum(correct) / len(correct),
                                       "per_task": per_task_acc(scores, "test"),
                                       "correct": "".join("1" if c else "0" for c in correct), **info}
        self.write()
        return scores

    def pair(self, group: str, a: str, b: str, **info) -> None:
        row = {"group": group, "a": a, "b": b, **info,
               **compare(self._scores[a], self._scores[b], n_boot=self.n_boot)}
        rows = [r for r in self.result["pairs"] if (r["a"], r["b"]) != (a, b)]
        self.result["pairs"] = [*rows, row]
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.out)


def run_experts(fam: Family, tasks: list[str]) -> None:
    """Each dense expert and each adapter alone; the adapter against its dense expert."""
    for t in tasks:
        fam.add(f"dense_{t}", fam.dense / "experts" / t / "model")
        fam.add(f"lora_{t}", fam.applied(f"lora_{t}", fam.lora / t / "adapter"))
        fam.pair("alone", f"lora_{t}", f"dense_{t}", expert=t)


def run_merges(fam: Family, tasks: list[str], methods: list[str], budget: str) -> None:
    """Adapter merge against the dense merge of the same tasks, method and budget (and, below
    full, each against its full read)."""
    tag = budget_tag(budget)
    for m in methods:
        for kind, experts in (("dense", {t: ("path", fam.dense / "experts" / t / "model") for t in tasks}),
                              ("lora", {t: ("adapter", fam.lora / t / "adapter") for t in tasks})):
            name = f"{kind}_{m}_{tag}"
            cfg = fam.config(f"{kind}_{m}", experts, m)
            fam.add(name, merge(cfg, budget, fam.work / "models" / name, fam.log), method=m, budget=budget)
            if budget != "full":
                fam.pair("budget", name, f"{kind}_{m}_full", method=m, budget=budget, kind=kind)
        fam.pair("merge", f"lora_{m}_{tag}", f"dense_{m}_{tag}", method=m, budget=budget)


def run_adapter_out(fam: Family, tasks: list[str], method: str, ranks: list[int]) -> None:
    """One merged adapter (cat, svd at each rank) of the adapters' `method` merge, applied,
    against the adapters' merged model (lora_<method>_full, run_merges)."""
    experts = {t: ("adapter", fam.lora / t / "adapter") for t in tasks}
    for spec in [{"combination": "cat"}, *({"combination": "svd", "rank": r} for r in ranks)]:
        name = "out_cat" if spec["combination"] == "cat" else f"out_svd_r{spec['rank']}"
        folder = merge(fam.config(name, experts, method, adapter_out=spec), "full", fam.work / "adapters" / name,
                       fam.log)
        fam.add(name, fam.applied(name, folder), **spec, truncation=_adapter_report(folder))
        fam.pair("adapter_out", name, f"lora_{method}_full", method=method, **spec)


def run_extract(fam: Family, tasks: list[str], ranks: list[int]) -> None:
    """extract-lora of each dense expert at each rank, applied, against the dense expert."""
    for t in tasks:
        for r in ranks:
            name = f"extract_{t}_r{r}"
            folder = extract(fam.dense / "experts" / t / "model", fam.base, r, fam.work / "adapters" / name,
                             fam.log)
            fam.add(name, fam.applied(name, folder), rank=r, expert=t, extraction=_extract_report(folder))
            fam.pair("extract", name, f"dense_{t}", expert=t, rank=r)


def run(*, dense: Path, lora: Path, base: Path, tasks_root: Path, out: Path, tasks: list[str],
        test_per_class: dict[str, int], methods: list[str], budgets: list[str], out_method: str,
        svd_ranks: list[int], extract_ranks: list[int], seed: int, n_boot: int = 2000) -> dict:
    """The whole protocol for one seed's family; the result JSON at `out` (rewritten as it goes)."""
    from mergepipe_eval.smollm_screen import mergepipe_source
    tests = TestSet(base, {t: tasks_root / t for t in tasks}, test_per_class)
    result = {"seed": seed, "tasks": tasks, "n": tests.n(), "bootstrap": {"resamples": n_boot, "seed": 0},
              "dense": dense.as_posix(), "lora": lora.as_posix(), "methods": {m: METHODS[m] for m in methods},
              "budgets": budgets, "out_method": out_method, "svd_ranks": svd_ranks,
              "extract_ranks": extract_ranks, "mergepipe": mergepipe_source(),
              "train": {kind: {t: json.loads((root / t / "train.json").read_text()) for t in tasks}
                        for kind, root in (("dense", dense / "experts"), ("lora", lora))},
              "models": {}, "pairs": [], "timings": []}
    fam = Family(dense, lora, lora / "eval", base, tests, out, result, n_boot)
    run_experts(fam, tasks)
    run_merges(fam, tasks, methods, "full")
    run_adapter_out(fam, tasks, out_method, svd_ranks)
    run_extract(fam, tasks, extract_ranks)
    for budget in budgets:
        if budget != "full":
            run_merges(fam, tasks, methods, budget)
    return result
