"""Magnitude methods (TIES, Breadcrumbs) cut |delta| at ranks the delta index holds exact
thresholds for: densities and gammas of two decimals (index/ranks.py GRID). A value between
them is refused when params.yaml is read (exit 2, naming the key and the grid), not at merge
time (exit 5); every value the grid accepts has its cut in the index; methods that cut no
ranks (DARE, DELLA) take any density."""
from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError
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
def test_an_off_grid_value_is_refused_when_the_config_is_read(tmp_path, tiny_family, method, key, value):
    where, knob = key.split(".")
    params = {"density": 0.3} if knob == "gamma" else {}
    given = {knob: value}
    path = _config(tmp_path, tiny_family, method, params={**params, **given} if where == "parameters" else params,
                   expert=given if where != "parameters" else None)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert err.value.exit_code == 2 and "\n" not in message
    assert f"{key}: {value!r}" in message and "two decimals (0.01 steps)" in message and "use 0." in message


@pytest.mark.parametrize("method", MAGNITUDE)
def test_run_refuses_before_reading_anything(tmp_path, tiny_family, capsys, method):
    path = _config(tmp_path, tiny_family, method, params={"density": 0.123})
    assert main(["run", str(path), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parameters.density: 0.123" in err and "0.12 or 0.13" in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


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
    """Why it is refused: 0.123 of a 262144-element tensor is rank 32243, between stored cuts."""
    assert not on_grid(0.123)
    assert magnitude_rank(0.123, 262144) not in requested_ranks(262144)
