"""params.yaml: loading, normalization, one-line errors with key paths, schema."""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from mergepipe.config.params import (
    ExpertConfig,
    MergeConfig,
    OutputConfig,
    config_from_dict,
    json_schema,
    load_config,
    render_schema_yaml,
)
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS, Method
from mergepipe.units import Budget

REPO = Path(__file__).resolve().parent.parent
SCHEMA_FILE = REPO / "schemas" / "params.schema.yaml"

EXAMPLE = """\
base: models/base
experts:
  - {name: math, path: models/math, weight: 1.0}        # optional per-expert density, gamma
  - {name: code, path: models/code, weight: 0.5, density: 0.3}
method: ties
parameters: {lambda: 1.0, density: 0.5}   # validated against the method's params class
seed: 0
budget: 25%
block_bytes: 1MiB
output: {dir: merged, dtype: null, shard_bytes: null}   # dtype: null|bfloat16|float16|float32
cache_dir: .mergepipe            # where indexes/plans/store live (optional, default .mergepipe)
nonfinite: error                 # error | allow  (NaN/Inf in an expert)
"""


# A stand-in for TIES/Breadcrumbs, so these tests do not depend on which real
# methods are registered; monkeypatch removes it after each test.
class FakeParams(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)
    lambda_: float = Field(1.0, alias="lambda")
    normalize: bool = True
    density: float = Field(1.0, gt=0, le=1)
    gamma: float = Field(0.01, ge=0, lt=1)


class FakePairParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    t: float = Field(ge=0, le=1)


def _noop(block, params):  # pragma: no cover - never called
    raise AssertionError


@pytest.fixture
def fake_methods(monkeypatch):
    monkeypatch.setitem(METHODS, "fake_ties", Method(
        name="fake_ties", params=FakeParams, fn=_noop, additive=False, magnitude=True,
        paper="test"))
    monkeypatch.setitem(METHODS, "fake_pair", Method(
        name="fake_pair", params=FakePairParams, fn=_noop, additive=False, magnitude=False,
        paper="test", max_experts=1))


@pytest.fixture
def example(tmp_path, fake_methods) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(EXAMPLE.replace("method: ties", "method: fake_ties"))
    return path


def _raw() -> dict:
    return yaml.safe_load(EXAMPLE.replace("method: ties", "method: fake_ties"))


def _error(data, *, overrides=None, source="params.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, source=source, root="/work/x", overrides=overrides)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{source}: "), message
    return message


# ---------------------------------------------------------------- good configs

def test_load_example(example, tmp_path):
    cfg = load_config(example)
    assert isinstance(cfg, MergeConfig)
    assert cfg.base == tmp_path / "models" / "base"
    assert [e.path for e in cfg.experts] == [tmp_path / "models/math", tmp_path / "models/code"]
    assert all(p.is_absolute() for p in (cfg.base, cfg.output.dir, cfg.cache_dir))
    assert cfg.output.dir == tmp_path / "merged"
    assert cfg.cache_dir == tmp_path / ".mergepipe"
    assert cfg.budget == Budget("fraction", fraction=Fraction(1, 4))
    assert cfg.block_bytes == 1 << 20
    assert cfg.method_params.lambda_ == 1.0
    assert cfg.method_params.density == 0.5
    assert cfg.expert_density(cfg.experts[0]) == 0.5  # from parameters
    assert cfg.expert_density(cfg.experts[1]) == 0.3  # its own
    assert cfg.expert_gamma(cfg.experts[0]) == 0.01  # the method's default
    assert cfg.source == str(example)


