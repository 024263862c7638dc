"""mergekit YAML -> params.yaml: supported configs map exactly, the rest is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mergepipe.config.params import load_config
from mergepipe.errors import ConfigError
from mergepipe.config.mergekit import dump_params, import_mergekit, mergekit_to_params, write_params
from mergepipe.methods import METHODS
from mergepipe.cli import main
from tests.helpers import one_line_error


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """mergekit reads model paths against its working directory; so does the import."""
    monkeypatch.chdir(tmp_path)


def _write(tmp_path: Path, text: str, name: str = "mergekit.yml") -> Path:
    """The config in tmp_path, with a folder for each relative model it names (a relative
    reference that is no folder is a Hugging Face id, as in mergekit)."""
    path = tmp_path / name
    path.write_text(text)
    data = yaml.safe_load(text) or {}
    refs = [data.get("base_model")] + [m.get("model") if isinstance(m, dict) else m for m in data.get("models") or []]
    for ref in refs:
        if isinstance(ref, str) and not ref.startswith("/") and "+" not in ref and "@" not in ref:
            (tmp_path / ref).mkdir(parents=True, exist_ok=True)
    return path


def _convert(text: str) -> dict:
    return mergekit_to_params(yaml.safe_load(text), source="mk.yml")


def _refused(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        _convert(text)
    message = str(info.value)
    assert message.startswith("mk.yml: ") and "\n" not in message, message
    return message


def _needs(method: str):
    return pytest.mark.skipif(method not in METHODS, reason=f"method {method!r} not registered yet")


TIES = """\
models:
  - model: models/base
  - model: models/math-7b
    parameters: {density: 0.5, weight: 0.5}
  - model: /abs/code-7b/
    parameters:
      density: 0.3
      weight: [0.4]
merge_method: ties
base_model: models/base
parameters:
  normalize: true
  int8_mask: true
  lambda: 0.9
dtype: float32
out_dtype: bfloat16
tokenizer_source: base
"""


def test_ties():
    params = _convert(TIES)
    assert params == {
        "base": "models/base",
        "experts": [
            {"name": "math-7b", "path": "models/math-7b", "weight": 0.5, "density": 0.5},
            {"name": "code-7b", "path": "/abs/code-7b/", "weight": 0.4, "density": 0.3},
        ],
        "method": "ties",
        "parameters": {"normalize": True, "int8_mask": True, "lambda": 0.9},
        "seed": 0,
        "budget": "full",
        # named after the recipe; tokenizer_source base: every model's embeddings in the base's vocabulary
        "output": {"dir": "merged-mk", "dtype": "bfloat16", "align_vocabulary": True},
    }


@_needs("ties")
def test_ties_validates(tmp_path):
    params = import_mergekit(_write(tmp_path, TIES))
    assert params["method"] == "ties"


def test_task_arithmetic_with_global_weight_and_dtype(tmp_path):
    text = """\
merge_method: task_arithmetic
base_model: base
models:
  - model: a/expert
    parameters: {weight: 1.0}
  - model: b/expert
  - model: c/Expert
parameters: {weight: 0.25, lambda: 1.5}
dtype: bfloat16
"""
    params = import_mergekit(_write(tmp_path, text))
    assert params["experts"] == [
        {"name": "expert", "path": "a/expert", "weight": 1.0},
        {"name": "expert-2", "path": "b/expert", "weight": 0.25},
        {"name": "Expert-3", "path": "c/Expert", "weight": 0.25},  # dedup ignores case
    ]
    assert params["parameters"] == {"lambda": 1.5}
    assert params["output"]["dtype"] == "bfloat16"  # mergekit writes `dtype` without out_dtype
    cfg = load_config(_write(tmp_path, dump_params(params), "params.yaml"))
    assert cfg.method_params.lambda_ == 1.5


def test_linear_with_base_listed():
    params = _convert("""\
merge_method: linear
base_model: m/base
models:
  - {model: m/base, parameters: {weight: 0.2}}
  - {model: m/one, parameters: {weight: 0.3}}
  - {model: m/two, parameters: {weight: 0.5}}
""")
    assert params["base"] == "m/base"
    assert [e["name"] for e in params["experts"]] == ["one", "two"]
    assert params["parameters"] == {"base_weight": 0.2}


def test_linear_without_base_uses_first_model():
    params = _convert("""\
merge_method: linear
models:
  - {model: m/one, parameters: {weight: 1}}
  - {model: m/two, parameters: {weight: 3}}
