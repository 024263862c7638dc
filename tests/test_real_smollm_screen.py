"""Issue 12's SmolLM2 strategy screen, the parts that need no model (fast).

- the dev split is exactly the train examples train_expert never drew;
- the calibration and held-out texts share nothing with any task split, nor each other;
- McNemar's exact p, the per-example label statistics, the "best strategy" rule;
- configs name the calibration text relative to themselves.
"""
from __future__ import annotations

import math

import pytest
import torch
import yaml

from mergepipe_eval import smollm_screen as ss


def test_unseen_matches_train_order():
    n, seen = 50, 16
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(n, generator=gen).tolist()  # what smollm.train_expert draws
    unseen = ss.unseen_train_indices(n, seen, 0)
    assert unseen == set(order[seen:])
    assert not unseen & set(order[:seen])
    assert ss.unseen_train_indices(10, 11, 0) == set()


def test_mcnemar():
    assert ss.mcnemar([1, 1, 0], [1, 1, 0]) == {"a_only": 0, "b_only": 0, "p": 1.0}
    r = ss.mcnemar([1] * 8 + [0] * 2, [0] * 8 + [1] * 2)
    assert (r["a_only"], r["b_only"]) == (8, 2)
    assert r["p"] == pytest.approx(2 * sum(math.comb(10, i) for i in range(3)) / 2 ** 10)


def _scores(lps):
    return {"dev": {t: {"y": [0, 1], "label_logprobs": lps} for t in ss.TASKS}}


def test_per_example_and_kl():
    a = _scores([[-0.1, -3.0], [-2.0, -0.5]])
    ex = ss.per_example(a, "dev", a)
    assert ex["acc"] == [1.0, 1.0] * 3
    assert all(abs(k) < 1e-12 for k in ex["kl"])
    b = _scores([[-3.0, -0.1], [-2.0, -0.5]])
    ex = ss.per_example(b, "dev", a)
    assert ex["acc"] == [0.0, 1.0] * 3
    assert ex["kl"][0] > 0 and abs(ex["kl"][1]) < 1e-12
    # label log-likelihood is normalised over the labels
    z = math.log(math.exp(-3.0) + math.exp(-0.1))
    assert ex["ll"][0] == pytest.approx(-3.0 - z)


def test_best_strategy_needs_every_cell():
    rows = [{"strategy": s, "budget": b, "d_dev_label_ll": {"mean": v}}
            for s, b, v in (("energy", "10%", -1.0), ("calibrated", "10%", -0.2), ("calibrated", "25%", -0.1),
                            ("balanced", "10%", -0.05))]
    res = {"methods": {"ta_l1.0": {}}, "rows": rows}
    assert ss.best_strategy(res, ["10%", "25%"]) == "calibrated"  # balanced lacks 25%
    assert ss.best_strategy(res, ["10%"]) == "balanced"


def test_config_text_relative(tmp_path):
    cfg = tmp_path / "w" / "configs" / "c.yaml"
    text = tmp_path / "calib" / "calib.txt"
    ss.write_config(cfg, base=tmp_path / "base", experts={"a": tmp_path / "e"},
                    method=ss.METHODS["ta_l1.0"], strategy=ss.strategy_specs(text)["calibrated"],
                    cache_dir=tmp_path / "w" / "cache")
    d = yaml.safe_load(cfg.read_text())
    assert d["plan"]["strategy"] == "calibrated" and d["plan"]["shares"] == "none"
    assert (cfg.parent / d["plan"]["text"]).resolve() == text.resolve()
    ss.write_config(cfg, base=tmp_path / "base", experts={"a": tmp_path / "e"},
                    method=ss.METHODS["ta_l1.0"], strategy={}, cache_dir=tmp_path / "w" / "cache")
    assert "plan" not in yaml.safe_load(cfg.read_text())