def test_normalized_is_canonical_and_round_trips(example, tmp_path):
    cfg = load_config(example)
    norm = cfg.normalized()
    assert norm == {
        "base": "models/base",
        "experts": [
            {"name": "math", "path": "models/math", "weight": 1.0, "density": 0.5, "gamma": 0.01},
            {"name": "code", "path": "models/code", "weight": 0.5, "density": 0.3, "gamma": 0.01},
        ],
        "method": "fake_ties",
        "parameters": {"lambda": 1.0, "normalize": True, "density": 0.5, "gamma": 0.01},
        "seed": 0,
        "budget": "25%",
        "block_bytes": 1048576,
        "output": {"dir": "merged", "dtype": None, "shard_bytes": None},
        "cache_dir": ".mergepipe",
        "nonfinite": "error",
    }
    json.dumps(norm, allow_nan=False)  # JSON-able
    again = config_from_dict(json.loads(json.dumps(norm)), root=tmp_path)
    assert again.normalized() == norm
    assert again.base == cfg.base and again.experts[1].path == cfg.experts[1].path


def test_equivalent_spellings_normalize_equally(fake_methods):
    a = {"base": "./b/", "experts": [{"name": "e", "path": "e", "weight": 1}],
         "method": "fake_ties", "budget": 0.25, "block_bytes": 1048576}
    b = {"base": "b", "experts": [{"name": "e", "path": "./e", "weight": 1.0}],
         "method": "fake_ties", "budget": "25.0%", "block_bytes": "1MiB",
         "parameters": {"lambda": 1, "density": 1.0}, "seed": 0}
    assert config_from_dict(a).normalized() == config_from_dict(b).normalized()


def test_defaults_filled(fake_methods):
    cfg = config_from_dict({"base": "b", "experts": [{"name": "e", "path": "e", "weight": 1}],
                            "method": "fake_ties"}, root="/r")
    norm = cfg.normalized()
    assert norm["budget"] == "full" and cfg.budget.kind == "full"
    assert norm["seed"] == 0 and norm["block_bytes"] == 1 << 20
    assert norm["output"] == {"dir": "merged", "dtype": None, "shard_bytes": None}
    assert norm["cache_dir"] == ".mergepipe" and norm["nonfinite"] == "error"
    assert cfg.output.dir == Path("/r/merged")


def test_method_without_density_normalizes_to_none():
    cfg = config_from_dict({"base": "b", "experts": [{"name": "e", "path": "e", "weight": 2}],
                            "method": "task_arithmetic"})
    expert = cfg.normalized()["experts"][0]
    assert expert["density"] is None and expert["gamma"] is None
    assert cfg.normalized()["parameters"]["lambda"] == 1.0


def test_paths_relative_to_config_dir_not_cwd(example, tmp_path, monkeypatch):
    monkeypatch.chdir("/")
    cfg = load_config(example)
    assert cfg.base == tmp_path / "models" / "base"
    absolute = config_from_dict(_raw(), root=tmp_path,
                                overrides={"base": str(tmp_path / "elsewhere")})
    assert absolute.base == tmp_path / "elsewhere"
    assert absolute.normalized()["base"] == str(tmp_path / "elsewhere")


def test_overrides(example):
    cfg = load_config(example, overrides={"budget": "10%", "output.dtype": "bfloat16",
                                          "experts.1.weight": 2, "parameters": {"density": 0.2},
                                          "output": {"shard_bytes": "1GiB"}})
    assert str(cfg.budget) == "10%"
    assert cfg.output.dtype == "bfloat16" and cfg.output.shard_bytes == 1 << 30
    assert cfg.output.dir.name == "merged"  # nested mapping merged, not replaced
    assert cfg.experts[1].weight == 2.0
    assert cfg.method_params.density == 0.2 and cfg.method_params.lambda_ == 1.0
    assert load_config(example).budget != cfg.budget  # the file is untouched


@pytest.mark.parametrize("overrides, fragment", [
    ({"experts.9.weight": 1}, "experts.9.weight"),
    ({"experts.x.weight": 1}, "use an index"),
    ({"budget.x": 1}, "budget.x"),
])
def test_bad_overrides(overrides, fragment, fake_methods):
    assert fragment in _error(_raw(), overrides=overrides)


