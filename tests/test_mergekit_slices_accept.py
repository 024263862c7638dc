"""Acceptance: mergekit 0.1.5's slice cases, run through `mergepipe import-mergekit` +
`mergepipe run`, against mergekit's own output; and the slice shapes issue 26 found refused.

mergekit's tests exercise slices in tests/test_config_parameters.py (parameter settings at every
level of a slice: its sources, the slice, the global parameters; gradients in scientific
notation, written as strings too; the first matching scope wins; the base's per-input
parameters unread by methods that ignore them) and tests/test_basic_merges.py (a passthrough
stack: tests/test_mergekit_basic_merges.py runs it). Those are unit tests of its parameter
reader on a tensor named "w"; here each is re-expressed as a merge of partial-layer slices
whose parameters reach every tensor (the filter "w" matches every name with "weight"), with
`normalize: false` so that the weights show in the output. Their `modules:` level is left to
tests/test_mergekit_modules.py. Then the shapes of item 2: slices merging different numbers
of models, passthrough slices with per-source `scale`, and per-input filters naming a layer
(mergekit matches them against the source's tensor name, in the source's layer numbering).

The family is Mistral-shaped (untied head, grouped KV heads, 6 layers), fp32; every recipe runs
with `dtype: float32`, `out_dtype: bfloat16` and is compared by the rule of tests/helpers/equivalence.py
(one bf16 ulp of the larger value); mergekit runs all recipes in one process. A recipe mergekit
refuses must be refused in one line. The recipes that differ today are marked (DIFFERS, with
why). Skipped without the mergekit reference venv.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.cli import main
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge
from tests.helpers import load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]

LAYERS, HIDDEN, KV, INTERMEDIATE, VOCAB = 6, 16, 8, 32, 48
MODELS = ("base", "a", "b", "c")

RUN = r'''
import json, sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge
results = {}
for case, (path, out) in json.loads(open(sys.argv[1]).read()).items():
    try:
        run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(path).read())), out,
                  options=MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True))
        results[case] = None
    except Exception as e:
        results[case] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
print(json.dumps(results))
'''


def _config() -> dict:
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 128,
            "sliding_window": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "float32"}


def _write_family(root: Path) -> None:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (KV, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)})
    g = torch.Generator().manual_seed(2605)
    base = {n: torch.randn(s, generator=g) * 0.05 + (1.0 if "norm" in n else 0.0) for n, s in shapes.items()}
    for k, name in enumerate(MODELS):  # fp32: no two |delta| of a tensor tie at a TIES threshold
        tensors = base if k == 0 else {n: w + torch.randn(w.shape, generator=g) * 0.01 * k for n, w in base.items()}
        (root / name).mkdir(parents=True)
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(_config()))


def _src(model: str, start: int, end: int, **parameters) -> dict:
    return {"model": model, "layer_range": [start, end], **({"parameters": parameters} if parameters else {})}


GRADIENT = [{"filter": "w", "value": [1e-5, 1e-3]}]


def _gradient_at(level: str) -> dict:
    """test_scientific_notation_gradients_at_every_config_level: the weight gradient given at
    one level (b's own weight always set at its source)."""
    a = _src("a", 1, 4, **({"weight": GRADIENT} if level == "input" else {}))
    out_slice = {"sources": [a, _src("b", 1, 4, weight=1.0)],
                 **({"parameters": {"weight": GRADIENT}} if level == "slice" else {})}
    return {"merge_method": "linear", "slices": [out_slice, {"sources": [_src("a", 4, 6), _src("b", 4, 6)]}],
            "parameters": {"normalize": False, **({"weight": GRADIENT} if level == "global" else {"weight": 0.5})}}


def _resolution(method: str, explicit_base: bool) -> dict:
    """test_raw_and_yaml_parameter_resolution_agree: a's weight filtered on a name no tensor has
    (so the global string gradient applies), b's 0, the base listed or not; for methods that
    ignore the base's weight, the base's is not a number and must not be read."""
    base = _src("base", 0, 3, **({"weight": "not-a-number"} if explicit_base and method != "linear" else {}))
    sources = [_src("a", 0, 3, weight={"filter": "other", "value": 99}), _src("b", 0, 3, weight=0.0), base]
    return {"merge_method": method, "base_model": "base", "slices": [{"sources": sources}],
            "parameters": {"weight": ["1e-5", "1e-3"], "normalize": False}}


def _precedence(first_matching_scope: int) -> dict:
    """test_precedence_and_distinct_input_output_tensor_names without its modules level: a's
    weight set at its source, the slice and the global parameters, each filtered on a name
    every tensor has from `first_matching_scope` on, on none before; 3: none matches (mergekit:
    a required parameter is missing)."""
    def weight(index: int) -> dict:
        return {"weight": {"filter": "w" if index >= first_matching_scope else "absent",
                           "value": [index + 1, index + 3]}}
    return {"merge_method": "linear",
            "slices": [{"sources": [_src("a", 0, 3, **weight(0)), _src("b", 0, 3, weight=0.5)],
                        "parameters": weight(1)},
                       {"sources": [_src("a", 3, 6, **weight(0)), _src("b", 3, 6, weight=0.5)]}],
            "parameters": {"normalize": False, **weight(2)}}


RECIPES = {
    **{f"gradient_at[{level}]": _gradient_at(level) for level in ("global", "slice", "input")},
    # the gradient's numbers written as strings, as mergekit's test writes them too
    "gradient_at[strings]": {**_gradient_at("global"), "parameters": {
        "normalize": False, "weight": [{"filter": "w", "value": ["1e-5", "1e-3"]}]}},
    **{f"resolution[{m}-{'explicit' if e else 'implicit'}_base]": _resolution(m, e)
       for m in ("linear", "ties", "nuslerp") for e in (False, True)},
    **{f"precedence[{i}]": _precedence(i) for i in range(4)},
    # item 2: slices merging different numbers of models (a slice of base + a + c, then base + b)
    "fewer_models[task_arithmetic]": {
        "merge_method": "task_arithmetic", "base_model": "base", "parameters": {"weight": 0.6},
        "slices": [{"sources": [_src("base", 0, 3), _src("a", 0, 3), _src("c", 0, 3, weight=0.3)]},
                   {"sources": [_src("base", 3, 6), _src("b", 2, 5)]}]},
    "fewer_models[linear]": {
        "merge_method": "linear", "parameters": {"weight": 1.0},
        "slices": [{"sources": [_src("a", 0, 2)]}, {"sources": [_src("b", 2, 5), _src("c", 2, 5, weight=2.0)]},
                   {"sources": [_src("a", 5, 6), _src("b", 5, 6), _src("c", 5, 6, weight=0.5)]}]},
    "fewer_models[ties]": {
        "merge_method": "ties", "base_model": "base", "parameters": {"weight": 1.0, "density": 0.5},
        "slices": [{"sources": [_src("base", 0, 4), _src("a", 0, 4), _src("b", 1, 5), _src("c", 0, 4)]},
                   {"sources": [_src("base", 4, 6), _src("c", 4, 6, density=0.3)]}]},
    "fewer_models[slerp]": {  # slerp takes exactly two: mergekit refuses the one-model slice
        "merge_method": "slerp", "base_model": "base", "parameters": {"t": 0.5},
        "slices": [{"sources": [_src("base", 0, 3), _src("a", 0, 3)]}, {"sources": [_src("base", 3, 6)]}]},
    # item 2: passthrough slices with a per-source scale (a filtered one: only o_proj zeroed)
    "passthrough_scale": {
        "merge_method": "passthrough",
        "slices": [{"sources": [_src("a", 0, 3, scale=0.5)]},
                   {"sources": [_src("b", 2, 5, scale=[{"filter": "o_proj", "value": 0.0}, {"value": 1.0}])]},
                   {"sources": [_src("c", 5, 6)]}]},
    # ... and a global scale naming a source layer: b's layer 3 is output layer 2
    "passthrough_scale[layer]": {
        "merge_method": "passthrough", "parameters": {"scale": [{"filter": "layers.3.self_attn", "value": 2.0},
                                                                {"value": 1.0}]},
        "slices": [{"sources": [_src("a", 0, 1)]}, {"sources": [_src("b", 2, 5)], "parameters": {"scale": 1.0}},
                   {"sources": [_src("a", 3, 6)]}]},
    # item 2: per-input filters naming a layer, matched on the source's names: a's layers 3 and 4
    # are output layers 2 and 3 here
    "layer_filter": {
        "merge_method": "task_arithmetic", "base_model": "base",
        "parameters": {"weight": [{"filter": "layers.3.", "value": 0.9}, {"value": 0.4}]},
        "slices": [{"sources": [_src("base", 0, 2), _src("a", 0, 2)]},
                   {"sources": [_src("base", 2, 4), _src("a", 3, 5, weight=[{"filter": "layers.4.mlp", "value": 0.1},
                                                                              {"value": 0.7}])]},
                   {"sources": [_src("base", 4, 6), _src("a", 4, 6)]}]},
    # a source's knob set in slice 0 only: the other slices take the method's default (mergekit's
    # scopes are the source's, its slice's and the global ones), filtered or not set at all there
    "slice_default[unset]": {
        "merge_method": "ties", "base_model": "base", "parameters": {"weight": 1.0},
        "slices": [{"sources": [_src("base", 0, 3), _src("a", 0, 3, density=0.3)]},
                   {"sources": [_src("base", 3, 6), _src("a", 3, 6)]}]},
    "slice_default[filtered]": {
        "merge_method": "ties", "base_model": "base", "parameters": {"weight": 1.0},
        "slices": [{"sources": [_src("base", 0, 3), _src("a", 0, 3, density=0.3)]},
                   {"sources": [_src("base", 3, 6), _src("a", 3, 6, density=[{"filter": "mlp", "value": 0.5}])]}]},
}


# Recipes that differ today (strict: each turns into a failure once it matches, to be unmarked). A
# filter in no tensor name and a parameter the method does not read are dropped by the import with
# a warning, as mergekit ignores them (config/mergekit_ignored.py): none differs.
DIFFERS: dict[str, str] = {}


def _ours(recipe: Path, folder: Path, family: Path) -> tuple[Path | None, str]:
    """import-mergekit + run of `recipe` from the family's folder: (the output or None, stderr)."""
    params = folder.with_suffix(".yaml")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.chdir(family)  # mergekit reads model paths against its working directory
        if main(["import-mergekit", str(recipe), "-o", str(params), "-q"]) != 0:
            return None, err.getvalue()
        data = yaml.safe_load(params.read_text())
        data.update(cache_dir=str(folder.parent / "cache"), block_bytes=4096)
        data["output"]["dir"] = str(folder)
        params.write_text(yaml.safe_dump(data, sort_keys=False))
        if main(["run", str(params), "-q"]) != 0:
            return None, err.getvalue()
    return folder, err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path | None, Path, str | None, str]]:
    """{recipe: (our output or None, mergekit's output, mergekit's error, our stderr)}."""
    root = tmp_path_factory.mktemp("mk_slices")
    family = root / "family"
    _write_family(family)
    jobs = {}
    for name, recipe in RECIPES.items():
        (root / f"{name}.yml").write_text(yaml.safe_dump({**recipe, "dtype": "float32", "out_dtype": "bfloat16"},
                                                         sort_keys=False))
        jobs[name] = (str(root / f"{name}.yml"), str(root / f"theirs-{name}"))
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", RUN, str(root / "jobs.json")], capture_output=True, text=True,
                          timeout=900, cwd=family)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for name in RECIPES:
        ours, err = _ours(root / f"{name}.yml", root / f"ours-{name}", family)
        out[name] = (ours, root / f"theirs-{name}", errors[name], err)
    return out


