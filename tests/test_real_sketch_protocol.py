"""EVAL.md's tables for issue 12's SmolLM2 protocol (sketch_protocol.py), from synthetic screen
results: per-seed tables with every task's column, the mean over seeds, targets with their
margins, generated findings and timings; the section splices into the sketch section."""
from __future__ import annotations

import json

from mergepipe_eval import sketch_protocol as sp
from mergepipe_eval import sketch_report as sr
from mergepipe_eval import smollm_seeds as sd

TASKS = ["noun_cat", "pos", "topic", "verb_cat"]


def _ci(mean):
    return {"mean": mean, "lo": mean - 0.02, "hi": mean + 0.02, "n": 8}


def _seed_result(seed):
    n = {"dev": {t: 2 for t in TASKS}, "test": {t: 2 for t in TASKS},
         "heldout": {"sequences": 2, "tokens_per_sequence": 4}}
    per_task = {t: 0.5 for t in TASKS}
    rows = [{"method": "ta_l1.0", "strategy": "-", "budget": "full", "dev_accuracy": 0.6, "dev_label_ll": -0.5}]
    test = [{"method": "ta_l1.0", "strategy": "-", "budget": "full", "accuracy": 0.75, "per_task": per_task, "n": 8}]
    for s, b, d in (("energy", "25%", -0.25), ("sketch", "25%", 0.0), ("sketch", "10%", -0.125)):
        rows.append({"method": "ta_l1.0", "strategy": s, "budget": b, "dev_accuracy": 0.5,
                     "d_dev_label_ll": _ci(-0.1), "heldout_kl": _ci(0.3 if s == "energy" else 0.03)})
        test.append({"method": "ta_l1.0", "strategy": s, "budget": b, "accuracy": 0.75 + d, "per_task": per_task,
                     "n": 8, "d_accuracy": _ci(d), "mcnemar_vs_full": {"a_only": 1, "b_only": 2, "p": 1.0}})
    test.append({"method": "ta_l1.0", "strategy": "sketch - energy", "budget": "25%", "d_accuracy": _ci(0.25),
                 "mcnemar": {"a_only": 2, "b_only": 0, "p": 0.5}})
    return {"family": f"fam/s{seed}", "train_seed": seed, "tasks": TASKS, "n": n,
            "bootstrap": {"resamples": 10, "seed": 0}, "texts": {}, "seeds": 1, "methods": {"ta_l1.0": {}},
            "strategies": {"energy": {}, "sketch": {}}, "rows": rows, "between": [],
            "test": {"rule": "r", "best": {}, "rows": test,
                     "experts": {t: {"accuracy": 0.55, "per_task": per_task, "n": 8} for t in TASKS} if seed == 0
                     else {}},
            "timings": [{"merge": "ta_l1.0_sketch_25", "seconds": 12.0},
                        {"score": "ta_l1.0_sketch_25", "seconds": 100.0, "what": ["dev", "test", "kl"]}]}


def _mean(per_seed):
    acc = {"ta_l1.0_full": [1, 1, 1, 0], "ta_l1.0_energy_25": [1, 0, 0, 0], "ta_l1.0_sketch_25": [1, 1, 1, 0],
           "ta_l1.0_sketch_10": [1, 1, 0, 1]}

    def load(fam, name):
        if name not in acc:
            return None
        return {"dev": {"t": {"y": [0], "label_logprobs": [[-0.1, -5.0]]}},
                "test": {"t": {"y": [0] * 4, "label_logprobs": [[0.0, -1.0] if a else [-1.0, 0.0]
                                                               for a in acc[name]]}},
                "kl": {"per_sequence": [0.1, 0.2]}}
    return sd.across_seeds(per_seed, methods=["ta_l1.0"], strategies=["energy", "sketch"],
                           budgets=["25%", "10%", "50%"], n_boot=20, load=load)


