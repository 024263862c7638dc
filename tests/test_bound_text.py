"""The bound's words (plan/bound_text.py): certified only for additive methods, a share of
the update, and nothing at all for a plan that left nothing out; the CLI prints those words."""
from __future__ import annotations

import subprocess
import sys

from mergepipe.plan.bound_text import bound_line
from tests.helpers import write_config


def test_each_kind_says_what_it_is():
    certified = bound_line({"kind": "certified", "omitted_mass": 1.5, "relative": 0.25})
    assert certified.startswith("certified bound") and "at most 1.5" in certified and "25.00%" in certified
    heuristic = bound_line({"kind": "heuristic", "omitted_mass": 13.7, "relative": 0.747})
    assert "74.70%" in heuristic and "no bound" in heuristic and "certified" not in heuristic
    assert bound_line({"kind": "heuristic", "omitted_mass": 0.0, "relative": 0.0}) is None


def _run(tmp_path, family, method, budget, params):
    cfg = write_config(tmp_path, family, method=method, budget=budget, parameters=params,
                       cache_dir=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "run", str(cfg)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_the_run_line_names_the_bound_only_where_something_was_left_out(tmp_path, tiny_family):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    full = _run(tmp_path / "a", tiny_family, "ties", "100%", {"density": 0.5})
    assert "bound" not in full and "left out" not in full
    ta = _run(tmp_path / "b", tiny_family, "task_arithmetic", "30%", {"lambda": 1.0})
    assert "certified bound: the weights differ from the full merge's by at most" in ta
    ties = _run(tmp_path / "c", tiny_family, "ties", "30%", {"density": 0.5})
    assert "this method is not linear in the deltas, so this is no bound" in ties and "certified" not in ties