def test_output_dtype_and_shards(fake_methods):
    for dtype in ("bfloat16", "float16", "float32", None):
        cfg = config_from_dict(_raw(), overrides={"output.dtype": dtype})
        assert cfg.output.dtype == dtype
    cfg = config_from_dict(_raw(), overrides={"output.shard_bytes": 5_000_000_000})
    assert cfg.normalized()["output"]["shard_bytes"] == 5_000_000_000


def test_models_are_frozen(example):
    cfg = load_config(example)
    with pytest.raises(Exception):
        cfg.seed = 3
    assert set(MergeConfig.model_fields) == {
        "base", "experts", "method", "parameters", "seed", "budget", "block_bytes", "embedding_block_bytes", "output",
        "cache_dir", "nonfinite", "plan", "slices", "modules"}
    assert set(ExpertConfig.model_fields) == {"name", "path", "adapter", "weight", "density", "gamma"}
    assert set(OutputConfig.model_fields) == {"dir", "dtype", "shard_bytes", "tokenizer_source", "tokens",
                                              "pad_to_multiple_of", "align_vocabulary", "chat_template",
                                              "mergekit_config", "adapter"}


def test_per_method_density_check_exempts_density_one(fake_methods):
    # breadcrumbs-like defaults (density 1, gamma 0.01): density 1 keeps deltas whole
    config_from_dict(_raw(), overrides={"parameters": {"density": 1.0}})
    config_from_dict(_raw(), overrides={"experts.0.density": 0.8, "experts.0.gamma": 0.2})


# ---------------------------------------------------------------- bad configs