def _magnitudes(family: Path, recipe: dict, name: str, shape) -> torch.Tensor:
    """A bound on the magnitudes summed into an output tensor: every family model's |x| (any
    layer, the largest), times the largest weight and scale any recipe here gives."""
    total = torch.zeros(shape, dtype=torch.float64)
    for model in MODELS:
        tensors = load_model(family / model)
        same = [t for n, t in tensors.items() if n.split(".")[-2:] == name.split(".")[-2:] and t.shape == shape]
        total += torch.stack([t.double().abs() for t in same]).amax(0)
    return total * 5.0


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=DIFFERS[r]))
                                    if r in DIFFERS else r for r in RECIPES])
def test_slice_recipe_matches_mergekit(recipe, runs):
    ours, theirs, their_error, our_error = runs[recipe]
    if their_error is not None:
        assert ours is None, f"mergekit refused this recipe ({their_error}); mergepipe merged it"
        assert len(our_error.strip().splitlines()) == 1, our_error
        return
    assert ours is not None, f"mergekit merges this recipe; mergepipe refused it: {our_error.strip()}"
    for key in ("num_hidden_layers", "layer_types"):
        assert json.loads((ours / "config.json").read_text()).get(key) == \
            json.loads((theirs / "config.json").read_text()).get(key), key
    mine, ref = load_model(ours), load_model(theirs)
    assert sorted(mine) == sorted(ref)
    family = ours.parent / "family"
    for name, tensor in ref.items():
        assert mine[name].dtype == tensor.dtype == torch.bfloat16 and mine[name].shape == tensor.shape, name
        scale = _magnitudes(family, RECIPES[recipe], name, tensor.shape)
        verdict = judge(mine[name].reshape(-1), tensor.reshape(-1), scale=scale.reshape(-1))
        assert verdict.misses == 0, f"{name}: {verdict}"
