"""mergekit `slices:` that merge (issue 26 item 2): several slices with other layer ranges per
source, per-slice and per-source parameters, gradients over a slice, a per-slice base, through
`import-mergekit` + `run`, against mergekit 0.1.5's own output (tests/helpers/equivalence.py's ulp
rule) on a Llama-shaped fp32 family of 6 layers, untied head, merged to bf16; all recipes in one mergekit
process. Refusals are one line. Skipped without `.venv-mergekit` (the refusals and the
config.json checks are not).
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergepipe.cli import main
from mergepipe.commands.stack import build_stack
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, ulp

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 6, 16, 24, 40
MODELS = ("base", "a", "b", "c")

SCRIPT = r'''
import json, sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
for job in json.loads(open(sys.argv[1]).read()):
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(open(job["yaml"]))), job["out"],
              MergeOptions(lazy_unpickle=False, copy_tokenizer=False, write_model_card=False))
'''


def _config(layers: int = LAYERS, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": 2, "num_key_value_heads": 1,
            "num_hidden_layers": layers, "vocab_size": VOCAB, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
            "torch_dtype": "float32", **extra}


def _shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (8, HIDDEN),
                       p + "self_attn.v_proj.weight": (8, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)})
    return shapes


def _write_family(root, **config_extra) -> None:
    g = torch.Generator().manual_seed(2602)
    base = {n: torch.randn(s, generator=g) * 0.05 + (1.0 if "norm" in n else 0.0) for n, s in _shapes().items()}
    for k, name in enumerate(MODELS):  # fp32: no two |delta| of a tensor tie at a TIES threshold
        tensors = base if k == 0 else {n: w + torch.randn(w.shape, generator=g) * 0.01 * k for n, w in base.items()}
        (root / name).mkdir(parents=True)
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(_config(**config_extra)))


def _src(model: str, start: int, end: int, **parameters) -> dict:
    extra = {"parameters": parameters} if parameters else {}
    return {"model": f"family/{model}", "layer_range": [start, end], **extra}


RECIPES = {
    # 5 output layers; the second slice takes other layers of `a` than of the base
    "slerp": {"merge_method": "slerp", "base_model": "family/base",
              "parameters": {"t": [{"filter": "mlp", "value": 0.5}, {"value": 0.2}]},
              "slices": [{"sources": [_src("base", 0, 2), _src("a", 0, 2)],
                          "parameters": {"t": [{"filter": "self_attn", "value": [0, 1]}]}},
                         {"sources": [_src("base", 2, 4), _src("a", 3, 5)], "parameters": {"t": 0.3}},
                         {"sources": [_src("base", 5, 6), _src("a", 5, 6)]}]},
    # per-source weights (one a gradient over its slice), a slice with its own base, lambda per slice
    "task_arithmetic": {"merge_method": "task_arithmetic", "base_model": "family/base",
                        "parameters": {"weight": 0.4},
                        "slices": [{"sources": [_src("base", 0, 3), _src("a", 0, 3, weight=0.6),
                                                _src("b", 0, 3, weight=[0.2, 0.8])]},
                                   {"base_model": "family/a", "parameters": {"lambda": 0.7, "weight": 0.9},
                                    "sources": [_src("a", 3, 6), _src("b", 2, 5), _src("c", 3, 6, weight=0.3)]}]},
    # lambda set by slice 0 only: slice 1 takes the method's default (1.0), not slice 0's 0.7
    "task_arithmetic_first_lambda": {
        "merge_method": "task_arithmetic", "base_model": "family/base",
        "slices": [{"parameters": {"lambda": 0.7},
                    "sources": [_src("base", 0, 3), _src("a", 0, 3, weight=0.6), _src("b", 0, 3, weight=0.5)]},
                   {"sources": [_src("base", 3, 6), _src("a", 3, 6, weight=0.6), _src("b", 3, 6, weight=0.5)]}]},
    # densities per source and per slice; 4 output layers
    "ties": {"merge_method": "ties", "base_model": "family/base",
             "parameters": {"weight": 1.0, "density": 0.5},
             "slices": [{"sources": [_src("base", 0, 2), _src("a", 0, 2, density=0.3), _src("c", 1, 3)]},
                        {"parameters": {"density": 0.7, "normalize": False},
                         "sources": [_src("base", 4, 6), _src("a", 4, 6, weight=0.5), _src("c", 3, 5)]}]},
    # no base: the first source of each slice plays it (its weight averaged in)
    "linear": {"merge_method": "linear",
               "slices": [{"sources": [_src("a", 0, 4, weight=1.0), _src("b", 0, 4, weight=2.0)]},
                          {"sources": [_src("b", 4, 6, weight=1.0), _src("c", 2, 4, weight=3.0)]}]},
}
OUT_LAYERS = {"slerp": 5, "task_arithmetic": 6, "task_arithmetic_first_lambda": 6, "ties": 4, "linear": 6}


def _load(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """{recipe: (ours, mergekit's or None, our output folder)}."""
    root = tmp_path_factory.mktemp("slices")
    _write_family(root / "family")
    jobs, ours = [], {}
    for name, recipe in RECIPES.items():
        mk = root / f"{name}.yml"
        mk.write_text(yaml.safe_dump({**recipe, "dtype": "float32", "out_dtype": "bfloat16"}, sort_keys=False))
        params = root / f"{name}.yaml"
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(root)  # mergekit reads model paths against its working directory
            assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
        data = yaml.safe_load(params.read_text())
        data.update(cache_dir=str(root / "cache"), block_bytes=4096)
        params.write_text(yaml.safe_dump(data, sort_keys=False))
        assert main(["run", str(params), "-q"]) == 0
        ours[name] = root / f"merged-{name}"
        jobs.append({"yaml": str(mk), "out": str(root / f"mk-{name}")})
    theirs = {}
    if MERGEKIT_PYTHON.exists():
        (root / "jobs.json").write_text(json.dumps(jobs))
        proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", SCRIPT, str(root / "jobs.json")], cwd=root,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        theirs = {name: _load(root / f"mk-{name}") for name in RECIPES}
    return {name: (_load(ours[name]), theirs.get(name), ours[name]) for name in RECIPES}


@pytest.mark.slow
@pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                    reason=f"mergekit reference venv not found; create it with: {INSTALL}")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sliced_recipe_gives_mergekits_model(merged, recipe):
    ours, theirs, _ = merged[recipe]
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        a, b = tensor.double(), theirs[name].double()
        assert tensor.dtype == theirs[name].dtype == torch.bfloat16, name
        assert bool(((a - b).abs() <= ulp(torch.maximum(a.abs(), b.abs()), tensor.dtype)).all()), name


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sliced_output_renumbers_layers_and_records_sources(merged, recipe):
    ours, _, folder = merged[recipe]
    n = OUT_LAYERS[recipe]
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == n
    assert {int(k.split(".")[2]) for k in ours if k.startswith("model.layers.")} == set(range(n))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "stack.json" in manifest["outputs"]["files"]  # the base view's sources, hashed
    groups = manifest["plan"]["tensor_parameters"]
    assert set(groups["tensors"]) == set(ours)


def test_stack_sets_layer_types_from_its_sources(tmp_path):
    _write_family(tmp_path / "family", layer_types=[f"kind{i}" for i in range(LAYERS)])
    roots = {m: tmp_path / "family" / m for m in ("base", "a")}
    out = build_stack([{"model": "base", "layer_range": [1, 3]}, {"model": "a", "layer_range": [4, 6]}], roots,
                      tmp_path / "stacked")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["layer_types"] == ["kind1", "kind2", "kind4", "kind5"]


@pytest.mark.parametrize(("slices", "message"), [
    ([{"sources": [_src("base", 0, 2), _src("a", 0, 3)]}],
     r"slices\[0\]\.sources: layer ranges of lengths \[2, 3\]; all inputs to a slice must contain the same"),
    ([{"sources": [_src("base", 0, 3), _src("a", 0, 3)]}, {"sources": [_src("b", 3, 6), _src("a", 3, 6)]}],
     r"slices\[1\]\.sources: the base model 'family/base' is not among them"),
    ([{"sources": [_src("base", 0, 3), _src("a", 0, 3)]},
      {"sources": [_src("base", 3, 6), _src("a", 3, 6), _src("b", 3, 6)]}],
     r"slices\[1\]\.sources: merges 2 model\(s\) besides its base, slices\[0\] 1; slices merging different "
     r"numbers of models are built for linear, task_arithmetic, ties, not model_stock"),
    ([{"sources": [_src("base", 0, 3), _src("base", 0, 3)]}],
     r"slices\[0\]\.sources\[1\]\.model: 'family/base' is twice"),
])
def test_sliced_refusals_are_one_line(tmp_path, monkeypatch, capsys, slices, message):
    _write_family(tmp_path / "family")
    monkeypatch.chdir(tmp_path)
    # model_stock counts its models: a slice merging fewer cannot be filled with the base
    method = "model_stock" if "numbers of models" in message else "task_arithmetic"
    (tmp_path / "mk.yml").write_text(yaml.safe_dump({"merge_method": method, "base_model": "family/base",
                                                     "parameters": {"weight": 1.0}, "slices": slices}))
    assert main(["import-mergekit", "mk.yml", "-o", "p.yaml", "-q"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    import re
    assert re.search(message, err), err
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "p.slices").exists()