BAD = [
    ({"experts.1.density": 1.5}, "experts[1].density: must be in (0, 1], got 1.5"),
    ({"experts.1.density": 0}, "experts[1].density: must be in (0, 1], got 0"),
    ({"experts.1.density": -0.1}, "experts[1].density: must be in (0, 1]"),
    ({"experts.0.gamma": 1.0}, "experts[0].gamma: must be in [0, 1), got 1.0"),
    ({"experts.0.gamma": -0.5}, "experts[0].gamma: must be in [0, 1)"),
    ({"experts.0.density": 0.9, "experts.0.gamma": 0.2}, "experts[0]: density + gamma must be <= 1"),
    ({"experts.1.gamma": 0.8}, "experts[1]: density + gamma must be <= 1"),
    ({"parameters": {"density": 0.995, "gamma": 0.01}, "experts.1.density": None},
     "parameters: density + gamma must be <= 1"),
    ({"experts.1.densty": 0.3}, "experts[1].densty: unknown key (did you mean 'density'?); "
     "allowed keys: name, path, adapter, weight, density, gamma"),
    ({"experts.0.weight": float("nan")}, "experts[0].weight: must be a finite number"),
    ({"experts.0.weight": float("inf")}, "experts[0].weight: must be a finite number"),
    ({"experts.0.weight": "1.0"}, "experts[0].weight: must be a valid number, got '1.0'"),
    ({"experts.0.weight": True}, "experts[0].weight: must be a valid number, got True"),
    ({"experts.0.weight": None}, "experts[0].weight: must be a valid number, got None"),
    ({"experts.1.name": "math"}, "experts[1].name: duplicate expert name 'math'"),
    ({"experts.1.name": "MATH"}, "experts[1].name: duplicate expert name 'MATH'"),
    ({"experts.1.name": ""}, "experts[1].name: must be 1-128 characters"),
    ({"experts.1.name": "a/b"}, "experts[1].name: must be 1-128 characters"),
    ({"experts.1.name": ".."}, "experts[1].name: must be 1-128 characters"),
    ({"experts.1.name": "x" * 129}, "experts[1].name: must be 1-128 characters"),
    ({"experts.1.name": 7}, "experts[1].name: must be a valid string, got 7"),
    ({"experts.0.path": ""}, "experts[0].path: must be a non-empty path"),
    ({"experts.0.path": 3}, "experts[0].path: must be a path string"),
    ({"base": None}, "base: must be a path string"),
    ({"experts": []}, "experts: must list at least one expert"),
    ({"experts": "math"}, "experts: must be a list"),
    ({"experts.0": "math"}, "experts[0]: must be a mapping"),
    ({"method": "tiess"}, "method: unknown merge method 'tiess' (did you mean 'ties'?); known: "),
    ({"method": 3}, "method: must be a valid string"),
    ({"parameters": {"lamda": 1.0}}, "parameters.lamda: unknown key (did you mean 'lambda'?); "
     "allowed keys: lambda, normalize, density, gamma"),
    ({"parameters": {"density": 2}}, "parameters.density: must be less than or equal to 1"),
    ({"parameters": {"gamma": 0.999}, "experts.1.density": 1.0},
     "parameters: density + gamma must be <= 1, got 0.5 + 0.999"),
    ({"parameters": {"lambda": "x", "density": 2}}, "(and 1 more error)"),
    ({"parameters": "lambda=1"}, "parameters: must be a mapping, got str"),
    ({"experts.0.weight": 0.5, "experts.1.weight": -0.5},
     "experts: weights sum to 0.0 but method 'fake_ties' normalizes"),
    ({"seed": -1}, "seed: must be greater than or equal to 0, got -1"),
    ({"seed": 1.5}, "seed: must be a valid integer, got 1.5"),
    ({"seed": "0"}, "seed: must be a valid integer, got '0'"),
    ({"seed": True}, "seed: must be a valid integer, got True"),
    ({"seed": 1 << 63}, "seed: must be less than or equal to"),
    ({"budget": "150%"}, "budget: must not exceed 100%"),
    ({"budget": 0}, "budget: must be > 0"),
    ({"budget": "nonsense"}, "budget: cannot parse 'nonsense'"),
    ({"budget": True}, "budget: must be 'full', a percentage, a fraction or a size, got True"),
    ({"budget": float("nan")}, "budget: must be finite"),
    ({"block_bytes": 1024}, "block_bytes: must be between 4KiB and 1GiB, got 1024"),
    ({"block_bytes": "2GiB"}, "block_bytes: must be between 4KiB and 1GiB"),
    ({"block_bytes": "1.5B"}, "block_bytes: '1.5B' is not a whole number of bytes"),
    ({"block_bytes": 4096.0}, "block_bytes: must be a byte count"),
    ({"output.dtype": "int8"}, "output.dtype: must be 'bfloat16', 'float16' or 'float32', got 'int8'"),
    ({"output.shard_bytes": "1K"}, "output.shard_bytes: unknown unit 'K'"),
    ({"output.shard_bytes": 100}, "output.shard_bytes: must be at least 4KiB"),
    ({"output.dirr": "x"}, "output.dirr: unknown key (did you mean 'dir'?); allowed keys: dir, dtype, shard_bytes"),
    ({"output": "merged"}, "output: must be a mapping, got str"),
    ({"output.dir": "models/math"}, "output.dir: 'models/math' overlaps the input model experts[0].path"),
    ({"output.dir": "models/math/out"}, "output.dir: 'models/math/out' overlaps the input model experts[0].path"),
    ({"output.dir": "models"}, "output.dir: 'models' overlaps the input model base"),
    ({"output.dir": "."}, "output.dir: '.' overlaps the input model base"),
    ({"output.dir": "/work/x/models/base"}, "overlaps the input model base ('models/base')"),
    ({"cache_dir": "merged/.cache"}, "cache_dir: 'merged/.cache' overlaps output.dir"),
    ({"cache_dir": "models/base"}, "cache_dir: 'models/base' is or lies in the input model base"),
    ({"cache_dir": "models/math/.cache"}, "'models/math/.cache' is or lies in the input model experts[0].path"),
    ({"nonfinite": "ignore"}, "nonfinite: must be 'error' or 'allow', got 'ignore'"),
    ({"extra_key": 1}, "extra_key: unknown key; allowed keys: base, experts, method"),
    ({"Budget": "full"}, "Budget: unknown key"),
]


