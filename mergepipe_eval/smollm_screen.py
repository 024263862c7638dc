"""Plan strategies on SmolLM2-135M (issue 12): a continuous, paired screen, then test accuracy.

One expert family (3 SmolLM2 experts: noun_cat, pos, topic) is merged by the mergepipe CLI
for every (method, strategy, budget); each merge is compared with the same method's full
read on the same examples:

- **dev label log-likelihood**: log softmax over the task's label tokens at the answer
  position (the model can only answer a label), on a dev split = training examples that no
  expert saw (each expert trained on the first steps*batch_size examples of a seeded
  permutation of its train split; the rest is recomputed here and never trained on), the
  first `dev_per_class` of each class in file order. Test examples are never used here.
- **KL(full merge || budgeted merge)** of the next-token distributions over the whole
  vocabulary, at every position of `heldout_seqs` sequences of `heldout_len` tokens of the
  held-out text (Debian text in no task split, disjoint from the calibration text:
  mergepipe_eval/calib.py), averaged per sequence.
- then **test accuracy** (the first `test_per_class` test examples per class, as the
  SmolLM2 accuracy table uses) for the full read, energy and the strategy the screen ranks
  best, at the chosen budgets, and for each expert alone.

Differences are means over pooled examples with a paired bootstrap 95% interval (resampling
examples or held-out sequences, fixed seed); accuracy differences also get McNemar's exact
two-sided p from the discordant pairs. Merges are cached by mergepipe (an unchanged plan is a
no-op) and per-model scores are cached as JSON keyed by the manifest hash (and the full
read's for KL), so a rerun only rescores what changed. Rows are written after every model,
so an interrupted run leaves a usable partial result.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from mergepipe_eval.strategies import heavy, paired

METHODS = {  # as config.yaml smollm.merges
    "ta_l0.5": {"method": "task_arithmetic", "parameters": {"lambda": 0.5}},
    "ta_l1.0": {"method": "task_arithmetic", "parameters": {"lambda": 1.0}},
    "ties": {"method": "ties", "parameters": {"lambda": 1.0, "density": 0.5}},
}
TASKS = ("noun_cat", "pos", "topic")  # the default task set (`--tasks` chooses others, e.g. + verb_cat)


EMB_BLOCKS = "64KiB"  # the *_emb64k variants: vocabulary tensors in 64 KiB blocks (embedding_block_bytes)


def strategy_specs(calib_text: Path, max_tokens: int = 16384, seq_len: int = 256) -> dict[str, dict]:
    """The `plan:` mapping of each strategy; `embedding_block_bytes` goes to the config's top level."""
    cal = {"strategy": "calibrated", "text": str(calib_text), "max_tokens": max_tokens, "seq_len": seq_len}
    return {
        # named: since b14ef95 a config without `plan:` gets `sketch` below full budget for
        # these methods (the protocol's merges ran ec69cdf, where no `plan:` was energy)
        "energy": {"strategy": "energy"},
        "balanced": {"strategy": "balanced"},
        "compensated": {"strategy": "compensated"},
        "calibrated": {**cal, "shares": "none"},
        "calibrated_weight": {**cal, "shares": "weight"},
        "energy_emb64k": {"embedding_block_bytes": EMB_BLOCKS},
        "calibrated_emb64k": {**cal, "shares": "none", "embedding_block_bytes": EMB_BLOCKS},
        # and at most 10% of the budget on vocabulary tensors in the first pass
        "calibrated_emb64k_v10": {**cal, "shares": "none", "vocabulary_share": 0.1,
                                  "embedding_block_bytes": EMB_BLOCKS},
        "sketch": {"strategy": "sketch"},  # ternary sketches where a full block does not fit
    }


def write_config(path: Path, *, base: Path, experts: dict[str, Path], method: dict, strategy: dict,
                 cache_dir: Path) -> None:
    def rel(p: Path | str) -> str:
        return Path(os.path.relpath(Path(p).resolve(), path.parent.resolve())).as_posix()

    cfg = {"base": rel(base),
           "experts": [{"name": n, "path": rel(p), "weight": 1.0} for n, p in experts.items()],
           "method": method["method"], "parameters": method["parameters"], "seed": 0, "budget": "full",
           "block_bytes": "1MiB", "output": {"dir": "unused", "dtype": None, "shard_bytes": None},
           "cache_dir": rel(cache_dir)}
    plan = dict(strategy)
    if "embedding_block_bytes" in plan:
        cfg["embedding_block_bytes"] = plan.pop("embedding_block_bytes")
    if plan:
        if "text" in plan:
            plan["text"] = rel(plan["text"])
        cfg["plan"] = plan
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg, sort_keys=False)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def merge(config: Path, budget: str, out: Path, log: list[dict]) -> None:
    t0 = time.monotonic()
    with heavy():
        subprocess.run(["nice", "-n", "19", sys.executable, "-m", "mergepipe", "run", str(config),
                        "--budget", budget, "-o", str(out), "-q", "--threads", "1"], check=True)
    log.append({"merge": out.name, "seconds": round(time.monotonic() - t0, 1)})