parameters: {normalize: true}
""")
    assert params["base"] == "m/one"
    assert params["experts"] == [{"name": "two", "path": "m/two", "weight": 3}]
    assert params["parameters"] == {"base_weight": 1, "normalize": True}


def test_linear_unlisted_base_takes_global_weight():
    params = _convert("""\
merge_method: linear
base_model: m/base
models: [{model: m/one}]
parameters: {weight: 0.5}
""")
    assert params["parameters"] == {"base_weight": 0.5}
    assert params["experts"][0]["weight"] == 0.5


def test_linear_unlisted_base_without_weight_is_refused():
    assert "base_model" in _refused("""\
merge_method: linear
base_model: m/base
models: [{model: m/one, parameters: {weight: 1}}]
""")


@_needs("linear")
def test_linear_validates(tmp_path):
    import_mergekit(_write(tmp_path, """\
merge_method: linear
base_model: m/base
models:
  - {model: m/base, parameters: {weight: 0.2}}
  - {model: m/one, parameters: {weight: 0.8}}
"""))


SLERP = """\
slices: null
merge_method: slerp
base_model: models/base
models:
  - model: models/base
  - model: models/chat
parameters:
  t: 0.3
dtype: bfloat16
"""


def test_slerp():
    params = _convert(SLERP)  # an empty `slices` is no slice
    assert params["base"] == "models/base"
    assert params["experts"] == [{"name": "chat", "path": "models/chat", "weight": 1.0}]
    assert params["parameters"] == {"t": 0.3}
    assert params["output"]["dtype"] == "bfloat16"


def test_slerp_needs_exactly_one_other_model():
    assert "exactly one other model, got 2" in _refused("""\
merge_method: slerp
base_model: b
models: [{model: x}, {model: y}]
parameters: {t: 0.5}
""")


@_needs("slerp")
def test_slerp_validates(tmp_path):
    import_mergekit(_write(tmp_path, SLERP))


def test_dare_ties_and_breadcrumbs():
    params = _convert("""\
merge_method: dare_ties
base_model: b
models:
  - {model: e1, parameters: {weight: 0.5, density: 0.6}}
  - {model: e2, parameters: {weight: 0.5}}
parameters: {density: 0.4, rescale: true}
""")
    assert params["method"] == "dare_ties"
    assert params["experts"][0]["density"] == 0.6 and "density" not in params["experts"][1]
    assert params["parameters"] == {"density": 0.4, "rescale": True}
    params = _convert("""\
merge_method: model_breadcrumbs_ties
base_model: b
models: [{model: e1, parameters: {weight: 1, density: 0.8, gamma: 0.05}}]
""")
    assert params["method"] == "breadcrumbs_ties"
    assert params["experts"][0]["gamma"] == 0.05


@_needs("dare_linear")
def test_dare_linear_validates(tmp_path):
    import_mergekit(_write(tmp_path, """\
merge_method: dare_linear
base_model: b
models: [{model: e1, parameters: {weight: 1.0, density: 0.5}}]
"""))


def test_unconditional_filters_are_scalars():
    params = _convert("""\
merge_method: task_arithmetic
base_model: b
models:
  - model: e1
    parameters:
      weight: [{value: 0.7}]
  - model: e2
    parameters:
      weight: {filter: "*", value: 0.3}