@pytest.mark.parametrize("overrides, expected", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config(overrides, expected, fake_methods):
    message = _error(_raw(), overrides=overrides)
    assert expected in message, message


def test_missing_required_keys(fake_methods):
    raw = _raw()
    del raw["base"]
    assert _error(raw) == "params.yaml: base: required key is missing"
    raw = _raw()
    del raw["experts"][1]["weight"]
    assert _error(raw) == "params.yaml: experts[1].weight: required key is missing"
    raw = _raw()
    del raw["method"]
    del raw["base"]
    assert _error(raw) == "params.yaml: base: required key is missing (and 1 more error)"


def test_error_counts_further_errors(fake_methods):
    message = _error(_raw(), overrides={"seed": -1, "budget": "x", "nonfinite": "x"})
    assert message.endswith("(and 2 more errors)")


def test_max_experts(fake_methods):
    raw = _raw()
    raw.update(method="fake_pair", parameters={"t": 0.5})
    for expert in raw["experts"]:
        expert.pop("density", None)
    assert "experts: method 'fake_pair' takes exactly 1 expert, got 2" in _error(raw)
    raw["experts"] = raw["experts"][:1]
    cfg = config_from_dict(raw)
    assert cfg.method_params.t == 0.5


def test_required_method_parameter(fake_methods):
    raw = _raw()
    raw.update(method="fake_pair", parameters={}, experts=raw["experts"][:1])
    raw["experts"][0].pop("density", None)
    assert _error(raw) == "params.yaml: parameters.t: required key is missing"


class LooseParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    density: float = Field(1.0, ge=0, le=1)
    gamma: float = Field(0.01, ge=0, le=1)


@pytest.mark.parametrize("parameters, expected", [
    ({"density": 0.0}, "parameters.density: must be in (0, 1], got 0.0"),
    ({"gamma": 1.0}, "parameters.gamma: must be in [0, 1), got 1.0"),
])
def test_method_defaults_must_be_valid_expert_values(monkeypatch, parameters, expected):
    # a method may accept more than a per-expert value allows; normalized() copies
    # the method's values onto each expert, so the config refuses them
    monkeypatch.setitem(METHODS, "loose", Method(
        name="loose", params=LooseParams, fn=_noop, additive=False, magnitude=True, paper="t"))
    raw = {"base": "b", "experts": [{"name": "e", "path": "e", "weight": 1}], "method": "loose",
           "parameters": parameters}
    assert _error(raw) == f"params.yaml: {expected}"


def test_expert_density_needs_a_method_that_takes_it():
    raw = {"base": "b", "experts": [{"name": "e", "path": "e", "weight": 1, "density": 0.5}],
           "method": "task_arithmetic"}
    assert "experts[0].density: method 'task_arithmetic' takes no density" in _error(raw)


def test_zero_weight_sum_allowed_without_normalize(fake_methods):
    cfg = config_from_dict(_raw(), overrides={"experts.0.weight": 0.5, "experts.1.weight": -0.5,
                                              "parameters": {"normalize": False}})
    assert cfg.method_params.normalize is False


def test_not_a_mapping():
    assert "expected a mapping" in _error(["base"])
    assert "empty" in _error(None)


# ---------------------------------------------------------------- YAML files

def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"params\.yaml: no such file"):
        load_config(tmp_path / "params.yaml")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


@pytest.mark.parametrize("text, fragment", [
    ("base: [unclosed\n", "invalid YAML at line"),
    ("base: a\nbase: b\n", "duplicate key 'base'"),
    ("experts:\n  - {name: a, name: b}\n", "duplicate key 'name'"),
    ("", "empty"),
    ("- a\n- b\n", "expected a mapping"),
    ("\tbase: x\n", "invalid YAML"),
])
def test_bad_yaml(tmp_path, text, fragment):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message