def mergepipe_source() -> dict:
    """Which mergepipe the merges run (the subprocess's import; PYTHONPATH can pin an exported
    commit while the checkout is being edited) and MERGEPIPE_EVAL_MERGEPIPE_COMMIT if set."""
    proc = subprocess.run([sys.executable, "-c", "import mergepipe; print(mergepipe.__file__)"],
                          capture_output=True, text=True)
    return {"module": proc.stdout.strip(), "commit": os.environ.get("MERGEPIPE_EVAL_MERGEPIPE_COMMIT")}


def unseen_train_indices(n: int, seen: int, seed: int) -> set[int]:
    """Train-split indices an expert never saw: smollm.train_expert draws
    torch.randperm(n, Generator().manual_seed(seed)) and trains on its first `seen`."""
    if seen > n:
        return set()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return set(order[seen:])


class Screen:
    """Encoded dev/test prompts and held-out sequences; per-model scores."""

    def __init__(self, base: Path, task_dirs: dict[str, Path], heldout: Path, *, dev_per_class: dict[str, int],
                 test_per_class: dict[str, int], seen: int, train_seed: int, heldout_seqs: int,
                 heldout_len: int, max_text_tokens: int = 48, batch_size: int = 16):
        from mergepipe_eval.smollm import load_tokenizer, prompt, set_threads
        from mergepipe_eval.tasks import read_split
        set_threads()
        self.base, self.batch_size = base, batch_size
        self.tok = load_tokenizer(base)

        def enc(task: str, texts: list[str]) -> list[list[int]]:
            labels = json.loads((task_dirs[task] / "task.json").read_text())["labels"]
            out = []
            for text in texts:
                ids = self.tok(text, add_special_tokens=False)["input_ids"][:max_text_tokens]
                out.append(self.tok(prompt(task, labels, self.tok.decode(ids)),
                                    add_special_tokens=False)["input_ids"])
            return out

        self.labels, self.dev, self.test = {}, {}, {}
        for task, d in task_dirs.items():
            labels = json.loads((d / "task.json").read_text())["labels"]
            ids = [self.tok(" " + lab, add_special_tokens=False)["input_ids"] for lab in labels]
            if any(len(i) != 1 for i in ids):
                raise ValueError(f"{task}: every label must be one token, got {ids}")
            self.labels[task] = [i[0] for i in ids]
            texts, y, _ = read_split(d, "train")
            unseen = unseen_train_indices(len(y), seen, train_seed)
            keep, count = [], {}
            for i, c in enumerate(y):
                if i in unseen and count.get(c, 0) < dev_per_class[task]:
                    count[c] = count.get(c, 0) + 1
                    keep.append(i)
            if min(count.get(c, 0) for c in range(len(labels))) < dev_per_class[task]:
                raise ValueError(f"{task}: not enough unseen train examples for the dev split")
            self.dev[task] = (enc(task, [texts[i] for i in keep]), [y[i] for i in keep])
            texts, y, _ = read_split(d, "test")
            keep, count = [], {}
            for i, c in enumerate(y):
                if count.get(c, 0) < test_per_class[task]:
                    count[c] = count.get(c, 0) + 1
                    keep.append(i)
            self.test[task] = (enc(task, [texts[i] for i in keep]), [y[i] for i in keep])
        text = heldout.read_text(encoding="utf-8")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < heldout_seqs * heldout_len:
            raise ValueError(f"{heldout}: {len(ids)} tokens, need {heldout_seqs * heldout_len}")
        self.heldout = torch.tensor(ids[:heldout_seqs * heldout_len]).view(heldout_seqs, heldout_len)
        self.heldout_sha = hashlib.sha256(text.encode()).hexdigest()
        self._models: dict[str, object] = {}
        self.log: list[dict] | None = None  # run_screen points it at the result's timings
        self._ref_logp: dict[str, torch.Tensor] = {}

    def n(self) -> dict:
        return {"dev": {t: len(v[1]) for t, v in self.dev.items()},
                "test": {t: len(v[1]) for t, v in self.test.items()},
                "heldout": {"sequences": int(self.heldout.shape[0]), "tokens_per_sequence": int(self.heldout.shape[1])}}

    def _load(self, model_dir: Path):
        from mergepipe_eval.smollm import load_model
        model = load_model(model_dir, config_dir=self.base)
        model.eval()
        return model

    @torch.no_grad()
    def _label_scores(self, model, split: dict) -> dict[str, dict]:
        from mergepipe_eval.smollm import _next_token_logprobs
        out = {}
        for task, (prompts, y) in split.items():
            rows: list = [None] * len(y)
            order = by_length(prompts)  # batches of similar length: less padding, same results
            k = shared_prefix(prompts)  # the instruction: computed once per batch, its keys/values reused
            for i in range(0, len(y), self.batch_size):
                idx = order[i:i + self.batch_size]
                if k:
                    lp = prefix_logprobs(model, prompts[0][:k], [prompts[j][k:] for j in idx], self.tok.pad_token_id)
                else:
                    lp = _next_token_logprobs(model, [prompts[j] for j in idx], self.tok.pad_token_id)
                for j, row in zip(idx, lp[:, self.labels[task]].double().tolist()):
                    rows[j] = row
            out[task] = {"y": y, "label_logprobs": rows}  # full-vocabulary log p of each label token
        return out

    @torch.no_grad()
    def _heldout_logp(self, model) -> torch.Tensor:
        return torch.cat([torch.log_softmax(model(input_ids=self.heldout[i:i + 2]).logits.float(), -1)
                          for i in range(0, self.heldout.shape[0], 2)])

    def score(self, model_dir: Path, cache: Path, *, ref_dir: Path | None, test: bool) -> dict:
        """Cached scores of model_dir: dev (and test) label log-probs, KL(ref || model) per held-out sequence."""
        key = _key(model_dir)
        d = json.loads(cache.read_text()) if cache.exists() else {}
        if d.get("key") != key:
            d = {"key": key}
        if d.get("scoring") != SCORING:  # label scores made another way: redo them (KL stays)
            d.pop("dev", None)
            d.pop("test", None)
            d["scoring"] = SCORING
        ref_key = _key(ref_dir) if ref_dir is not None else None
        need_dev = _sizes(d.get("dev")) != _sizes(self.dev)  # missing, or scored on other examples
        need_test = test and _sizes(d.get("test")) != _sizes(self.test)
        need_kl = ref_dir is not None and (d.get("kl") or {}).get("ref") != ref_key + ":" + self.heldout_sha
        if not (need_dev or need_test or need_kl):
            return d
        with heavy():
            t0 = time.monotonic()
            model = self._load(model_dir)
            if need_dev:
                d["dev"] = self._label_scores(model, self.dev)
            if need_test:
                d["test"] = self._label_scores(model, self.test)
            if need_kl:
                ref = self._ref(ref_dir, ref_key)
                logp = self._heldout_logp(model)
                kl = (ref.exp() * (ref - logp)).sum(-1).double().mean(-1)
                d["kl"] = {"ref": ref_key + ":" + self.heldout_sha, "per_sequence": kl.tolist()}
            del model
            d["seconds"] = round(time.monotonic() - t0, 1)
        if self.log is not None:
            self.log.append({"score": model_dir.name, "seconds": d["seconds"],
                             "what": [k for k, v in (("dev", need_dev), ("test", need_test), ("kl", need_kl)) if v]})
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(d))
        print(f"scored {model_dir.name} in {d['seconds']} s", file=sys.stderr, flush=True)
        return d

    def _ref(self, ref_dir: Path, ref_key: str) -> torch.Tensor:
        if ref_key not in self._ref_logp:
            self._ref_logp.clear()  # one reference at a time (~0.2 GB each)
            model = self._load(ref_dir)
            self._ref_logp[ref_key] = self._heldout_logp(model)
        return self._ref_logp[ref_key]