def test_protocol_section_renders_and_splices(tmp_path):
    per_seed = [_seed_result(0), _seed_result(1)]
    mean = json.loads(json.dumps(_mean(per_seed)))  # as read back from the committed JSON
    text = "\n".join(sp.section(per_seed, mean))
    assert "| noun_cat | pos | topic | verb_cat |" in text  # every task's column
    assert "| ta_l1.0 | 25% | energy | Δ ≥ -2 points vs full | -50.0 | -48.0 | **missed** | no |" in text
    assert "| ta_l1.0 | 25% | sketch | Δ ≥ -2 points vs full | +0.0 | +2.0 | met | yes |" in text
    assert "≥ best single expert (noun_cat, 55.0; seed 0)" in text
    assert "Targets, `energy` (mean over seeds): 0 of 1 met; missed: ta_l1.0 25% by 48.0 points" in text
    assert "sketch − energy, ta_l1.0 at 25%: +50.0" in text
    assert "sketch merges 12-12 s (n=1)" in text and "### Seed 1" in text
    md = tmp_path / "EVAL.md"
    md.write_text("# before\n")
    for _ in range(2):
        sr.splice_section(md, sr.render([], [], None, "notes", "p.png", per_seed, mean))
    out = md.read_text()
    assert out.count(sr.BEGIN) == 1 and "issue 12 protocol: 4 tasks" in out
    sr.plot([], None, tmp_path / "p.png", mean)
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_committed_protocol_results_render(tmp_path):
    """The committed protocol results (per seed and the mean) render without a typed number."""
    from pathlib import Path
    import pytest
    res = Path(__file__).resolve().parent.parent / "workflows" / "real" / "results"
    from mergepipe_eval import smollm_screen as ss
    by_family: dict = {}  # each seed's main screen, then its extra runs (config sketch_protocol.extra_runs)
    for p in [*sorted(res.glob("strategies_smollm4_sketch_s[0-9].json")),
              *sorted(res.glob("strategies_smollm4_sketch_*_s[0-9].json"))]:
        r = json.loads(p.read_text())
        by_family.setdefault(r["family"], []).append(r)
    per_seed = [ss.merge_results(v) if len(v) > 1 else v[0] for v in by_family.values()]
    mean_path = res / "strategies_smollm4_sketch_seeds.json"
    if not per_seed or not mean_path.exists():
        pytest.skip("protocol results not committed yet")
    mean = json.loads(mean_path.read_text())
    text = "\n".join(sp.section(per_seed, mean))
    assert "### Targets" in text and "### Seed 0" in text
    assert all(r["method"] in text for r in mean["rows"])


def test_extra_run_merges_into_its_seed():
    """A later invocation for another method (config sketch_protocol.extra_runs) merges into its
    seed's main result: its rows join the mean and the targets, the experts it scored for seed 1
    join seed 0's in the 10% target, and the timings are listed per invocation."""
    from mergepipe_eval import smollm_screen as ss
    per_seed = []
    for seed in (0, 1):
        main = _seed_result(seed)
        extra = json.loads(json.dumps(main).replace("ta_l1.0", "ta_l0.5"))
        extra["methods"] = {"ta_l0.5": {}}
        extra["test"]["experts"] = ({t: {"accuracy": 0.65, "per_task": {k: 0.5 for k in TASKS}, "n": 8} for t in TASKS}
                                    if seed else {})
        per_seed.append(ss.merge_results([main, extra]))
    assert [p["methods"] for p in per_seed[1]["invocations"]] == [["ta_l1.0"], ["ta_l0.5"]]
    assert {r["method"] for r in per_seed[0]["rows"]} == {"ta_l1.0", "ta_l0.5"}
    acc = {"full": [1, 1, 1, 0], "energy_25": [1, 0, 0, 0], "sketch_25": [1, 1, 1, 0], "sketch_10": [1, 1, 0, 1]}

    def load(fam, name):
        key = name.split("_", 2)[-1]
        if key not in acc:
            return None
        return {"dev": {"t": {"y": [0], "label_logprobs": [[-0.1, -5.0]]}},
                "test": {"t": {"y": [0] * 4, "label_logprobs": [[0.0, -1.0] if a else [-1.0, 0.0]
                                                               for a in acc[key]]}},
                "kl": {"per_sequence": [0.1, 0.2]}}
    mean = json.loads(json.dumps(sd.across_seeds(per_seed, methods=["ta_l0.5", "ta_l1.0"],
                                                 strategies=["energy", "sketch"], budgets=["25%", "10%"],
                                                 n_boot=20, load=load)))
    assert {t["method"] for t in mean["targets"]} == {"ta_l0.5", "ta_l1.0"}
    ten = [t for t in mean["targets"] if t["budget"] == "10%"]
    assert all(t["expert_seeds"] == ["0", "1"] and abs(t["target"] - 60.0) < 1e-9 for t in ten)
    text = "\n".join(sp.section(per_seed, mean))
    assert "≥ best single expert (noun_cat, 60.0; seeds 0, 1)" in text
    assert "seed 1, screen of ta_l0.5," in text and "seed 0, screen of ta_l1.0," in text


def test_keep_rows_whose_caches_are_gone():
    """smollm-strategy-seeds --keep: a method whose score caches are gone keeps its rows from an
    earlier mean of the same families; the targets come out as before; another family set fails."""
    import pytest
    per_seed = [_seed_result(0), _seed_result(1)]
    previous = json.loads(json.dumps(_mean(per_seed)))
    gone = sd.across_seeds(per_seed, methods=["ta_l1.0"], strategies=["energy", "sketch"], budgets=["25%"],
                           n_boot=20, load=lambda fam, name: None)
    assert gone["rows"] == [] and gone["targets"] == []
    kept = sd.keep_from(gone, previous, ["ta_l0.5", "ta_l1.0"])
    assert kept["kept"]["methods"] == ["ta_l1.0"] and kept["rows"] == previous["rows"]
    assert kept["targets"] == previous["targets"]
    with pytest.raises(ValueError, match="another set"):
        sd.keep_from(gone, {**previous, "families": ["x/s0", "x/s1"]}, ["ta_l1.0"])