def test_yaml_merge_keys_may_override(tmp_path, fake_methods):
    path = tmp_path / "params.yaml"
    path.write_text("base: b\nmethod: fake_ties\nexperts:\n"
                    "  - &e {name: a, path: a, weight: 1.0}\n"
                    "  - {<<: *e, name: b, path: b}\n")
    cfg = load_config(path)
    assert [e.name for e in cfg.experts] == ["a", "b"]


def test_error_names_the_file(tmp_path, fake_methods):
    path = tmp_path / "my.yaml"
    path.write_text(EXAMPLE.replace("method: ties", "method: fake_ties").replace(
        "density: 0.3", "density: 1.5"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: experts[1].density: must be in (0, 1], got 1.5"
    assert info.value.exit_code == 2


# ---------------------------------------------------------------- JSON schema

def test_committed_schema_is_current():
    assert SCHEMA_FILE.exists(), "run: python scripts/gen_schema.py"
    committed = yaml.safe_load(SCHEMA_FILE.read_text())
    assert committed == json_schema(), (
        "schemas/params.schema.yaml is stale (a config field or a registered method changed); "
        "run: python scripts/gen_schema.py")
    assert SCHEMA_FILE.read_text() == render_schema_yaml()


def _validator():
    schema = yaml.safe_load(SCHEMA_FILE.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    return validator_cls(schema)


def _example_for_schema() -> dict:
    data = yaml.safe_load(EXAMPLE)
    if "ties" not in METHODS:  # until the TIES module is registered
        data["method"] = "task_arithmetic"
        data["parameters"] = {"lambda": 1.0}
        data["experts"][1].pop("density")
    return data


def test_schema_accepts_example():
    _validator().validate(_example_for_schema())


@pytest.mark.parametrize("change", [
    {"unknown_key": 1},
    {"budget": "lots"},
    {"budget": -1},
    {"budget": 1.5},
    {"block_bytes": 1024},
    {"method": "no_such_method"},
    {"nonfinite": "ignore"},
    {"seed": -1},
    {"experts": []},
    {"output": {"dir": "m", "dtype": "int8"}},
    {"output": {"dirr": "m"}},
])
def test_schema_rejects(change):
    data = _example_for_schema()
    data.update(change)
    assert not _validator().is_valid(data)


def test_schema_rejects_unknown_expert_key_and_bad_ranges():
    for bad in ({"densty": 0.3}, {"density": 1.5}, {"gamma": 1.0}, {"name": "a/b"}):
        data = _example_for_schema()
        data["experts"][0].update(bad)
        assert not _validator().is_valid(data), bad
    data = _example_for_schema()
    del data["experts"][0]["weight"]
    assert not _validator().is_valid(data)


def test_schema_checks_method_parameters():
    data = _example_for_schema()
    data["parameters"] = {"lamda": 1.0}
    assert not _validator().is_valid(data)


def test_schema_agrees_with_models_on_accepted_spellings():
    data = _example_for_schema()
    for budget in ("full", "25%", 0.25, 1, "2GiB", "12.5 %"):
        data["budget"] = budget
        assert _validator().is_valid(data), budget
        config_from_dict(data)


@pytest.mark.parametrize("ref", ["..", ".", "", "../../x"])
def test_a_damaged_hub_ref_never_names_a_folder_outside_snapshots(ref, tmp_path, monkeypatch):
    """refs/main holding ".." resolved the model to `snapshots/..`, the repo folder itself."""
    from mergepipe.config.hf_cache import hub_snapshot
    from mergepipe.errors import ConfigError
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--m"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(ref)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    assert hub_snapshot("org/m") == repo / "snapshots" / ("a" * 40)  # the only snapshot
    (repo / "snapshots" / ("b" * 40)).mkdir()
    with pytest.raises(ConfigError, match="2 cached snapshots"):
        hub_snapshot("org/m")