SCORING = "prefix-kv-v1"  # how label scores are computed; a cache entry made otherwise is redone


def shared_prefix(prompts: list[list[int]]) -> int:
    """Length of the token prefix every prompt shares, leaving each at least one token."""
    if not prompts:
        return 0
    n, first, limit = 0, prompts[0], min(len(p) for p in prompts) - 1
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


@torch.no_grad()
def prefix_logprobs(model, prefix: list[int], suffixes: list[list[int]], pad_id: int) -> torch.Tensor:
    """log p(next token | prefix + suffix) over the vocabulary, one row per suffix: the prefix
    runs once, its key/value cache is repeated over the batch, the right-padded suffixes
    continue from it (positions after the prefix; padding masked and never read)."""
    from mergepipe_eval.smollm import _batch
    cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(suffixes))
    ids, mask = _batch(suffixes, pad_id)
    full = torch.cat([torch.ones(len(suffixes), len(prefix), dtype=mask.dtype), mask], 1)
    hidden = model.model(input_ids=ids, attention_mask=full, past_key_values=cache, use_cache=True).last_hidden_state
    last = hidden[torch.arange(len(suffixes)), mask.sum(1) - 1]
    return torch.log_softmax(model.lm_head(last).float(), dim=-1)


def by_length(prompts: list[list[int]]) -> list[int]:
    """Prompt indices by length (stable): batching them in this order pads least."""
    return sorted(range(len(prompts)), key=lambda i: len(prompts[i]))


