"""mergekit `modules:` recipes (issue 26 item 3): per-module parameters and per-module model
settings of a VLM (text decoder, vision tower, projector), through `import-mergekit` + `run`,
against mergekit 0.1.5's own output (tests/helpers/equivalence.py's ulp rule) on a Qwen2.5-VL-shaped
fp32 family (3 text layers, 2 vision blocks, a projector) and a T5-shaped one (encoder, decoder,
shared), merged to bf16; all recipes in one mergekit process. mergekit 0.1.5 has one
merge_method for every module (a module's own is ignored), so the recipes differ per module in
parameters, weights and models, not in method. The module facts are checked against mergekit's
own architecture definitions.
Refusals are one line. Skipped without `.venv-mergekit` (the refusals and the params checks
are not).
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergepipe.cli import main
from mergepipe.config.mergekit_modules import ARCHITECTURES
from mergepipe.config.modules import ModuleConfig, module_of
from mergepipe.config.params import config_from_dict
from mergepipe.config.tensor_params import resolve_tensor_parameters
from mergepipe.errors import ConfigError
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, ulp

TEXT_LAYERS, VISION_LAYERS, HIDDEN, INTERMEDIATE, VOCAB, VISION = 3, 2, 16, 24, 40, 8
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


def _config() -> dict:
    text = {"model_type": "qwen2_5_vl_text", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": TEXT_LAYERS,
            "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    vision = {"model_type": "qwen2_5_vl", "depth": VISION_LAYERS, "hidden_size": VISION, "out_hidden_size": HIDDEN,
              "intermediate_size": 2 * VISION, "num_heads": 2, "in_channels": 3, "patch_size": 2,
              "temporal_patch_size": 2, "spatial_merge_size": 2}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "torch_dtype": "float32", "tie_word_embeddings": False, "text_config": text, "vision_config": vision}


def _shapes() -> dict[str, tuple[int, ...]]:
    merged = 4 * VISION  # the projector's input: spatial_merge_size**2 patches
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN), "visual.patch_embed.proj.weight": (VISION, 3, 2, 2, 2),
              "visual.merger.ln_q.weight": (VISION,), "visual.merger.mlp.0.weight": (merged, merged),
              "visual.merger.mlp.0.bias": (merged,), "visual.merger.mlp.2.weight": (HIDDEN, merged),
              "visual.merger.mlp.2.bias": (HIDDEN,)}
    for i in range(TEXT_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": (HIDDEN,),
                       p + "self_attn.k_proj.weight": (8, HIDDEN), p + "self_attn.k_proj.bias": (8,),
                       p + "self_attn.v_proj.weight": (8, HIDDEN), p + "self_attn.v_proj.bias": (8,),
                       p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)})
    for i in range(VISION_LAYERS):
        p = f"visual.blocks.{i}."
        shapes.update({p + "norm1.weight": (VISION,), p + "norm2.weight": (VISION,),
                       p + "attn.qkv.weight": (3 * VISION, VISION), p + "attn.qkv.bias": (3 * VISION,),
                       p + "attn.proj.weight": (VISION, VISION), p + "attn.proj.bias": (VISION,),
                       **{p + f"mlp.{m}.weight": (2 * VISION, VISION) for m in ("gate_proj", "up_proj")},
                       **{p + f"mlp.{m}.bias": (2 * VISION,) for m in ("gate_proj", "up_proj")},
                       p + "mlp.down_proj.weight": (VISION, 2 * VISION), p + "mlp.down_proj.bias": (VISION,)})
    return shapes


T5_CONFIG = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": HIDDEN,
             "d_ff": INTERMEDIATE, "d_kv": 8, "num_heads": 2, "num_layers": 2, "num_decoder_layers": 3,
             "vocab_size": VOCAB,
             "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 8, "tie_word_embeddings": False,
             "is_encoder_decoder": True, "torch_dtype": "float32"}


def _t5_shapes() -> dict[str, tuple[int, ...]]:
    """T5 with its three modules: encoder, decoder, shared (the embeddings and the untied head)."""
    shapes = {n: (VOCAB, HIDDEN) for n in ("shared.weight", "encoder.embed_tokens.weight",
                                           "decoder.embed_tokens.weight", "lm_head.weight")}
    ff = {"DenseReluDense.wi_0.weight": (INTERMEDIATE, HIDDEN), "DenseReluDense.wi_1.weight": (INTERMEDIATE, HIDDEN),
          "DenseReluDense.wo.weight": (HIDDEN, INTERMEDIATE), "layer_norm.weight": (HIDDEN,)}
    attn = {f"{m}.weight": (HIDDEN, HIDDEN) for m in ("q", "k", "v", "o")}
    stacks = (("encoder", 2, ("SelfAttention",)), ("decoder", 3, ("SelfAttention", "EncDecAttention")))
    for stack, layers, parts in stacks:
        shapes[f"{stack}.final_layer_norm.weight"] = (HIDDEN,)
        shapes[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (8, 2)
        for i in range(layers):
            for j, part in enumerate(parts):
                shapes.update({f"{stack}.block.{i}.layer.{j}.{part}.{k}": v for k, v in attn.items()})
                shapes[f"{stack}.block.{i}.layer.{j}.layer_norm.weight"] = (HIDDEN,)
            shapes.update({f"{stack}.block.{i}.layer.{len(parts)}.{k}": v for k, v in ff.items()})
    return shapes


def _write_family(root, config: dict | None = None, shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    g = torch.Generator().manual_seed(2603)
    base = {n: torch.randn(s, generator=g) * 0.05 + (1.0 if "norm" in n or "ln_q" in n else 0.0)
            for n, s in (shapes or _shapes()).items()}
    for k, name in enumerate(MODELS):  # fp32: no two |delta| of a tensor tie at a TIES threshold
        tensors = base if k == 0 else {n: w + torch.randn(w.shape, generator=g) * 0.01 * k for n, w in base.items()}
        (root / name).mkdir(parents=True)
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(config or _config()))


def _m(model: str, **parameters) -> dict:
    return {"model": f"family/{model}", **({"parameters": parameters} if parameters else {})}


def _src(model: str, layers: int, **parameters) -> dict:
    return {**_m(model, **parameters), "layer_range": [0, layers]}


RECIPES = {
    # lambda on the text decoder only, a weight gradient over the vision tower's own 2 layers
    "task_arithmetic": {"merge_method": "task_arithmetic", "base_model": "family/base", "parameters": {"weight": 0.5},
                        "modules": {"text_decoder": {"models": [_m("a", weight=0.7), _m("b")],
                                                     "parameters": {"lambda": 0.9}},
                                    "vision_tower": {"models": [_m("a", weight=[0.1, 0.9]), _m("b")]},
                                    "multi_modal_projector": {"models": [_m("a"), _m("b", weight=0.2)],
                                                              "parameters": {"normalize": True}}}},
    # densities per module and per model, a filtered density on the text decoder
    "ties": {"merge_method": "ties", "base_model": "family/base", "parameters": {"weight": 1.0, "density": 0.5},
             "modules": {"text_decoder": {"models": [_m("a", density=0.3), _m("b"), _m("c", weight=0.5)],
                                          "parameters": {"density": [{"filter": "mlp", "value": 0.8}]}},
                         "vision_tower": {"models": [_m("a"), _m("b", density=0.9), _m("c")],
                                          "parameters": {"density": 0.7}},
                         "multi_modal_projector": {"models": [_m("a"), _m("b"), _m("c")],
                                                   "parameters": {"normalize": False}}}},
    # t per module: a gradient over the text layers, a filter on the vision tower, one t on the projector
    "slerp": {"merge_method": "slerp", "base_model": "family/base", "parameters": {"t": 0.5},
              "modules": {"text_decoder": {"models": [_m("base"), _m("a")], "parameters": {"t": [0.1, 0.9]}},
                          "vision_tower": {"models": [_m("a")],
                                           "parameters": {"t": [{"filter": "attn", "value": 0.25}]}},
                          "multi_modal_projector": {"models": [_m("a")], "parameters": {"t": 0.8}}}},
    # each module as one slice over all its layers (the projector's 2 are mergekit's fixed count), slice parameters
    "slices": {"merge_method": "task_arithmetic", "base_model": "family/base", "parameters": {"weight": 0.4},
               "modules": {name: {"slices": [{"sources": [_src("base", n), _src("a", n, weight=w), _src("b", n)],
                                              **({"parameters": {"lambda": 1.5}} if name == "vision_tower" else {})}],
                                  "parameters": {"lambda": 0.6}}
                           for name, n, w in (("text_decoder", TEXT_LAYERS, [0.2, 1.0]),
                                              ("vision_tower", VISION_LAYERS, 0.5),
                                              ("multi_modal_projector", 2, 0.9))}},
    # a model left out of a module: weight 0 there (linear in the weights), normalized in one module
    "partial": {"merge_method": "task_arithmetic", "base_model": "family/base", "parameters": {"weight": 0.6},
                "modules": {"text_decoder": {"models": [_m("a"), _m("b", weight=0.3)]},
                            "vision_tower": {"models": [_m("c", weight=0.8)], "parameters": {"lambda": 1.2}},
                            "multi_modal_projector": {"models": [_m("b"), _m("c")],
                                                      "parameters": {"normalize": True}}}},
    # the vision tower kept from the base (its module lists only the base)
    "base_only": {"merge_method": "task_arithmetic", "base_model": "family/base", "parameters": {"weight": 0.5},
                  "modules": {"text_decoder": {"models": [_m("a"), _m("b")], "parameters": {"lambda": 0.8}},
                              "vision_tower": {"models": [_m("base")]},
                              "multi_modal_projector": {"models": [_m("a"), _m("base")]}}},
    # linear with a base averaged in, models left out of modules
    "linear_partial": {"merge_method": "linear", "base_model": "family/base",
                       "modules": {"text_decoder": {"models": [_m("base", weight=1.0), _m("a", weight=2.0)]},
                                   "vision_tower": {"models": [_m("base", weight=0.5), _m("b", weight=0.5),
                                                               _m("c", weight=[1.0, 2.0])]},
                                   "multi_modal_projector": {"models": [_m("base", weight=1.0), _m("a", weight=1.5)]}}},
    # T5: the encoder, the decoder (a weight gradient over its 3 blocks) and the shared embeddings and head
    "t5": {"merge_method": "task_arithmetic", "base_model": "t5/base", "parameters": {"weight": 0.5},
           "modules": {"encoder": {"models": [{"model": "t5/a"}, {"model": "t5/b"}], "parameters": {"lambda": 0.7}},
                       "decoder": {"models": [{"model": "t5/a", "parameters": {"weight": [0.2, 1.0]}},
                                              {"model": "t5/b"}]},
                       "shared": {"models": [{"model": "t5/b", "parameters": {"weight": 0.9}}]}}},
    # no base: the first model plays it, its weight averaged in, per module
    "linear": {"merge_method": "linear",
               "modules": {"text_decoder": {"models": [_m("a", weight=1.0), _m("b", weight=3.0)]},
                           "vision_tower": {"models": [_m("a", weight=2.0), _m("b", weight=1.0)]},
                           "multi_modal_projector": {"models": [_m("a", weight=1.0), _m("b", weight=1.0)]}}},
}


def _load(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """{recipe: (ours, mergekit's or None, our output folder, mergekit's output folder)}."""
    root = tmp_path_factory.mktemp("modules")
    _write_family(root / "family")
    _write_family(root / "t5", T5_CONFIG, _t5_shapes())
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
    return {name: (_load(ours[name]), theirs.get(name), ours[name], root / f"mk-{name}") for name in RECIPES}


@pytest.mark.slow
@pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                    reason=f"mergekit reference venv not found; create it with: {INSTALL}")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_modules_recipe_gives_mergekits_model(merged, recipe):
    ours, theirs, ours_dir, theirs_dir = merged[recipe]
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        a, b = tensor.double(), theirs[name].double()
        assert tensor.dtype == theirs[name].dtype == torch.bfloat16, name
        assert bool(((a - b).abs() <= ulp(torch.maximum(a.abs(), b.abs()), tensor.dtype)).all()), name
    mine, mk = (json.loads((d / "config.json").read_text()) for d in (ours_dir, theirs_dir))
    for cfg in (mine, mk):  # transformers 5 writes `dtype`, older ones `torch_dtype`
        cfg["dtype"] = cfg.pop("torch_dtype", cfg.get("dtype"))
    assert mine["architectures"] == mk["architectures"] and mine["dtype"] == mk["dtype"] == "bfloat16"
    if recipe == "t5":
        layers = ("num_layers", "num_decoder_layers")
        assert [mine[k] for k in layers] == [mk[k] for k in layers] == [2, 3]
        return
    assert mine["text_config"]["num_hidden_layers"] == mk["text_config"]["num_hidden_layers"] == TEXT_LAYERS
    assert mine["vision_config"]["depth"] == mk["vision_config"]["depth"] == VISION_LAYERS


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_module_takes_its_own_settings(merged, recipe):
    """The plan's per-tensor groups give each module's tensors that module's settings."""
    ours, _, folder, _ = merged[recipe]
    plan = json.loads((folder / "manifest.json").read_text())["plan"]["tensor_parameters"]
    assert set(plan["tensors"]) == set(ours)
    group = {name: plan["groups"][i] for name, i in plan["tensors"].items()}
    if recipe == "task_arithmetic":
        assert group["model.layers.0.mlp.up_proj.weight"]["parameters"]["lambda"] == 0.9
        assert group["visual.blocks.0.mlp.up_proj.weight"]["parameters"]["lambda"] == 1.0
        assert group["visual.blocks.1.attn.qkv.weight"]["experts"]["a"]["weight"] == pytest.approx(0.9)
        assert group["visual.merger.mlp.0.weight"]["experts"]["b"]["weight"] == 0.2
    if recipe == "slerp":
        assert group["model.layers.1.self_attn.q_proj.weight"]["parameters"]["t"] == pytest.approx(0.5)
        assert group["visual.blocks.0.attn.qkv.weight"]["parameters"]["t"] == 0.25
        assert group["visual.blocks.0.mlp.up_proj.weight"]["parameters"]["t"] == 0.5
        assert group["visual.merger.mlp.2.bias"]["parameters"]["t"] == 0.8
    if recipe == "slices":
        assert group["model.layers.2.mlp.up_proj.weight"]["parameters"]["lambda"] == 0.6
        assert group["model.layers.2.mlp.up_proj.weight"]["experts"]["a"]["weight"] == 1.0
        assert group["visual.blocks.1.mlp.up_proj.weight"]["parameters"]["lambda"] == 1.5
    if recipe == "base_only":
        assert group["visual.blocks.1.mlp.up_proj.weight"]["experts"] == {"a": {"weight": 0.0}, "b": {"weight": 0.0}}
    if recipe == "partial":
        assert group["visual.blocks.0.attn.qkv.weight"]["experts"] == {"a": {"weight": 0.0}, "b": {"weight": 0.0},
                                                                       "c": {"weight": 0.8}}
        assert group["model.layers.0.mlp.up_proj.weight"]["experts"]["c"] == {"weight": 0.0}


