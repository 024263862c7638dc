"""The paired statistics of the strategy screen (mergepipe_eval/strategies.py, issue 12)."""
from __future__ import annotations

import math

from mergepipe_eval import strategies as st


def _scores(shift: float) -> dict:
    out = {}
    for i, t in enumerate(st.TASKS):
        rows = []
        for j in range(6):
            logits = [0.3 * j, -0.2 * i + shift * (j % 2), 0.1]
            z = math.log(sum(math.exp(v) for v in logits))
            rows.append([v - z for v in logits])
        out[t] = {"y": [j % 3 for j in range(6)], "logprobs": rows}
    return out


def test_per_example_kl_is_zero_against_itself_and_positive_otherwise():
    a, b = _scores(0.0), _scores(1.5)
    same = st.per_example(a, a)
    assert len(same["ll"]) == len(same["kl"]) == 6 * len(st.TASKS)
    assert max(abs(x) for x in same["kl"]) < 1e-12
    other = st.per_example(b, a)
    assert min(other["kl"]) >= -1e-12 and max(other["kl"]) > 0.01
    assert other["acc"] != same["acc"] or other["ll"] != same["ll"]


def test_paired_interval_brackets_the_mean_and_is_deterministic():
    a = [float(i % 7) for i in range(200)]
    b = [float((i * 3) % 5) for i in range(200)]
    d = st.paired(a, b, n_boot=500)
    assert d["lo"] <= d["mean"] <= d["hi"] and d["n"] == 200
    assert d == st.paired(a, b, n_boot=500)
    zero = st.paired(a, a, n_boot=200)
    assert zero == {"mean": 0.0, "lo": 0.0, "hi": 0.0, "n": 200}


def test_section_is_spliced_in_place(tmp_path):
    md = tmp_path / "EVAL.md"
    md.write_text("# EVAL\n\nbody\n")
    result = {"n_examples": 0, "bootstrap": {"resamples": 10}, "rows": [], "between": []}
    st.splice(md, st.render_section([("Seed 0", result)], "first notes"))
    once = md.read_text()
    assert once.startswith("# EVAL\n\nbody\n") and "first notes" in once and once.count(st.BEGIN) == 1
    st.splice(md, st.render_section([("Seed 0", result)], "second notes"))
    twice = md.read_text()
    assert "second notes" in twice and "first notes" not in twice and twice.count(st.END) == 1