def _sizes(split: dict | None) -> dict[str, int] | None:
    """Examples per task of a split, from a score file's entry ({"y": ...}) or Screen's ((prompts, y))."""
    if split is None:
        return None
    return {t: len(v["y"] if isinstance(v, dict) else v[1]) for t, v in split.items()}


def _key(model_dir: Path) -> str:
    manifest = model_dir / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())["manifest_hash"]
    st = (model_dir / "model.safetensors").stat()
    return f"{model_dir.as_posix()}:{st.st_size}:{st.st_mtime_ns}"


def split_tasks(scores: dict, split: str) -> list[str]:
    """The tasks a score file holds for a split, in a fixed order (TASKS' first, then by name)."""
    have = set(scores[split])
    return [t for t in TASKS if t in have] + sorted(have - set(TASKS))


def per_example(scores: dict, split: str, ref: dict | None = None) -> dict[str, list[float]]:
    """Pooled per-example label log-likelihood (softmax over the labels), correctness, and
    KL(ref || scores) of the label distributions (when ref is given)."""
    ll, acc, kl = [], [], []
    for t in split_tasks(scores, split):
        s = scores[split][t]
        for i, (y, lp) in enumerate(zip(s["y"], s["label_logprobs"])):
            z = _logsumexp(lp)
            q = [v - z for v in lp]
            ll.append(q[y])
            acc.append(1.0 if max(range(len(lp)), key=lambda j: lp[j]) == y else 0.0)
            if ref is not None:
                r = ref[split][t]["label_logprobs"][i]
                zr = _logsumexp(r)
                p = [v - zr for v in r]
                kl.append(sum(math.exp(a) * (a - b) for a, b in zip(p, q)))
    out = {"ll": ll, "acc": acc}
    if ref is not None:
        out["kl"] = kl
    return out


def per_task_acc(scores: dict, split: str) -> dict[str, float]:
    out = {}
    for t in split_tasks(scores, split):
        s = scores[split][t]
        hits = [1.0 if max(range(len(lp)), key=lambda j: lp[j]) == y else 0.0
                for y, lp in zip(s["y"], s["label_logprobs"])]
        out[t] = sum(hits) / len(hits)
    return out


def _logsumexp(v: list[float]) -> float:
    m = max(v)
    return m + math.log(sum(math.exp(x - m) for x in v))


def mcnemar(a: list[float], b: list[float]) -> dict:
    """Exact two-sided McNemar test on paired 0/1 outcomes: a right & b wrong vs the reverse."""
    n01 = sum(1 for x, y in zip(a, b) if x > y)
    n10 = sum(1 for x, y in zip(a, b) if x < y)
    n = n01 + n10
    if n == 0:
        return {"a_only": 0, "b_only": 0, "p": 1.0}
    k = min(n01, n10)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
    return {"a_only": n01, "b_only": n10, "p": p}


def _model_name(m: str, s: str, budget: str) -> str:
    return f"{m}_{s}_{budget.rstrip('%')}"