@pytest.mark.parametrize("form", ["models", "slices"])
def test_default_module_of_a_one_module_model_is_the_models_form(tmp_path, monkeypatch, form):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
    _write_family(tmp_path / "family", config)
    monkeypatch.chdir(tmp_path)
    models = [_m("a", weight=0.6), _m("b", weight=0.3)]
    common = {"merge_method": "task_arithmetic", "base_model": "family/base", "parameters": {"lambda": 0.8}}
    module = {"models": models} if form == "models" else \
        {"slices": [{"sources": [{**m, "layer_range": [0, 2]} for m in models]}]}
    (tmp_path / "m.yml").write_text(yaml.safe_dump({**common, "modules": {"default": module}}))
    (tmp_path / "f.yml").write_text(yaml.safe_dump({**common, "models": models}))
    assert main(["import-mergekit", "m.yml", "-o", "m.yaml", "-q"]) == 0
    assert main(["import-mergekit", "f.yml", "-o", "f.yaml", "-q"]) == 0
    mods, flat = (yaml.safe_load((tmp_path / f).read_text()) for f in ("m.yaml", "f.yaml"))
    for params in (mods, flat):
        params["output"].pop("mergekit_config")
        params["output"].pop("dir")
    assert mods == flat and "modules" not in mods


def _qwen_refusal(tmp_path, monkeypatch, capsys, modules, config=None, **top) -> str:
    _write_family(tmp_path / "family", config)
    monkeypatch.chdir(tmp_path)
    recipe = {"merge_method": "task_arithmetic", "base_model": "family/base", "parameters": {"weight": 1.0},
              **top, "modules": modules}
    recipe = {k: v for k, v in recipe.items() if v is not None}
    (tmp_path / "mk.yml").write_text(yaml.safe_dump(recipe))
    assert main(["import-mergekit", "mk.yml", "-o", "p.yaml", "-q"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "p.yaml").exists()
    return err


_ALL = {"text_decoder": {"models": [_m("a")]}, "vision_tower": {"models": [_m("a")]},
        "multi_modal_projector": {"models": [_m("a")]}}


@pytest.mark.parametrize(("modules", "message"), [
    ({**_ALL, "language_model": {"models": [_m("a")]}},
     r"modules\.language_model: architecture Qwen2_5_VLForConditionalGeneration has no such module; its "
     r"modules: text_decoder, vision_tower, multi_modal_projector"),
    ({"text_decoder": {"models": [_m("a")]}},
     r"modules: leaves out vision_tower, multi_modal_projector of Qwen2_5_VLForConditionalGeneration; mergekit "
     r"0\.1\.5 writes no tensor of a module left out"),
    ({**_ALL, "vision_tower": {"models": [_m("a")], "merge_method": "linear"}},
     r"modules\.vision_tower\.merge_method: mergekit 0\.1\.5 merges every module with the top-level merge_method"),
    ({"text_decoder": {"models": [_m("a"), _m("b")]}, "vision_tower": {"models": [_m("a")]},
      "multi_modal_projector": {"models": [_m("a"), _m("b")]}},
     r"modules\.vision_tower\.models: leaves out \['family/b'\], which other modules merge: only methods linear in "
     r"the weights \(linear, task_arithmetic\) can leave a model out of one module"),
    ({**_ALL, "vision_tower": {"models": [_m("base")]}},
     r"modules\.vision_tower\.models: leaves out \['family/a'\], which other modules merge: only methods linear"),
    ({**_ALL, "multi_modal_projector": {"models": [_m("a", weight=[0, 1])]}},
     r"modules\.multi_modal_projector: a\.weight is a gradient; mergekit 0\.1\.5 evaluates this module's tensors"),
    ({**_ALL, "vision_tower": {"slices": [{"sources": [_src("a", 1)]}]}},
     r"modules\.vision_tower\.slices\[0\]\.sources\[0\]\.layer_range: \[0, 1\] is not every layer of vision_tower "
     r"\(it has 2\); slices of part of a module are not built"),
    ({**_ALL, "vision_tower": {"slices": [{"sources": [_src("a", 1)]}, {"sources": [_src("a", 1)]}]}},
     r"modules\.vision_tower\.slices: several slices in a module are not built"),
    ({**_ALL, "vision_tower": {"slices": [{"sources": [_src("a", 2)], "base_model": "family/a"}]}},
     r"modules\.vision_tower\.slices\[0\]\.base_model: not built inside a module"),
    ({**_ALL, "vision_tower": {"models": [_m("a")], "slices": [{"sources": [_src("a", 2)]}]}},
     r"modules\.vision_tower: give models or slices, not both"),
    ({**_ALL, "vision_tower": {"models": [_m("a")], "residual": 1}},
     r"modules\.vision_tower\.residual: unknown module key; expected models, slices, parameters"),
])
def test_modules_refusals_are_one_line(tmp_path, monkeypatch, capsys, modules, message):
    err = _qwen_refusal(tmp_path, monkeypatch, capsys, modules, merge_method="ties")
    assert re.search(message, err), err


def test_an_architecture_without_known_modules_is_named(tmp_path, monkeypatch, capsys):
    err = _qwen_refusal(tmp_path, monkeypatch, capsys, {"decoder": {"models": [_m("a")]}},
                        {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    assert re.search(r"modules\.decoder: architecture 'LlamaForCausalLM' has no modules mergepipe knows "
                     r"\(mergekit 0\.1\.5 defines modules for .*Qwen2_5_VLForConditionalGeneration.*\); a "
                     r"one-module model's only module is default", err), err


def test_whisper_decoder_is_refused_as_mergekit_fails_on_it(tmp_path, monkeypatch, capsys):
    err = _qwen_refusal(tmp_path, monkeypatch, capsys,
                        {"encoder": {"models": [_m("a")]}, "decoder": {"models": [_m("a")]}},
                        {"architectures": ["WhisperForConditionalGeneration"], "encoder_layers": 2})
    assert "modules.decoder: mergekit 0.1.5 names this module's tensors without a dot" in err, err


def test_modules_on_different_bases_are_refused(tmp_path, monkeypatch, capsys):
    modules = {"text_decoder": {"models": [_m("a", weight=1), _m("b", weight=1)]},
               "vision_tower": {"models": [_m("b", weight=1), _m("a", weight=1)]},
               "multi_modal_projector": {"models": [_m("a", weight=1), _m("b", weight=1)]}}
    err = _qwen_refusal(tmp_path, monkeypatch, capsys, modules, merge_method="linear", base_model=None)
    assert "modules.vision_tower.models: merges on 'family/b', the first module on 'family/a'; every module " \
           "merges onto one base" in err, err


def test_modules_and_models_together_are_refused(tmp_path, monkeypatch, capsys):
    err = _qwen_refusal(tmp_path, monkeypatch, capsys, _ALL, models=[_m("a")])
    assert "mk.yml: models: give one of models, slices or modules" in err, err


def _params(**extra) -> dict:
    return {"base": "b", "experts": [{"name": "e", "path": "e", "weight": 1.0}], "method": "task_arithmetic",
            **extra}


@pytest.mark.parametrize(("extra", "message"), [
    ({"modules": {"x": {"prefixes": ["model."]}, "y": {"prefixes": ["model."]}}},
     "modules.y.prefixes: 'model.' is also modules.x's"),
    ({"modules": {"x": {"prefixes": ["model."], "experts": {"f": {"weight": 1}}}}},
     "modules.x.experts.f: not an expert of this config"),
    ({"modules": {"x": {"prefixes": ["model."], "parameters": {"lambda": "big"}}}}, "modules.x.parameters.lambda"),
    ({"modules": {"x": {"prefixes": ["model."]}}, "slices": [{"layers": [0, 2]}]},
     "modules: give slices or modules, not both"),
])
def test_params_modules_are_checked(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(_params(**extra))


def test_a_config_without_modules_keeps_its_normalized_form():
    assert "modules" not in config_from_dict(_params()).normalized()


def test_a_tensor_in_no_module_is_named():
    cfg = config_from_dict(_params(modules={"text_decoder": {"prefixes": ["model.layers.", "lm_head."]},
                                            "vision_tower": {"prefixes": ["visual."]}}))
    groups = resolve_tensor_parameters(cfg, ["model.layers.0.mlp.weight", "visual.blocks.0.qkv.weight"])
    assert set(groups["tensors"]) == {"model.layers.0.mlp.weight", "visual.blocks.0.qkv.weight"}
    with pytest.raises(ConfigError, match=r"modules: tensor 'model\.visual\.blocks\.0\.qkv\.weight' is in no "
                                          r"module \(no prefix starts it\)"):
        resolve_tensor_parameters(cfg, ["model.layers.0.mlp.weight", "model.visual.blocks.0.qkv.weight"])


DEFINITIONS = r'''
import json, sys
from mergekit.architecture.json_definitions import NAME_TO_ARCH
out = {}
for arch in json.loads(sys.argv[1]):
    info = NAME_TO_ARCH[arch][0]
    out[arch] = {}
    for name, module in info.modules.items():
        d = module.architecture.definition
        weights = d.pre_weights + d.layer_templates.weights + d.post_weights
        out[arch][name] = {"names": [(module.weight_prefix or "") + w.name.replace("${layer_index}", "0")
                                     for w in weights],
                           "layers": d.override_num_layers if d.override_num_layers is not None
                           else d.num_layers_config_key}
print(json.dumps(out))
'''


@pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                    reason=f"mergekit reference venv not found; create it with: {INSTALL}")
def test_module_facts_put_every_tensor_mergekit_lists_in_its_module():
    """Every tensor name mergekit 0.1.5's definitions list for a module (layer 0) falls in that
    module by our prefixes, and the layer counts name the same config key or fixed count."""
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", DEFINITIONS, json.dumps(sorted(ARCHITECTURES))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch, facts in ARCHITECTURES.items():
        assert set(theirs[arch]) == set(facts), arch
        prefixes = {name: ModuleConfig(prefixes=list(f.prefixes)) for name, f in facts.items()}
        for name, module in theirs[arch].items():
            layers = facts[name].layers
            assert module["layers"] == (layers if isinstance(layers, int) else layers[0]), (arch, name)
            if facts[name].broken:  # Whisper's decoder: mergekit's names lack the dot after the prefix
                assert all(not n.startswith(facts[name].prefixes) for n in module["names"]), (arch, name)
                continue
            assert all(module_of(n, prefixes) == name for n in module["names"]), (arch, name)