def test_config_vocabulary_blocks_go_top_level(tmp_path):
    cfg = tmp_path / "w" / "configs" / "c.yaml"
    for name in ("energy_emb64k", "calibrated_emb64k_v10"):
        ss.write_config(cfg, base=tmp_path / "base", experts={"a": tmp_path / "e"},
                        method=ss.METHODS["ta_l1.0"], strategy=ss.strategy_specs(tmp_path / "c.txt")[name],
                        cache_dir=tmp_path / "w" / "cache")
        d = yaml.safe_load(cfg.read_text())
        assert d["embedding_block_bytes"] == "64KiB" and "embedding_block_bytes" not in d.get("plan", {})
    assert d["plan"]["vocabulary_share"] == 0.1
    ss.write_config(cfg, base=tmp_path / "base", experts={"a": tmp_path / "e"}, method=ss.METHODS["ta_l1.0"],
                    strategy=ss.strategy_specs(tmp_path / "c.txt")["energy_emb64k"], cache_dir=tmp_path / "w" / "cache")
    assert "plan" not in yaml.safe_load(cfg.read_text())


def test_merge_results_later_rows_replace():
    def res(rows, test_rows, chosen=None):
        t = {"rule": "r", "best": {"ta_l1.0": "calibrated"}, "rows": test_rows, "experts": {}}
        if chosen:
            t["chosen"] = chosen
        return {"family": "f", "n": {"dev": 1}, "bootstrap": {"resamples": 10, "seed": 0}, "texts": {}, "seeds": 1,
                "methods": {"ta_l1.0": {}}, "strategies": {"energy": {}}, "rows": rows, "between": [],
                "test": t, "timings": [1]}
    row = lambda s, b, v: {"method": "ta_l1.0", "strategy": s, "budget": b, "v": v}  # noqa: E731
    a = res([row("energy", "25%", 1), row("calibrated", "25%", 2)], [row("energy", "25%", 5)])
    b = res([row("calibrated", "25%", 3), row("energy_emb64k", "25%", 4)], [row("x", "25%", 6)],
            chosen={"ta_l1.0": ["x"]})
    m = ss.merge_results([a, b])
    assert [(r["strategy"], r["v"]) for r in m["rows"]] == [("energy", 1), ("calibrated", 3), ("energy_emb64k", 4)]
    assert [r["v"] for r in m["test"]["rows"]] == [5, 6] and m["test"]["chosen"] == {"ta_l1.0": ["x"]}
    assert m["timings"] == [1, 1]
    with pytest.raises(ValueError, match="another family"):
        ss.merge_results([a, {**b, "family": "g"}])


def test_calibration_text_disjoint(tmp_path):
    from mergepipe_eval import calib
    from mergepipe_eval.tasks import FORTUNES_DIR, WORDNET_DIR, Sizes, write_task
    if not (WORDNET_DIR / "data.noun").exists() or not (FORTUNES_DIR / "art").exists():
        pytest.skip("Debian fortunes / wordnet-base not installed")
    sizes = {"noun_cat": Sizes(250, 80), "verb_cat": Sizes(250, 80), "pos": Sizes(250, 120),
             "shuffled": Sizes(500, 240), "topic": Sizes(300, 120)}
    for t, s in sizes.items():
        write_task(t, tmp_path / "tasks" / t, s)
    info = calib.write(tmp_path / "tasks", tmp_path / "out", target_chars=20_000)
    texts = {k: (tmp_path / "out" / f"{k}.txt").read_text() for k in ("calib", "heldout")}
    assert info["calib"]["chars"] >= 20_000 and info["heldout"]["chars"] >= 20_000
    used = calib.split_texts(tmp_path / "tasks")
    calib.check_disjoint(texts, used)  # raises on overlap
    for k, text in texts.items():
        for p in text.split("\n\n"):
            assert p.strip() not in used, k
    with pytest.raises(ValueError):
        calib.check_disjoint({"calib": texts["calib"] + "\n\n" + sorted(used)[0], "heldout": "x"}, used)