def run_screen(family: Path, base: Path, tasks_root: Path, calib: Path, heldout: Path, out: Path, *,
               methods: list[str], strategies: list[str], budgets: list[str], dev_per_class: dict[str, int],
               test_per_class: dict[str, int], seen: int, train_seed: int, heldout_seqs: int = 12,
               heldout_len: int = 128, test_budgets: list[str] | None = None, test_methods: list[str] | None = None,
               test_experts: bool = True, test_strategies: list[str] | None = None, n_boot: int = 2000,
               tasks: tuple[str, ...] | list[str] = TASKS, test_energy_budgets: list[str] | None = None) -> dict:
    """Per method, in order: the full read, the screen over budgets x strategies, then (for
    test_methods) test accuracy of the full read, energy and the screen's best strategy at
    test_budgets (or energy and `test_strategies`); the experts alone last. The JSON is
    rewritten after every model."""
    experts = {t: family / "experts" / t / "model" for t in tasks}
    work = family / "strategies"
    specs = strategy_specs(calib)
    screen = Screen(base, {t: tasks_root / t for t in tasks}, heldout, dev_per_class=dev_per_class,
                    test_per_class=test_per_class, seen=seen, train_seed=train_seed,
                    heldout_seqs=heldout_seqs, heldout_len=heldout_len)
    texts = json.loads((calib.parent / "texts.json").read_text()) if (calib.parent / "texts.json").exists() else {}
    result = {"family": family.as_posix(), "n": screen.n(), "bootstrap": {"resamples": n_boot, "seed": 0},
              "methods": {m: METHODS[m] for m in methods},
              "strategies": {s: {k: (Path(v).name if k == "text" else v) for k, v in specs[s].items()}
                             for s in strategies},
              "texts": texts, "seeds": 1, "train_seed": train_seed, "tasks": list(tasks), "rows": [], "between": [],
              "test": {"rule": "per method: best = the non-energy strategy with the highest mean dev "
                               "label-log-likelihood difference to the full read over the test budgets",
                       "best": {}, "rows": [], "experts": {}},
              "timings": []}
    screen.log = result["timings"]
    result["mergepipe"] = mergepipe_source()
    test_methods = methods if test_methods is None else test_methods
    if test_budgets and test_experts and all((work / "scores" / f"expert_{t}.json").exists() for t in experts):
        _test_experts(screen, result, work, experts, out)  # cached: report them first
    for m in methods:
        cfgs = {}
        for s in strategies:
            cfgs[s] = work / "configs" / f"{m}_{s}.yaml"
            write_config(cfgs[s], base=base, experts=experts, method=METHODS[m], strategy=specs[s],
                         cache_dir=work / "cache")
        full_dir = work / "models" / f"{m}_full"
        merge(cfgs["energy" if "energy" in cfgs else strategies[0]], "full", full_dir, result["timings"])
        full_sc = screen.score(full_dir, work / "scores" / f"{m}_full.json", ref_dir=None, test=False)
        full_ex = per_example(full_sc, "dev")
        result["rows"].append({"method": m, "strategy": "-", "budget": "full",
                               "dev_accuracy": _mean(full_ex["acc"]), "dev_label_ll": _mean(full_ex["ll"]),
                               "dev_per_task_accuracy": per_task_acc(full_sc, "dev")})
        _write(out, result)
        per: dict[tuple, dict] = {}
        for budget in budgets:
            for s in strategies:
                name = _model_name(m, s, budget)
                model_dir = work / "models" / name
                merge(cfgs[s], budget, model_dir, result["timings"])
                man = json.loads((model_dir / "manifest.json").read_text())
                sc = screen.score(model_dir, work / "scores" / f"{name}.json", ref_dir=full_dir, test=False)
                ex = per_example(sc, "dev", full_sc)
                ex["heldout_kl"] = sc["kl"]["per_sequence"]
                per[s, budget] = ex
                result["rows"].append({
                    "method": m, "strategy": s, "budget": budget,
                    "expert_bytes_read": man["bytes"]["expert_bytes_read"],
                    "total_expert_bytes": man["bytes"]["total_expert_bytes"],
                    "read_by_expert": man["bytes"].get("expert_bytes_read_by_expert"),
                    "bound": man.get("bound"),
                    "dev_accuracy": _mean(ex["acc"]), "dev_label_ll": _mean(ex["ll"]),
                    "d_dev_label_ll": paired(ex["ll"], full_ex["ll"], n_boot=n_boot),
                    "d_dev_accuracy": paired(ex["acc"], full_ex["acc"], n_boot=n_boot),
                    "dev_label_kl": paired(ex["kl"], n_boot=n_boot),
                    "heldout_kl": paired(ex["heldout_kl"], n_boot=n_boot),
                    "dev_per_task_accuracy": per_task_acc(sc, "dev"),
                })
                print(json.dumps({k: result["rows"][-1][k] for k in ("method", "strategy", "budget",
                                                                     "dev_label_ll")}
                                 | {"heldout_kl": result["rows"][-1]["heldout_kl"]["mean"]}), flush=True)
                _write(out, result)
            for s in strategies:
                if s == "energy" or "energy" not in strategies:
                    continue
                a, b = per[s, budget], per["energy", budget]
                result["between"].append({
                    "method": m, "budget": budget, "a": s, "b": "energy",
                    "d_dev_label_ll": paired(a["ll"], b["ll"], n_boot=n_boot),
                    "d_dev_accuracy": paired(a["acc"], b["acc"], n_boot=n_boot),
                    "d_heldout_kl": paired(a["heldout_kl"], b["heldout_kl"], n_boot=n_boot),
                })
            _write(out, result)
        if test_budgets and m in test_methods:
            run_test(screen, result, work, full_dir, m, budgets=test_budgets, n_boot=n_boot, out=out,
                     chosen=test_strategies, energy_budgets=test_energy_budgets)
    if test_budgets and test_experts:
        _test_experts(screen, result, work, experts, out)
    _write(out, result)
    return result