""")
    assert [e["weight"] for e in params["experts"]] == [0.7, 0.3]


@pytest.mark.parametrize("text, fragment", [
    ("merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [0, 24]}]\n"
     "  - sources: [{model: b, layer_range: [20, 40]}]\n",
     "mk.yml: slices: stacking layers builds a model folder first"),
    ("merge_method: ties\nbase_model: b\nslices:\n  - sources: [{model: a, layer_range: [0, 24]}]\n"
     "  - sources: [{model: b, layer_range: [20, 40]}]\n",
     "mk.yml: slices: slices that merge build stacked views first"),
    ("merge_method: slerp\nbase_model: b\nslices:\n  - sources: [{model: b, layer_range: [4, 32]}]\n",
     "mk.yml: slices: slices that merge build stacked views first"),
    ("merge_method: slerp\nbase_model: b\nslices:\n  - sources: [{model: b, layer_range: [0, 32]}]\n"
     "    parameters: {t: 0.5}\n", "mk.yml: slices: slices that merge build stacked views first"),
    ("merge_method: ties\nbase_model: b\nmodules: {text: {models: [{model: e}]}}\n", "mk.yml: modules:"),
    ("merge_method: ties\nbase_model: b\nmodels:\n  - {model: e, parameters: {density: [0.2, 0.8]}}\n",
     "mk.yml: models[0].parameters.weight: required"),
    ("merge_method: ties\nbase_model: b\nmodels:\n  - model: e\n    parameters: {weight: [{filter: mlp}]}\n",
     "mk.yml: models[0].parameters.weight: condition {'filter': 'mlp'} has no value"),
    ("merge_method: ties\nbase_model: b\nmodels:\n  - model: e\n    parameters: {weight: [{value: 1, x: 2}]}\n",
     "mk.yml: models[0].parameters.weight: unexpected keys ['x']"),
    ("merge_method: ties\nbase_model: b\nmodels:\n  - model: e\n    parameters: {weight: [{value: 1}, 2]}\n",
     "mk.yml: models[0].parameters.weight: mixes conditions and plain values"),
    ("merge_method: slerp\nbase_model: b\nmodels: [{model: e}]\n", "mk.yml: parameters.t: required"),
    ("merge_method: della\nbase_model: b\nmodels: [{model: e}]\n", "mk.yml: models[0].parameters.weight: required"),
    ("merge_method: della\nbase_model: b\nmodels:\n  - {model: e, parameters: {weight: 1, epsilon: 0.1}}\n"
     "  - {model: f, parameters: {weight: 1, epsilon: 0.2}}\n",
     "mk.yml: models[1].parameters.epsilon: 0.2 differs from models[0].parameters.epsilon's 0.1"),
    ("merge_method: passthrough\nmodels: [{model: e}, {model: f}]\n",
     "mk.yml: models: passthrough takes exactly one model, got 2"),
    ("merge_method: nuslerp\nmodels: [{model: e, parameters: {weight: 1}}]\n",
     "mk.yml: models: nuslerp without base_model needs at least two models"),
    ("base_model: b\nmodels: [{model: e}]\n", "merge_method: None"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: e+lora/adapter, parameters: {weight: 1}}]\n",
     "mk.yml: models[0].model: the LoRA adapter is on 'e', not on the base model 'b'"),
    ("merge_method: ties\nbase_model: b+lora\nmodels: [{model: e, parameters: {weight: 1}}]\n",
     "mk.yml: base_model: LoRA reference"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: org/e@main, parameters: {weight: 1}}]\n",
     "mk.yml: models[0].model: revision reference"),
    ("merge_method: ties\nbase_model: b\ntokenizer_source: union\ntokenizer: {source: union}\n"
     "models: [{model: e, parameters: {weight: 1}}]\n", "mk.yml: tokenizer: give tokenizer_source or tokenizer"),
    ("merge_method: ties\nbase_model: b\ntokenizer: {tokens: {x: {source: f}}}\n"
     "models: [{model: e, parameters: {weight: 1}}]\n", "mk.yml: tokenizer.tokens.x.source: 'f' is not a model"),
    ("merge_method: ties\nbase_model: b\nchat_template: chatml2\nmodels: [{model: e, parameters: {weight: 1}}]\n",
     "mk.yml: chat_template: invalid chat template 'chatml2'"),
    ("merge_method: ties\nbase_model: b\nfoo: 1\nmodels: [{model: e, parameters: {weight: 1}}]\n",
     "mk.yml: foo: unknown mergekit key"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: e}]\n",
     "mk.yml: models[0].parameters.weight: required"),
    ("merge_method: ties\nmodels: [{model: e, parameters: {weight: 1}}]\n", "mk.yml: base_model: required"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: e, parameters: {weight: 1, epsilon: 0.1}}]\n",
     "mk.yml: models[0].parameters.epsilon: per-model 'epsilon'"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: e, layer_range: [0, 4], parameters: {weight: 1}}]\n",
     "mk.yml: models[0].layer_range: unknown key"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: b, parameters: {weight: 1}}]\n",
     "mk.yml: models: lists only the base model"),
    ("merge_method: ties\nbase_model: b\nmodels: []\n", "mk.yml: models: must be a non-empty list"),
    ("merge_method: ties\nbase_model: b\ndtype: float64\nmodels: [{model: e, parameters: {weight: 1}}]\n",
     "mk.yml: dtype: dtype 'float64'"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: {path: e}, parameters: {weight: 1}}]\n",
     "mk.yml: models[0].model: must be a model path string"),
])
def test_refused(text, fragment):
    assert fragment in _refused(text)


def test_out_dtype_aliases():
    base = "merge_method: task_arithmetic\nbase_model: b\nmodels: [{model: e, parameters: {weight: 1}}]\n"
    assert _convert(base)["output"]["dtype"] is None
    assert _convert(base + "out_dtype: torch.float16\n")["output"]["dtype"] == "float16"
    assert _convert(base + "dtype: bf16\n")["output"]["dtype"] == "bfloat16"


def test_validation_errors_name_the_converted_file(tmp_path):
    path = _write(tmp_path, "merge_method: task_arithmetic\nbase_model: b\n"
                            "models: [{model: e, parameters: {weight: 1, density: 0.5}}]\n")
    with pytest.raises(ConfigError) as info:
        import_mergekit(path)
    assert str(info.value).startswith(f"{path} (converted to mergepipe params): experts[0].density")
    assert mergekit_to_params(yaml.safe_load(path.read_text()))  # the mapping itself is fine


def test_missing_mergekit_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        import_mergekit(tmp_path / "nope.yml")


def test_write_params_is_deterministic_and_loadable(tmp_path):
    params = {"output": {"dtype": None, "dir": "out"}, "method": "task_arithmetic",
              "parameters": {"lambda": 0.5}, "experts": [{"weight": 1.0, "path": "e", "name": "e"}],
              "base": "b", "budget": "25%"}
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_params(params, first, comment="imported from mk.yml")
    write_params(dict(reversed(list(params.items()))), second, comment="imported from mk.yml")
    assert first.read_bytes() == second.read_bytes()
    text = first.read_text()
    assert text.startswith("# imported from mk.yml\nbase: b\nexperts:\n- name: e\n  path: e\n")
    assert list(yaml.safe_load(text)) == ["base", "experts", "method", "parameters", "budget", "output"]
    assert (first.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml", "b.yaml"]  # no temp files
    cfg = load_config(first)
    assert str(cfg.budget) == "25%" and cfg.output.dir == tmp_path / "out"
    write_params(params, first)  # overwrite in place
    assert load_config(first).method_params.lambda_ == 0.5


GRADIENT_SLERP = """\
slices:
merge_method: slerp
base_model: models/a
models:
  - model: models/a
  - model: models/b
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: bfloat16
"""


def test_gradients_and_filters_become_settings(tmp_path):
    params = import_mergekit(_write(tmp_path, GRADIENT_SLERP))
    assert params["parameters"]["t"] == [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                                         {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}]
    cfg = load_config(write_and_return(tmp_path, params))
    assert set(cfg.param_settings) == {"t"}


def write_and_return(tmp_path: Path, params: dict) -> Path:
    out = tmp_path / "params.yaml"
    write_params(params, out)
    return out


def test_model_setting_falls_back_to_the_global_one():
    params = _convert("""\
