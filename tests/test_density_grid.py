"""Magnitude methods (TIES, Breadcrumbs) cut |delta| at exact ranks. The delta index holds
cuts for densities and gammas of two decimals (index/ranks.py GRID); a value between them is
accepted as mergekit accepts it, and its cuts are made by an extra scan (commands/cuts.py,
tests/test_exact_cuts.py), recorded in the plan; a config on the grid plans as it always did, with
no `cuts` record. Every value the grid accepts has its cut in the index; methods that cut no
ranks (DARE, DELLA) take any density without extra cuts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.config.params import load_config
from mergepipe.index.ranks import GRID, breadcrumbs_ranks, magnitude_rank, on_grid, requested_ranks
from mergepipe.methods import METHODS
from tests.helpers import write_config

MAGNITUDE = sorted(n for n, m in METHODS.items() if m.magnitude)
OFF_GRID = [0.123, 0.005, 0.4567, 0.5000001]


def _config(tmp_path: Path, family, method: str, *, params: dict, expert: dict | None = None) -> Path:
    path = write_config(tmp_path, family, method=method, parameters=params, budget="25%")
    if expert:
        import yaml
        cfg = yaml.safe_load(path.read_text())
        cfg["experts"][0].update(expert)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _keys(method: str) -> list[str]:
    fields = METHODS[method].params.model_fields
    return [f"{where}.{k}" for k in ("density", "gamma") if k in fields for where in ("parameters", "experts[0]")]


@pytest.mark.parametrize("value", OFF_GRID)
@pytest.mark.parametrize("method,key", [(m, k) for m in MAGNITUDE for k in _keys(m)])
def test_an_off_grid_value_is_accepted_when_the_config_is_read(tmp_path, tiny_family, method, key, value):
    where, knob = key.split(".")
    params = {"density": 0.3} if knob == "gamma" else {}
    given = {knob: value}
    path = _config(tmp_path, tiny_family, method, params={**params, **given} if where == "parameters" else params,
                   expert=given if where != "parameters" else None)
    norm = load_config(path).normalized()
    assert (norm["parameters"] if where == "parameters" else norm["experts"][0])[knob] == value


@pytest.mark.parametrize("method", MAGNITUDE)
def test_run_merges_an_off_grid_density_with_its_exact_cuts(tmp_path, tiny_family, method):
    path = _config(tmp_path, tiny_family, method, params={"density": 0.123})
    assert main(["run", str(path), "-q"]) == 0
    plan = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]
    assert sorted(plan["cuts"]) == sorted(e["name"] for e in plan["experts"])
    assert len(list((tmp_path / "cache" / "cuts").iterdir())) == len(plan["experts"])


@pytest.mark.parametrize("method", MAGNITUDE)
def test_a_config_on_the_grid_makes_no_extra_cuts(tmp_path, tiny_family, method):
    path = _config(tmp_path, tiny_family, method, params={"density": 0.12})
    assert main(["run", str(path), "-q"]) == 0
    assert "cuts" not in json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]
    assert not (tmp_path / "cache" / "cuts").exists()


@pytest.mark.parametrize("method", MAGNITUDE)
def test_grid_values_and_density_one_are_accepted(tmp_path, tiny_family, method):
    for value in (0.07, 0.29, 0.57, 0.01, 0.99):  # x * 100 is not an integer in binary for these
        load_config(_config(tmp_path, tiny_family, method, params={"density": value}))
    # density 1 keeps the delta whole: an off-grid gamma is unused, so not refused
    if "gamma" in METHODS[method].params.model_fields:
        load_config(_config(tmp_path, tiny_family, method, params={"density": 1.0, "gamma": 0.015}))


@pytest.mark.parametrize("method", sorted(n for n, m in METHODS.items()
                                          if not m.magnitude and "density" in m.params.model_fields
                                          and "epsilon" not in m.params.model_fields))
def test_methods_that_cut_no_ranks_take_any_density(tmp_path, tiny_family, method):
    assert main(["run", str(_config(tmp_path, tiny_family, method, params={"density": 0.123})), "-q"]) == 0


@pytest.mark.parametrize("n", [1, 7, 100, 4097, 262144, 1000003, 16777216])
def test_every_value_the_grid_accepts_has_its_cut_in_the_index(n):
    """The parse-time rule and the index agree: each rank TIES or Breadcrumbs asks for with
    grid values is one requested_ranks (what the index stores) holds."""
    stored = set(requested_ranks(n)) | {0, n}
    assert all(on_grid(v) for v in GRID)
    for density in GRID:
        k = magnitude_rank(density, n)
        assert k is None or min(k, n) in stored
        for gamma in GRID[:-1]:
            ranks = breadcrumbs_ranks(density, gamma, n)
            assert ranks is None or all(r in stored for r in ranks)


def test_an_off_grid_density_asks_for_a_cut_the_index_lacks():
    """Why extra cuts are made: 0.123 of a 262144-element tensor is rank 32243, between stored cuts."""
    assert not on_grid(0.123)
    assert magnitude_rank(0.123, 262144) not in requested_ranks(262144)


@pytest.mark.parametrize("n", [2, 100, 4097, 262144])
def test_each_magnitude_method_names_the_ranks_its_trim_asks(n):
    """Method.cut_ranks (what the extra cuts are made for) is what the trims ask of the index."""
    for density in (0.0001, 0.123, 0.5, 0.999, 1.0):
        k = magnitude_rank(density, n)
        assert METHODS["ties"].cut_ranks(density, 0.0, n) == (() if k is None or not 0 < k < n else (k,))
        for gamma in (0.0, 0.017, 0.3):
            ends = breadcrumbs_ranks(density, gamma, n)
            want = () if ends is None else tuple(sorted({r for r in ends if 0 < r < n}))
            for method in ("breadcrumbs", "breadcrumbs_ties"):
                assert METHODS[method].cut_ranks(density, gamma, n) == want
