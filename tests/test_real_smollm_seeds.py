"""Issue 12's SmolLM2 protocol, the parts that need no model (fast): tasks beyond the default
three, the score cache noticing another example set, test scoring of energy at chosen budgets
only, the mean over fine-tuning seeds from the score caches, and the targets' margins."""
from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe_eval import smollm_screen as ss
from mergepipe_eval import smollm_seeds as sd


def _split(tasks, lps_by_task):
    return {t: {"y": [0] * len(lps_by_task[t]), "label_logprobs": lps_by_task[t]} for t in tasks}


def test_per_example_follows_the_tasks_in_the_scores():
    tasks = ["verb_cat", "topic", "noun_cat", "pos"]  # any insertion order
    lps = {"noun_cat": [[-0.1, -3.0]], "pos": [[-3.0, -0.1]], "topic": [[-0.1, -3.0]], "verb_cat": [[-3.0, -0.1]]}
    sc = {"test": _split(tasks, lps)}
    assert ss.split_tasks(sc, "test") == ["noun_cat", "pos", "topic", "verb_cat"]
    assert ss.per_example(sc, "test")["acc"] == [1.0, 0.0, 1.0, 0.0]
    assert ss.per_task_acc(sc, "test") == {"noun_cat": 1.0, "pos": 0.0, "topic": 1.0, "verb_cat": 0.0}


def test_cache_sizes_notice_another_example_set():
    cached = {"noun_cat": {"y": [0, 1]}, "pos": {"y": [0]}}
    assert ss._sizes(cached) == ss._sizes({"noun_cat": ([[1], [2]], [0, 1]), "pos": ([[3]], [0])})
    assert ss._sizes(cached) != ss._sizes({"noun_cat": ([[1]], [0]), "pos": ([[3]], [0])})
    assert ss._sizes(None) is None


class _FakeScreen:
    """Scores from a table instead of a model: name -> correctness per test example."""

    def __init__(self, table):
        self.table, self.scored = table, []

    def score(self, model_dir: Path, cache: Path, *, ref_dir, test):
        self.scored.append(model_dir.name)
        acc = self.table[model_dir.name]
        return {"test": {"t": {"y": [0] * len(acc), "label_logprobs": [[0.0, -1.0] if a else [-1.0, 0.0]
                                                                       for a in acc]}}}


def test_run_test_energy_only_at_chosen_budgets(tmp_path):
    table = {"ta_l1.0_full": [1, 1, 0, 1], "ta_l1.0_energy_25": [1, 0, 0, 1], "ta_l1.0_sketch_25": [1, 1, 0, 1],
             "ta_l1.0_sketch_10": [1, 1, 1, 1]}
    screen = _FakeScreen(table)
    result = {"rows": [], "methods": {"ta_l1.0": {}}, "test": {"best": {}, "rows": [], "experts": {}}}
    ss.run_test(screen, result, tmp_path, tmp_path / "ta_l1.0_full", "ta_l1.0", budgets=["25%", "10%"], n_boot=50,
                out=tmp_path / "r.json", chosen=["sketch"], energy_budgets=["25%"])
    assert screen.scored == ["ta_l1.0_full", "ta_l1.0_energy_25", "ta_l1.0_sketch_25", "ta_l1.0_sketch_10"]
    got = [(r["strategy"], r["budget"]) for r in result["test"]["rows"]]
    assert got == [("-", "full"), ("energy", "25%"), ("sketch", "25%"), ("sketch - energy", "25%"),
                   ("sketch", "10%")]
    assert result["test"]["rows"][3]["d_accuracy"]["mean"] == pytest.approx(0.25)


def _score(acc, ll, kl=None):
    """A score file: dev (label log-likelihoods) and test (correctness) over one task."""
    d = {"dev": {"t": {"y": [0] * len(ll), "label_logprobs": [[v, -50.0] for v in ll]}},
         "test": {"t": {"y": [0] * len(acc), "label_logprobs": [[0.0, -1.0] if a else [-1.0, 0.0] for a in acc]}}}
    if kl is not None:
        d["kl"] = {"per_sequence": kl}
    return d


def _result(family, seed, experts):
    return {"family": family, "train_seed": seed, "n": {"test": {"t": 4}}, "tasks": ["t"],
            "test": {"experts": {k: {"accuracy": v} for k, v in experts.items()}}}