merge_method: ties
base_model: b
parameters: {weight: 0.25, density: [0.2, 0.6]}
models:
  - model: e1
    parameters:
      weight: [{filter: mlp, value: 0.5}]
      density: {filter: self_attn, value: 0.9}
  - model: e2
    parameters: {weight: [{filter: "*", value: [0.1, 0.3]}]}
  - model: e3
    parameters: {weight: [{filter: mlp, value: 0.5}, {value: 2}]}
""")
    e1, e2, e3 = params["experts"]
    assert e1["weight"] == [{"filter": "mlp", "value": 0.5}, {"value": 0.25}]
    assert e1["density"] == [{"filter": "self_attn", "value": 0.9}]  # then the method's, per tensor
    assert e2["weight"] == [0.1, 0.3]  # an unfiltered first condition: a plain gradient
    assert e3["weight"] == [{"filter": "mlp", "value": 0.5}, {"value": 2}]
    assert params["parameters"]["density"] == [0.2, 0.6]


def test_tokenizer_source_model_and_base(tmp_path):
    text = "merge_method: ties\nbase_model: b\nmodels:\n  - {model: e, parameters: {weight: 1}}\n"
    params = import_mergekit(_write(tmp_path, text + "tokenizer_source: e\n"))
    assert params["output"]["tokenizer_source"] == "e" and params["output"]["align_vocabulary"] is True
    params = import_mergekit(_write(tmp_path, text + "tokenizer_source: base\n"))
    assert "tokenizer_source" not in params["output"] and params["output"]["align_vocabulary"] is True
    assert "align_vocabulary" not in import_mergekit(_write(tmp_path, text))["output"]  # mergekit: no alignment
    # union, and tokenizer: (whose source is union by default): the output vocabulary (tests/test_vocab.py)
    imported = import_mergekit(_write(tmp_path, text + "tokenizer_source: union\n"))
    assert imported["output"]["tokenizer_source"] == "union"
    params = import_mergekit(_write(tmp_path, text + "tokenizer: {pad_to_multiple_of: 8, tokens: {x: {source: e}}}\n"))
    assert params["output"]["tokenizer_source"] == "union" and params["output"]["pad_to_multiple_of"] == 8
    assert params["output"]["tokens"] == {"x": {"source": params["experts"][0]["name"]}}


def test_hub_ids_resolve_from_the_local_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hf" / "hub"
    snap = hub / "models--org--base-7b" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (hub / "models--org--base-7b" / "snapshots" / "old").mkdir()
    (hub / "models--org--base-7b" / "refs").mkdir()
    (hub / "models--org--base-7b" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    text = "merge_method: ties\nbase_model: org/base-7b\nmodels:\n  - {model: ./e, parameters: {weight: 1}}\n"
    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "mk.yml"
    path.write_text(text)
    (tmp_path / "cfg" / "e").mkdir()
    params = import_mergekit(path)
    assert params["base"] == str(snap)
    path.write_text(text.replace("org/base-7b", "org/missing"))
    with pytest.raises(ConfigError) as err:
        import_mergekit(path)
    message = str(err.value)
    assert "base_model: Hugging Face model 'org/missing' is neither a local folder nor in the local" in message
    assert "\n" not in message


def test_one_slice_over_every_layer_is_the_models_form(tmp_path):
    text = GRADIENT_SLERP.replace("slices:\n", "").replace(
        "models:\n  - model: models/a\n  - model: models/b\n",
        "slices:\n  - sources:\n      - {model: models/a, layer_range: [0, 4]}\n"
        "      - {model: models/b, layer_range: [0, 4]}\n")
    path = _write(tmp_path, text)
    for name in ("a", "b"):
        (tmp_path / "models" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / name / "config.json").write_text('{"num_hidden_layers": 4}')
    params = import_mergekit(path)
    assert params["base"] == "models/a" and [e["path"] for e in params["experts"]] == ["models/b"]
    (tmp_path / "models" / "b" / "config.json").write_text('{"num_hidden_layers": 6}')
    with pytest.raises(ConfigError, match=r"slices: slices that merge build stacked views first"):
        import_mergekit(path)  # part of b's layers: a merge of stacked views (tests/test_mergekit_slices.py)


def test_import_mergekit_does_not_overwrite_an_existing_file(tmp_path):
    mk = tmp_path / "mergekit.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "base",
                                  "models": [{"model": "a", "parameters": {"weight": 1.0}}]}))
    params = tmp_path / "params.yaml"
    params.write_text("base: mine\n")
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 7
    assert params.read_text() == "base: mine\n"
    assert main(["import-mergekit", str(mk), "-o", str(mk), "-q", "--force"]) == 7  # never the input itself
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q", "--force"]) == 0
    assert "task_arithmetic" in params.read_text()


@pytest.mark.parametrize("text", ["", "[1, 2]\n", "just a string\n"])
def test_import_mergekit_of_an_empty_or_non_mapping_file(text, tmp_path, capsys):
    """An empty mergekit YAML (or a list) ended in AttributeError's traceback."""
    mk = tmp_path / "mergekit.yml"
    mk.write_text(text)
    capsys.readouterr()
    assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "params.yaml"), "-q"]) == 2
    one_line_error(capsys, str(mk), "mapping")
    assert not (tmp_path / "params.yaml").exists()


@pytest.mark.parametrize("key,value", [("tokenizer_source", "union"), ("tokenizer_source", "e"),
                                       ("tokenizer", {"source": "base", "pad_to_multiple_of": 8})])
def test_modules_with_another_vocabulary_are_refused_naming_the_key(key, value):
    data = {"merge_method": "linear", "base_model": "b", key: value,
            "modules": {"text_decoder": {"models": [{"model": "b", "parameters": {"weight": 1}},
                                                    {"model": "e", "parameters": {"weight": 1}}]}}}
    with pytest.raises(ConfigError, match=rf"^mk.yml: {key}: a vocabulary other than the base's .* not built with "
                                          "modules"):
        mergekit_to_params(data, source="mk.yml")
