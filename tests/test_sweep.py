"""`mergepipe sweep`: one merge per budget, the deviation table, CSV and plot."""
from __future__ import annotations

import csv
import importlib.util
import json
from itertools import combinations

import pytest

from tests.helpers import write_config
from mergepipe.cli import main
from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError
from mergepipe.commands.pipeline import merge_plan, plan_config
from mergepipe.index.store import Store
from mergepipe.commands.sweep import deviation, require_matplotlib, run_sweep, sweep_figure, to_markdown
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
    # a restore's time is not the merge's: none is known for b's merges, a's own are carried over
    assert all(r["computed_merge_seconds"] == "" for r in b.values())
    assert main(["sweep", str(cfg), "--budgets", "25%", "-o", str(tmp_path / "a"), "-q", "--no-plot"]) == 0
    again = _rows(tmp_path / "a" / "sweep.csv")
    assert all(r["restored"] == "True" for r in again.values())
    assert [r["computed_merge_seconds"] for r in again.values()] == [r["merge_seconds"] for r in a.values()]
    assert "(restored in " in (tmp_path / "a" / "sweep.md").read_text()


def _series(fig):
    """The deviation panel's three series (line + computed markers), in plot order."""
    return [line for line in fig.axes[0].lines if line.get_linestyle() != "None"]


def test_plot_x_is_every_byte_each_budget_reads(tmp_path, tiny_family):
    pytest.importorskip("matplotlib")
    cfg = load_config(write_config(tmp_path, tiny_family))
    result = run_sweep(cfg, parse_budget_list("5%,10%,25%,50%"), tmp_path / "s")
    fig = sweep_figure(result)
    ax = fig.axes[0]
    unit = ax.get_xlabel().rsplit("(", 1)[1].rstrip(")")
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    read = {}
    for row in result.rows:
        folder = tmp_path / "s" / "models" / row.output.rsplit("/", 1)[-1]
        b = json.loads((folder / "manifest.json").read_text())["bytes"]
        read[row.budget] = b["expert_bytes_read"] + b.get("sketch_bytes_read", 0)
    order = sorted(result.rows, key=lambda r: r.bytes_read)
    for line in _series(fig):
        assert [x * scale for x in line.get_xdata()] == pytest.approx([read[r.budget] for r in order], rel=1e-12)
    # the sketch budgets read sketches only: they sit apart, above 0, not both at 0
    assert 0 < read["5%"] < read["10%"] and sum(r.sketch_bytes_read for r in result.rows) > 0
    assert ax.get_xscale() == "log"  # 0.2 .. 3.6 MiB: more than a decade
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts]
    assert sorted(t.get_text() for t in ax.texts) == sorted(r.budget for r in result.rows)
    assert not [(a, b) for a, b in combinations(boxes, 2) if a.overlaps(b)]
    assert "sketch MiB read" in to_markdown(result)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_plot_draws_restored_merges_hollow_and_labelled(tmp_path, tiny_family):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba
    cfg = load_config(write_config(tmp_path, tiny_family))
    budgets = parse_budget_list("10%,50%")
    first = run_sweep(cfg, budgets, tmp_path / "a")
    again = run_sweep(cfg, budgets, tmp_path / "b")  # every plan merged before: restored from the store
    assert not any(r.restored for r in first.rows) and all(r.restored for r in again.rows)
    assert all(r.computed_merge_seconds is None for r in again.rows)
    fig = sweep_figure(again)
    ax, bars = fig.axes
    for line in _series(fig):
        assert list(line.get_markevery()) == []  # no filled marker: none of these was computed
    hollow = [line for line in ax.lines if line.get_linestyle() == "None" and line.get_marker() != "None"]
    assert len(hollow) == 3 and all(line.get_markerfacecolor() == "none" for line in hollow)
    assert all(t.get_text().endswith("(restored)") for t in ax.texts)
    # no restore time drawn as a merge's: empty hollow bars, each labelled
    assert [b.get_height() for b in bars.patches] == [0.0] * len(again.rows)
    assert all(to_rgba(b.get_facecolor())[3] == 0 for b in bars.patches)
    assert [t.get_text() for t in bars.texts] == ["restored, not timed"] * len(again.rows)
    import matplotlib.pyplot as plt
    plt.close(fig)


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