def test_across_seeds_averages_examples_then_bootstraps():
    caches = {
        ("s0", "ta_l1.0_full"): _score([1, 1, 1, 0], [-0.1, -0.2]),
        ("s1", "ta_l1.0_full"): _score([1, 1, 0, 0], [-0.3]),
        ("s0", "ta_l1.0_energy_25"): _score([1, 0, 1, 0], [-0.5, -0.2], [0.4, 0.2]),
        ("s1", "ta_l1.0_energy_25"): _score([0, 1, 0, 0], [-0.4], [0.2, 0.2]),
        ("s0", "ta_l1.0_sketch_25"): _score([1, 1, 1, 0], [-0.1, -0.1], [0.1, 0.1]),
        ("s1", "ta_l1.0_sketch_25"): _score([1, 1, 0, 1], [-0.3], [0.1, 0.3]),
        ("s0", "ta_l1.0_sketch_10"): _score([1, 1, 1, 1], [-0.1, -0.1], [0.2, 0.2]),
        ("s1", "ta_l1.0_sketch_10"): _score([1, 1, 1, 1], [-0.1], [0.2, 0.2]),
    }
    caches[("s1", "ta_l1.0_sketch_10")].pop("test")  # seed 1 has no test score there: no test row
    res = sd.across_seeds([_result("s0", 0, {"a": 0.5, "b": 0.7}), _result("s1", 1, {"a": 0.6})],
                          methods=["ta_l1.0", "ties"], strategies=["energy", "sketch"], budgets=["25%", "10%"],
                          n_boot=200, load=lambda fam, name: caches.get((fam.as_posix(), name)))
    rows = {(r["strategy"], r["budget"]): r for r in res["rows"]}
    assert rows[("-", "full")]["accuracy"] == pytest.approx(0.625)
    assert rows[("-", "full")]["accuracy_per_seed"] == [0.75, 0.5]
    e, s = rows[("energy", "25%")], rows[("sketch", "25%")]
    assert e["accuracy"] == pytest.approx(0.375) and e["d_accuracy"]["mean"] == pytest.approx(-0.25)
    assert s["d_accuracy"]["mean"] == pytest.approx(0.125)
    assert e["heldout_kl"]["mean"] == pytest.approx(0.25)  # per-sequence means (0.3, 0.2), averaged
    assert e["d_dev_label_ll_pooled"]["n"] == 3  # dev examples differ per seed: pooled
    assert "accuracy" not in rows[("sketch", "10%")] and "heldout_kl" in rows[("sketch", "10%")]
    assert not any(r["method"] == "ties" for r in res["rows"])  # no scores: left out
    (b,) = res["between"]
    assert (b["a"], b["budget"]) == ("sketch", "25%") and b["d_accuracy"]["mean"] == pytest.approx(0.375)
    assert res["experts"]["a"] == {"per_seed": {"0": 0.5, "1": 0.6}, "mean": pytest.approx(0.55)}
    assert res["experts"]["b"]["mean"] == 0.7  # scored on seed 0 only
    (t_e, t_s) = res["targets"]
    assert (t_e["strategy"], t_e["kind"], t_e["met"]) == ("energy", "within", False)
    assert t_e["margin"] == pytest.approx(-25.0 + 2.0)
    assert t_s["met"] and t_s["margin"] == pytest.approx(12.5 + 2.0)


def test_targets_ten_percent_against_best_expert():
    res = {"rows": [{"method": "m", "strategy": "-", "budget": "full", "accuracy": 0.70},
                    {"method": "m", "strategy": "sketch", "budget": "10%", "accuracy": 0.68,
                     "d_accuracy": {"mean": -0.02, "lo": -0.05, "hi": 0.01}}],
           "experts": {"a": {"per_seed": {"0": 0.6}, "mean": 0.6}, "b": {"per_seed": {"0": 0.66}, "mean": 0.66}}}
    (t,) = sd.targets(res)
    assert t["expert"] == "b" and t["target"] == pytest.approx(66.0) and t["margin"] == pytest.approx(2.0)
    assert t["met"] and not t["met_lo"]  # the interval's lower end: 70 - 5 = 65 < 66


def test_label_scores_batched_by_length_keep_example_order(monkeypatch):
    import torch
    from mergepipe_eval import smollm

    def fake(model, prompts, pad_id):  # log p of token k = k-th id of the prompt, else -9
        out = torch.full((len(prompts), 4), -9.0)
        for r, p in enumerate(prompts):
            out[r, : min(4, len(p))] = torch.tensor(p[:4], dtype=torch.float32)
        return out

    monkeypatch.setattr(smollm, "_next_token_logprobs", fake)
    prompts = [[1, 2, 3, 4, 5], [2], [3, 3], [4, 1, 1], [5]]
    assert ss.by_length(prompts) == [1, 4, 2, 3, 0]
    screen = object.__new__(ss.Screen)
    screen.batch_size, screen.labels = 2, {"t": [0, 1]}
    screen.tok = type("T", (), {"pad_token_id": 0})()
    got = screen._label_scores(None, {"t": (prompts, [0, 1, 0, 1, 0])})["t"]
    assert got["label_logprobs"] == [[1.0, 2.0], [2.0, -9.0], [3.0, 3.0], [4.0, 1.0], [5.0, -9.0]]


def test_shared_prefix_leaves_a_token():
    assert ss.shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]]) == 3
    assert ss.shared_prefix([[1, 2], [1, 2, 3]]) == 1  # the shorter prompt keeps its last token
    assert ss.shared_prefix([[1], [1]]) == 0 and ss.shared_prefix([]) == 0


def test_prefix_cache_gives_the_plain_forward():
    """A tiny random Llama: continuing right-padded suffixes from the prefix's key/value cache
    gives the log-probs of the whole prompts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mergepipe_eval.smollm import _next_token_logprobs
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.eval()
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 7, 8, 12, 13, 14, 15]]
    k = ss.shared_prefix(prompts)
    assert k == 4
    with torch.no_grad():
        a = _next_token_logprobs(model, prompts, 0)
        b = ss.prefix_logprobs(model, prompts[0][:k], [p[k:] for p in prompts], 0)
    assert torch.allclose(a, b, atol=1e-5)
