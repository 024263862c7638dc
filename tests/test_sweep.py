"""`mergepipe sweep`: one merge per budget, the deviation table, CSV and plot."""
from __future__ import annotations

import csv
import importlib.util

import pytest

from tests.helpers import write_config
from mergepipe.cli import main
from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError
from mergepipe.commands.pipeline import merge_plan, plan_config
from mergepipe.index.store import Store
from mergepipe.commands.sweep import deviation, require_matplotlib
from mergepipe.units import Budget, parse_budget_list


def _rows(path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {r["budget"]: r for r in csv.DictReader(f)}


def test_sweep_table_csv_and_plot(tmp_path, tiny_family, capsys):
    cfg = write_config(tmp_path, tiny_family)
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--budgets", "10%,50%", "-o", str(out), "-q"]) == 0
    assert "| 10% |" in capsys.readouterr().out
    for name in ("sweep.md", "sweep.csv", "sweep.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = _rows(out / "sweep.csv")
    assert list(rows) == ["10%", "50%", "full"]  # the full-budget reference is added last
    for r in rows.values():
        assert int(r["expert_bytes_read"]) <= int(r["budget_bytes"])
        assert r["restored"] == "False"
        assert (out / "models" / r["output"].rsplit("/", 1)[-1] / "manifest.json").is_file()
    full, half, tenth = rows["full"], rows["50%"], rows["10%"]
    assert float(full["deviation_update"]) == 0.0 and float(full["bound_relative"]) == 0.0
    assert 0 < float(half["deviation_update"]) < float(tenth["deviation_update"])
    assert float(tenth["deviation_weights"]) < float(tenth["deviation_update"])
    # task_arithmetic is additive: the plan's bound is certified, so it holds
    for r in (half, tenth):
        assert r["bound_kind"] == "certified"
        assert float(r["deviation_update"]) <= float(r["bound_relative"]) + 1e-9


def test_sweep_restores_a_merge_it_already_made(tmp_path, tiny_family):
    cfg = write_config(tmp_path, tiny_family)
    assert main(["sweep", str(cfg), "--budgets", "25%", "-o", str(tmp_path / "a"), "-q", "--no-plot"]) == 0
    assert main(["sweep", str(cfg), "--budgets", "25%", "-o", str(tmp_path / "b"), "-q", "--no-plot"]) == 0
    a, b = _rows(tmp_path / "a" / "sweep.csv"), _rows(tmp_path / "b" / "sweep.csv")
    assert all(r["restored"] == "True" for r in b.values())
    assert [r["plan_hash"] for r in a.values()] == [r["plan_hash"] for r in b.values()]
    assert [r["deviation_update"] for r in a.values()] == [r["deviation_update"] for r in b.values()]
    assert not (tmp_path / "b" / "sweep.png").exists()


def test_deviation_of_the_base_is_the_whole_update(tmp_path, tiny_family):
    cfg = load_config(write_config(tmp_path, tiny_family))
    store = Store(cfg.cache_dir)
    plan, inputs = plan_config(cfg, store, budget=Budget("full"))
    merge_plan(plan, inputs, tmp_path / "full", store)
    base = tiny_family["root"] / "base"
    same = deviation(tmp_path / "full", tmp_path / "full", base)
    assert same["diff_sq"] == 0 and same["relative_update"] == 0 and same["max_abs"] == 0
    # M = W0: ||W0 - M_full|| / ||M_full - W0|| = 1 (the base is stored unsharded, the merge mirrors it)
    whole = deviation(base, tmp_path / "full", base)
    assert whole["relative_update"] == pytest.approx(1.0, rel=1e-9)
    assert 0 < whole["relative_weights"] < 1


def test_budget_list_parsing():
    assert [str(b) for b in parse_budget_list("5%, 10%,5%,full,100%,0.5")] == ["5%", "10%", "full", "50%"]
    assert parse_budget_list(" , ") == []
    with pytest.raises(ConfigError):
        parse_budget_list("5%,lots")


def test_bad_budget_is_one_line_exit_2(tmp_path, tiny_family, capsys):
    cfg = write_config(tmp_path, tiny_family)
    assert main(["sweep", str(cfg), "--budgets", "5%,150%", "-o", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mergepipe: error: budget") and "\n" not in err
    assert not (tmp_path / "s").exists()


def test_missing_matplotlib_fails_before_merging(tmp_path, tiny_family, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ConfigError, match="--no-plot"):
        require_matplotlib()
    cfg = write_config(tmp_path, tiny_family)
    assert main(["sweep", str(cfg), "--budgets", "10%", "-o", str(tmp_path / "s")]) == 2
    assert "mergepipe[bench]" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