def _test_experts(screen: Screen, result: dict, work: Path, experts: dict[str, Path], out: Path) -> None:
    for t, d in experts.items():
        sc = screen.score(d, work / "scores" / f"expert_{t}.json", ref_dir=None, test=True)
        ex = per_example(sc, "test")
        result["test"]["experts"][t] = {"accuracy": _mean(ex["acc"]), "per_task": per_task_acc(sc, "test"),
                                        "n": len(ex["acc"])}
        _write(out, result)


def best_strategy(result: dict, budgets: list[str], method: str | None = None) -> str | None:
    """The non-energy strategy with the highest mean dev label-log-likelihood difference to
    the full read over the given budgets (and `method`, else every method); it must have them all."""
    scores: dict[str, list[float]] = {}
    for r in result["rows"]:
        if (r["strategy"] not in ("-", "energy") and r["budget"] in budgets
                and (method is None or r["method"] == method)):
            scores.setdefault(r["strategy"], []).append(r["d_dev_label_ll"]["mean"])
    need = (1 if method else len(result["methods"])) * len(budgets)
    full = {s: sum(v) / len(v) for s, v in scores.items() if len(v) == need}
    return max(full, key=full.get) if full else None


def run_test(screen: Screen, result: dict, work: Path, full_dir: Path, m: str, *, budgets: list[str],
             n_boot: int, out: Path, chosen: list[str] | None = None,
             energy_budgets: list[str] | None = None) -> None:
    """Test accuracy of method m's full read, energy and the screen's best strategy (or the
    `chosen` ones, each also against energy) at `budgets`; energy only at `energy_budgets`
    when given (the others then have no `- energy` row there)."""
    test = result["test"]
    best = best_strategy(result, budgets, m)
    test["best"][m] = best
    others = [s for s in chosen if s != "energy"] if chosen else ([best] if best else [])
    if chosen:
        test.setdefault("chosen", {})[m] = others
    strategies = ["energy"] + others
    fs = screen.score(full_dir, work / "scores" / f"{m}_full.json", ref_dir=None, test=True)
    full_ex = per_example(fs, "test")
    test["rows"].append({"method": m, "strategy": "-", "budget": "full", "accuracy": _mean(full_ex["acc"]),
                         "per_task": per_task_acc(fs, "test"), "n": len(full_ex["acc"])})
    _write(out, result)
    for budget in budgets:
        exs = {}
        with_energy = energy_budgets is None or budget in energy_budgets
        for s in strategies if with_energy else others:
            name = _model_name(m, s, budget)
            sc = screen.score(work / "models" / name, work / "scores" / f"{name}.json", ref_dir=full_dir,
                              test=True)
            exs[s] = ex = per_example(sc, "test")
            test["rows"].append({"method": m, "strategy": s, "budget": budget, "accuracy": _mean(ex["acc"]),
                                 "per_task": per_task_acc(sc, "test"), "n": len(ex["acc"]),
                                 "d_accuracy": paired(ex["acc"], full_ex["acc"], n_boot=n_boot),
                                 "mcnemar_vs_full": mcnemar(ex["acc"], full_ex["acc"])})
            _write(out, result)
        for s in others if with_energy else []:
            a, b = exs[s]["acc"], exs["energy"]["acc"]
            test["rows"].append({"method": m, "strategy": f"{s} - energy", "budget": budget,
                                 "d_accuracy": paired(a, b, n_boot=n_boot), "mcnemar": mcnemar(a, b)})
            _write(out, result)


def _mean(x: list[float]) -> float:
    return sum(x) / len(x)


def _write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)


def merge_results(results: list[dict]) -> dict:
    """Several screen invocations' JSON as one (same family, examples and bootstrap): rows keyed
    by (method, strategy, budget), comparisons with energy by (method, budget, strategy), test rows
    by (method, strategy, budget); a later file's entry replaces an earlier one in place, new
    ones are appended in order. Methods, strategies, the test's best/chosen and experts merged."""
    first = results[0]
    for r in results[1:]:
        if (Path(r["family"]).resolve(), r["n"], r["bootstrap"]) != \
                (Path(first["family"]).resolve(), first["n"], first["bootstrap"]):
            raise ValueError(f"results of another family, example set or bootstrap: {r['family']}")

    def keyed(lists, key):
        out: dict = {}
        for rows in lists:
            for row in rows:
                out[key(row)] = row
        return list(out.values())

    merged = {k: first[k] for k in ("family", "n", "bootstrap", "texts", "seeds")}
    merged.update({k: first[k] for k in ("train_seed", "tasks", "mergepipe") if k in first})
    merged["methods"] = {m: spec for r in results for m, spec in r["methods"].items()}
    merged["strategies"] = {s: spec for r in results for s, spec in r["strategies"].items()}
    merged["rows"] = keyed([r["rows"] for r in results], lambda x: (x["method"], x["strategy"], x["budget"]))
    merged["between"] = keyed([r["between"] for r in results], lambda x: (x["method"], x["budget"], x["a"]))
    tests = [r["test"] for r in results]
    merged["test"] = {"rule": first["test"]["rule"],
                      "best": {m: b for t in tests for m, b in t["best"].items()},
                      "rows": keyed([t["rows"] for t in tests], lambda x: (x["method"], x["strategy"], x["budget"])),
                      "experts": {e: v for t in tests for e, v in t["experts"].items()}}
    chosen = {m: c for t in tests for m, c in t.get("chosen", {}).items()}
    if chosen:
        merged["test"]["chosen"] = chosen
    merged["timings"] = [x for r in results for x in r["timings"]]
    # each invocation's own log (its methods, mergepipe, timings): the report times them apart
    merged["invocations"] = [{"methods": list(r["methods"]), "mergepipe": r.get("mergepipe"),
                              "timings": r["timings"]} for r in results]
    return merged


# ---- report: EVAL.md section and plot -------------------------------------------------------

BEGIN = "<!-- smollm-strategy-screen: generated by `python -m mergepipe_eval smollm-strategy-report`; begin -->"
END = "<!-- smollm-strategy-screen: end -->"


def _ci(d: dict, scale: float = 1.0, digits: int = 2, fmt: str = "f") -> str:
    return (f"{d['mean'] * scale:+.{digits}{fmt}} [{d['lo'] * scale:+.{digits}{fmt}}, "
            f"{d['hi'] * scale:+.{digits}{fmt}}]")


def _kl(d: dict) -> str:
    return f"{d['mean']:.2e} [{d['lo']:.2e}, {d['hi']:.2e}]"


def to_markdown(result: dict) -> str:
    n = result["n"]
    tasks = list(n["test"])
    ndev, ntest = sum(n["dev"].values()), sum(n["test"].values())
    h = n["heldout"]
    lines = [f"Screen: {ndev} dev examples ({', '.join(f'{t} {k}' for t, k in n['dev'].items())}; train "
             f"examples no expert saw), {h['sequences']} held-out sequences of {h['tokens_per_sequence']} tokens; "
             f"one fine-tuning seed. Δ against the same method's full read, paired; 95% intervals from a paired "
             f"bootstrap ({result['bootstrap']['resamples']} resamples, seed 0) over dev examples (log-lik, "
             "accuracy) or held-out sequences (KL).", "",
             "| method | strategy | budget | read MiB | dev acc | Δ dev label log-lik (nats) | Δ dev acc (points) "
             "| KL(full ‖ budgeted), held-out text (nats/token) |",
             "|---|---|---|---:|---:|---|---|---|"]
    for r in result["rows"]:
        if r["budget"] == "full":
            lines.append(f"| {r['method']} | (any) | full | all* | {100 * r['dev_accuracy']:.1f} "
                         f"| (label log-lik {r['dev_label_ll']:.3f}) | – | 0 |")
            continue
        lines.append(f"| {r['method']} | {r['strategy']} | {r['budget']} | {r['expert_bytes_read'] / 2**20:.0f} | "
                     f"{100 * r['dev_accuracy']:.1f} | {_ci(r['d_dev_label_ll'], 1, 3)} | "
                     f"{_ci(r['d_dev_accuracy'], 100, 1)} | {_kl(r['heldout_kl'])} |")
    lines += ["", "\\* every expert byte. Strategy against energy at the same method and budget (paired; positive "
              "Δ log-lik / Δ acc and negative Δ KL favour the strategy):", "",
              "| method | budget | strategy − energy | Δ dev label log-lik (nats) | Δ dev acc (points) "
              "| Δ held-out KL (nats/token) |", "|---|---|---|---|---|---|"]
    for b in result["between"]:
        lines.append(f"| {b['method']} | {b['budget']} | {b['a']} − energy | {_ci(b['d_dev_label_ll'], 1, 3)} | "
                     f"{_ci(b['d_dev_accuracy'], 100, 1)} | {_ci(b['d_heldout_kl'], 1, 2, 'e')} |")
    t = result.get("test")
    if t and (t["rows"] or t["experts"]):
        lines += ["", f"Test accuracy ({ntest} test examples: "
                  f"{', '.join(f'{k} {v}' for k, v in n['test'].items())}; the SmolLM2 table's examples). "
                  "Best strategy by the screen: "
                  f"{', '.join(f'**{v}** ({k})' for k, v in t['best'].items())} ({t['rule']})"
                  + ("; tested besides energy (`--test-strategies`): "
                     + "; ".join(f"{', '.join(v)} ({k})" for k, v in t["chosen"].items()) if t.get("chosen") else "")
                  + ". Δ against the full read (or "
                  "energy), paired bootstrap 95% interval; McNemar exact p from the discordant pairs.", "",
                  f"| method | strategy | budget | accuracy | {' | '.join(tasks)} | Δ acc (points) | McNemar "
                  "(only this / only other, p) |", f"|---|---|---|---:|{'---:|' * len(tasks)}---|---|"]
        for r in t["rows"]:
            pt = r.get("per_task")
            cells = " | ".join(f"{100 * pt[k]:.1f}" for k in tasks) if pt else " | ".join("–" for _ in tasks)
            acc = f"{100 * r['accuracy']:.1f}" if "accuracy" in r else "–"
            d = _ci(r["d_accuracy"], 100, 1) if "d_accuracy" in r else "–"
            mc = r.get("mcnemar_vs_full") or r.get("mcnemar")
            mcs = f"{mc['a_only']} / {mc['b_only']}, p={mc['p']:.2g}" if mc else "–"
            lines.append(f"| {r['method']} | {r['strategy']} | {r['budget']} | {acc} | {cells} | {d} | {mcs} |")
        for name, e in t["experts"].items():
            cells = " | ".join(f"{100 * e['per_task'][k]:.1f}" for k in tasks)
            lines.append(f"| expert {name} alone | – | – | {100 * e['accuracy']:.1f} | {cells} | – | – |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = list(result["methods"])
    strategies = list(result["strategies"])
    fig, axes = plt.subplots(2, len(methods), figsize=(6 * len(methods), 7.5), squeeze=False)
    for col, m in enumerate(methods):
        for s in strategies:
            rows = sorted((r for r in result["rows"] if r["method"] == m and r["strategy"] == s),
                          key=lambda r: float(r["budget"].rstrip("%")))
            if not rows:
                continue
            xs = [float(r["budget"].rstrip("%")) for r in rows]
            for i, key in enumerate(("heldout_kl", "d_dev_label_ll")):
                ys = [r[key]["mean"] for r in rows]
                err = [[r[key]["mean"] - r[key]["lo"] for r in rows], [r[key]["hi"] - r[key]["mean"] for r in rows]]
                axes[i][col].errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=s)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"SmolLM2 {m}: KL(full || budgeted), held-out text (nats/token)")
        axes[1][col].set_title(f"SmolLM2 {m}: dev label log-lik − full read (nats)")
        axes[1][col].axhline(0, color="gray", ls=":")
        for ax in axes[:, col]:
            ax.set_xlabel("budget (% of the expert bytes)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def render_section(result: dict, notes: str = "", plot_name: str | None = None) -> str:
    figure = [f"![SmolLM2: KL and dev log-likelihood against the full read, per strategy]({plot_name})", ""] \
        if plot_name else []
    return "\n".join([BEGIN, "", "# Plan strategies on SmolLM2-135M (issue 12): energy vs calibrated vs balanced "
                      "vs compensated, and vocabulary blocks", "", notes.strip(), "", *figure,
                      "## Tables (SmolLM2 strategy screen)", "",
                      to_markdown(result).rstrip("\n"), "", END]) + "\n"


def splice(markdown: Path, section: str) -> None:
    """Replace this section of `markdown` (between BEGIN and END), or append it."""
    from mergepipe_eval.report import splice_between
    splice_between(markdown, section, BEGIN, END)
