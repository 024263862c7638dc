"""Recipes that imported but gave another model than mergekit 0.1.5's (issue 26): della,
della_linear, arcee_fusion and sce with `select_topk`, on a family of a shape the other mergekit
tests do not use: Qwen2-like (tied embeddings, bias on q/k/v, hidden size 45 = 3 heads of 15,
one KV head, intermediate 97, vocabulary 301), bf16, base and three experts.

Each recipe runs through `import-mergekit` + `mergepipe run` (block_bytes 4 KiB, so most
tensors span several blocks and the joint scans add across them) and through mergekit's own
`run_merge` with `dtype: float32`, `out_dtype: bfloat16` (docs/design.md "Equivalence with
mergekit"), all in one mergekit process; outputs are compared by tests/helpers/equivalence.py's rule.
- della / della_linear: mergekit's torch.bernoulli (global RNG: no draw of ours can be its) is
  handed our mask for the tensor and model it draws for, and records the keep probabilities it
  asked for. The imported recipe, with mergekit's default rescale, must then give mergekit's
  model, and the probabilities must be mergekit's.
- arcee_fusion: the masks differ only at the threshold (mergekit's fp32 importance within a few ulps of
  ours, which is fp64 rounded to fp32, the same on every CPU); ours is one cut of our importance.
  Also on whole tensors built to be hard: ties, and rows of near-equal importance.
- sce: mergekit keeps an arbitrary subset of the elements tied at the variance threshold (its
  topk), and the selection sets each expert's weight mean(d^2) over the whole tensor, so a
  different subset moves every element of the tensor a little. The test shows that this is
  the only difference: each output is the SCE formula (fp64) at its own selection, and the
  two selections differ only inside the tie.
Skipped without `.venv-mergekit`.
"""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
import yaml
from tests.helpers.joint import run_joint
from safetensors.torch import load_file, save_file

from mergepipe.checkpoint.blocks import block_ranges
from mergepipe.cli import main
from mergepipe.methods._della import della_mask, keep_probabilities
from mergepipe.methods.arcee_fusion import importance_bits
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge, ulp

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, LAYERS = 45, 3, 1, 97, 301, 2
BLOCK_BYTES = 4096
WEIGHTS, DENSITIES, EPSILON = [0.6, 1.0, 0.35], [0.5, 0.3, 0.7], 0.1
EXPERTS = [f"expert_{k}" for k in range(3)]

SCRIPT = r'''
import json, sys
import torch, yaml
from safetensors.torch import load_file, save_file
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit.merge_methods import generalized_task_arithmetic as gta
from mergekit.merge_methods.api import merge_tensors
from mergekit.merge_methods.arcee_fusion import _compute_importance
from mergekit.merge_methods.sce import sce_mask

spec = json.loads(open(sys.argv[1]).read())
drawing = {}  # the tensor being merged and its models in order: whose mask bernoulli hands out
real_merge_group = gta.GeneralizedTaskArithmeticMerge.merge_group
def merge_group(self, group, /, **parameters):
    drawing.update(tensor=group.metadata.name, models=[str(e.id) for e in group.non_base], next=0)
    return real_merge_group(self, group, **parameters)
gta.GeneralizedTaskArithmeticMerge.merge_group = merge_group
real_bernoulli = torch.bernoulli

def handing_out(masks, recorded):
    def bernoulli(p, *args, **kwargs):
        model_id = drawing["models"][drawing["next"]]
        drawing["next"] += 1
        name = next(n for n, path in spec["models"].items() if path in model_id)
        key = drawing["tensor"] + "|" + name
        recorded[key] = p.clone()
        return masks[key].to(p.dtype).reshape(p.shape)
    return bernoulli

for job in spec["recipes"]:
    recorded = {}
    if job.get("masks"):
        torch.bernoulli = handing_out(load_file(job["masks"]), recorded)
    try:
        config = MergeConfiguration.model_validate(yaml.safe_load(open(job["yaml"])))
        run_merge(config, job["out"], MergeOptions(lazy_unpickle=False, copy_tokenizer=False,
                                                    write_model_card=False))
    finally:
        torch.bernoulli = real_bernoulli
    if recorded:
        save_file({k: v.contiguous() for k, v in recorded.items()}, job["probs"])

inputs = load_file(spec["inputs"])
out = {}
for name in spec["tensors"]:  # the family's tensors: mergekit's importance and sce selection
    base = inputs[name + "|base"]
    out[name + "|importance"] = _compute_importance(inputs[name + "|expert_0"], base).contiguous()
    deltas = torch.stack([inputs[name + "|" + e] - base for e in ("expert_0", "expert_1", "expert_2")])
    out[name + "|sce_mask"] = sce_mask(deltas, 0.5, torch.float32).contiguous()
for case in spec["fusion_cases"]:  # whole tensors, fp32
    base, expert = inputs[case + "|base"], inputs[case + "|expert"]
    out[case + "|importance"] = _compute_importance(expert, base).contiguous()
    out[case + "|merged"] = merge_tensors([base, expert], "arcee_fusion", base_index=0,
                                          dtype=torch.float32).contiguous()
save_file(out, spec["result"])
'''


def _shapes() -> dict[str, tuple[int, ...]]:
    head = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (KV_HEADS * head, HIDDEN), p + "self_attn.k_proj.bias": (KV_HEADS * head,),
            p + "self_attn.v_proj.weight": (KV_HEADS * head, HIDDEN), p + "self_attn.v_proj.bias": (KV_HEADS * head,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN), p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)})
    return shapes


def _qwen2_config() -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "use_sliding_window": False, "torch_dtype": "bfloat16"}


def _write_family(root) -> dict[str, dict[str, torch.Tensor]]:
    """base and three bf16 experts, expert k's deltas of scale 0.01 (k + 1): bf16 rounding
    leaves many equal |delta| in a row and equal variances across experts."""
    g = torch.Generator().manual_seed(26)
    base = {n: (torch.randn(s, generator=g) * 0.05 + (1.0 if "norm" in n else 0.0)).to(torch.bfloat16)
            for n, s in _shapes().items()}
    models = {"base": base}
    for k, name in enumerate(EXPERTS):
        models[name] = {n: (t.float() + torch.randn(t.shape, generator=g) * 0.01 * (k + 1)).to(torch.bfloat16)
                        for n, t in base.items()}
    for name, tensors in models.items():
        (root / name).mkdir(parents=True)
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(_qwen2_config()))
    return models


def _recipes(paths: dict[str, str]) -> dict[str, dict]:
    weighted = [{"model": paths[e], "parameters": {"weight": w, "density": d}}
                for e, w, d in zip(EXPERTS, WEIGHTS, DENSITIES)]
    recipes = {
        "della": {"merge_method": "della", "base_model": paths["base"], "models": weighted,
                  "parameters": {"epsilon": EPSILON}},
        "della_linear": {"merge_method": "della_linear", "base_model": paths["base"], "models": weighted,
                         "parameters": {"epsilon": EPSILON}},
        "arcee_fusion": {"merge_method": "arcee_fusion", "base_model": paths["base"],
                         "models": [{"model": paths["expert_0"]}]},
        "sce": {"merge_method": "sce", "base_model": paths["base"], "models": [{"model": paths[e]} for e in EXPERTS],
                "parameters": {"select_topk": 0.5}},
    }
    return {name: {**r, "dtype": "float32", "out_dtype": "bfloat16"} for name, r in recipes.items()}


def _run_ours(folder, recipe: dict, cache, extra: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """import-mergekit then run; returns the output's tensors and its manifest's plan."""
    (folder / "mergekit.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    params_file = folder / "params.yaml"
    assert main(["import-mergekit", str(folder / "mergekit.yaml"), "-o", str(params_file), "-q"]) == 0
    params = yaml.safe_load(params_file.read_text())
    params.update(output={**params["output"], "dir": str(folder / "out")}, cache_dir=str(cache),
                  block_bytes=BLOCK_BYTES)
    params["parameters"] = {**params.get("parameters", {}), **(extra or {})}
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    assert main(["run", str(params_file), "-q"]) == 0
    plan = json.loads((folder / "out" / "manifest.json").read_text())["plan"]
    return load_file(folder / "out" / "model.safetensors"), plan


def _our_masks(plan: dict, models: dict) -> dict[str, torch.Tensor]:
    """The della masks our run drew, per (tensor, expert): block by block at the plan's layout."""
    base, masks = models["base"], {}
    for e in plan["experts"]:
        for name, w0 in base.items():
            delta = models[e["name"]][name].float() - w0.float()
            parts = []
            for r0, r1 in block_ranges(tuple(w0.shape), 2, plan["block_bytes"]):
                rows = delta[r0:r1] if delta.dim() >= 2 else delta
                keep, _ = della_mask(rows, e["density"], plan["parameters"]["epsilon"], plan["seed"],
                                     e["content_hash"], name, r0)
                parts.append(keep)
            masks[f"{name}|{e['name']}"] = torch.cat(parts).float()
    return masks


def _fusion_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Whole tensors (base, expert), fp32 of bf16 values, where the cut is hard to get right:
    - ties: 40 equal rows, |delta| one of three values (10%, 75%, 15% of a row), so the three
      quartiles are one value that 75% of the elements share, and the threshold is that value;
    - near_equal: one |delta| everywhere and rows that are permutations of one (base, expert)
      pair: every row's KL is one number but for the order of its sums, and fp32's rounding
      of it (mergekit's importance) alone decides which rows are kept."""
    g = torch.Generator().manual_seed(261)

    def grid(n: int) -> torch.Tensor:  # multiples of 2^-9 below 0.4: bf16, and so is each value + delta here
        return ((torch.randn(n, generator=g) * 0.05).clamp(-0.4, 0.4) * 512).round() / 512

    row = grid(64)
    levels = torch.tensor([2.0**-9, 2.0**-7, 2.0**-5])[(torch.rand(64, generator=g) > 0.1).long()
                                                       + (torch.rand(64, generator=g) > 0.85).long()]
    signs = torch.randint(0, 2, (64,), generator=g).float() * 2 - 1
    ties = (row.repeat(40, 1), (row + levels * signs).to(torch.bfloat16).float().repeat(40, 1))
    vector = grid(96)
    signs = torch.randint(0, 2, (96,), generator=g).float() * 2 - 1
    moved = (vector + signs * 2.0**-8).to(torch.bfloat16).float()
    perms = torch.stack([torch.randperm(96, generator=g) for _ in range(120)])
    near = (vector[perms], moved[perms])
    for (b, e), magnitudes in ((ties, 3), (near, 1)):
        assert torch.equal(b + (e - b), e) and len((e - b).abs().unique()) == magnitudes  # exact deltas
    return {"ties": ties, "near_equal": near}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    models = _write_family(tmp / "family")
    paths = {name: str(tmp / "family" / name) for name in models}
    recipes = _recipes(paths)
    ours, plans, jobs = {}, {}, []
    for name, recipe in recipes.items():
        (tmp / name).mkdir()
        ours[name], plans[name] = _run_ours(tmp / name, recipe, tmp / "cache")
        job = {"yaml": str(tmp / name / "mergekit.yaml"), "out": str(tmp / name / "mk_out")}
        if name.startswith("della"):
            save_file(_our_masks(plans[name], models), tmp / name / "masks.safetensors")
            job.update(masks=str(tmp / name / "masks.safetensors"), probs=str(tmp / name / "probs.safetensors"))
        jobs.append(job)
    (tmp / "della_p").mkdir()
    ours["della_p"], plans["della_p"] = _run_ours(tmp / "della_p", recipes["della"], tmp / "cache",
                                                  {"rescale_mode": "keep_probability"})
    inputs = {f"{t}|{m}": models[m][t].float() for m in models for t in models["base"]}
    for case, (base, expert) in _fusion_cases().items():
        inputs.update({f"{case}|base": base, f"{case}|expert": expert})
    save_file(inputs, tmp / "inputs.safetensors")
    spec = {"recipes": jobs, "models": {e: paths[e] for e in EXPERTS}, "inputs": str(tmp / "inputs.safetensors"),
            "tensors": sorted(models["base"]), "fusion_cases": sorted(_fusion_cases()),
            "result": str(tmp / "result.safetensors")}
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", SCRIPT, str(tmp / "spec.json")], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = {name: load_file(tmp / name / "mk_out" / "model.safetensors") for name in recipes}
    probs = {name: load_file(tmp / name / "probs.safetensors") for name in recipes if name.startswith("della")}
    return {"models": models, "ours": ours, "plans": plans, "theirs": theirs, "probs": probs,
            "extra": load_file(tmp / "result.safetensors")}


def _della_scale(models: dict, name: str) -> torch.Tensor:
    """A bound on the magnitudes summed into an element: |W0| + sum_k w_k r_k (|W_k| + |W0|), r_k =
    1 / (density_k - epsilon) bounding the L1 rescale of kept elements."""
    w0 = models["base"][name].double().abs()
    return w0 + sum(w / (d - EPSILON) * (models[e][name].double().abs() + w0)
                    for e, w, d in zip(EXPERTS, WEIGHTS, DENSITIES))


@pytest.mark.parametrize("recipe", ["della", "della_linear"])
def test_imported_della_is_mergekits_model_with_its_rescale(parity, recipe):
    assert parity["plans"][recipe]["parameters"]["rescale_mode"] == "l1"  # mergekit's, by default
    ours, theirs, models = parity["ours"][recipe], parity["theirs"][recipe], parity["models"]
    assert set(theirs) <= set(ours) and len(theirs) == len(models["base"])
    identical = compared = 0
    for name, reference in theirs.items():
        got = ours[name]
        assert got.dtype == reference.dtype == torch.bfloat16, name
        verdict = judge(got.reshape(-1), reference.reshape(-1), scale=_della_scale(models, name).reshape(-1))
        assert verdict.misses == 0, f"{name}: {verdict}"
        identical, compared = identical + verdict.identical, compared + verdict.compared
    assert identical > 0.5 * compared


def test_della_keep_probability_is_the_explicit_option(parity):
    """The paper's 1/p rescale when asked for: another model than mergekit's."""
    assert parity["plans"]["della_p"]["parameters"]["rescale_mode"] == "keep_probability"
    name = "model.embed_tokens.weight"
    verdict = judge(parity["ours"]["della_p"][name].reshape(-1), parity["theirs"]["della"][name].reshape(-1),
                    scale=_della_scale(parity["models"], name).reshape(-1))
    assert verdict.misses > 0.1 * verdict.compared


@pytest.mark.parametrize("recipe", ["della", "della_linear"])
def test_della_keep_probabilities_are_mergekits(parity, recipe):
    """Per row the same probabilities as a set; element by element wherever |delta| is unique in
    its row (tied magnitudes: mergekit's unstable sort orders them its own way)."""
    models, probs = parity["models"], parity["probs"][recipe]
    assert len(probs) == len(models["base"]) * len(EXPERTS)
    tied_somewhere = False
    for expert, density in zip(EXPERTS, DENSITIES):
        for name, w0 in models["base"].items():
            delta = models[expert][name].float() - w0.float()
            rows = delta.reshape(1, -1) if delta.dim() < 2 else delta
            ours = keep_probabilities(rows, density, EPSILON)
            theirs = probs[f"{name}|{expert}"].reshape(rows.shape)
            assert torch.equal(ours.sort(dim=1).values, theirs.sort(dim=1).values), (name, expert)
            magnitudes = rows.abs()
            unique = (magnitudes.unsqueeze(2) == magnitudes.unsqueeze(1)).sum(2) == 1
            assert torch.equal(ours[unique], theirs[unique]), (name, expert)
            tied_somewhere |= bool((~unique).any())
    assert tied_somewhere  # the family has tied magnitudes


def _assert_one_cut(importance: torch.Tensor, kept: torch.Tensor, where: str) -> None:
    """kept is exactly {importance >= t} for one t: no kept importance below a dropped one."""
    if bool(kept.any()) and bool((~kept).any()):
        assert float(importance[kept].min()) >= float(importance[~kept].max()), where


def _our_importance(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    rows = base.reshape(1, -1) if base.dim() < 2 else base
    bits = importance_bits(rows.numpy(), delta.reshape(rows.shape).numpy(), tuple(base.shape))
    return torch.from_numpy(bits.view(np.float32).copy()).reshape(base.shape)


def _exact_importance(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The formula in fp64 (torch's double kernels), rounded to fp32."""
    rows = (base.reshape(1, -1) if base.dim() < 2 else base).double()
    d = delta.reshape(rows.shape).double()
    p, q = torch.softmax(rows + d, dim=-1) + 1e-8, torch.softmax(rows, dim=-1) + 1e-8
    return (d.abs() * (p * torch.log(p / q)).sum(-1, keepdim=True)).float().reshape(base.shape)


def _assert_differs_only_within_mergekits_noise(ours: torch.Tensor, theirs: torch.Tensor, mine: torch.Tensor,
                                                mergekits: torch.Tensor, where: str) -> int:
    """mergekit computes the importance in fp32 (its KL cancels: p/q is near 1), so each of its
    values is ours give or take `band`, the largest gap between the two. Where the masks
    disagree, our importance is within 2 bands of our threshold: mergekit's noise crossed it."""
    differ = ours != theirs
    if not bool(differ.any()):
        return 0
    band = float((mine.double() - mergekits.double()).abs().max())
    threshold = float(mine[ours].min()) if bool(ours.any()) else float(mine.max())
    assert float((mine[differ].double() - threshold).abs().max()) <= 2 * band, where
    return int(differ.sum())


def test_imported_arcee_fusion_is_mergekits_model_but_for_its_noise(parity):
    """Each element is the base's or the expert's bits; the masks differ only where mergekit's
    fp32 importance cannot tell an element from the threshold; ours is one cut of ours."""
    models, extra = parity["models"], parity["extra"]
    ours, theirs = parity["ours"]["arcee_fusion"], parity["theirs"]["arcee_fusion"]
    assert set(theirs) <= set(ours)
    differ = 0
    for name, reference in theirs.items():
        base, expert = models["base"][name], models["expert_0"][name]
        assert bool(((ours[name] == base) | (ours[name] == expert)).all()), name
        changed = base != expert
        mine = _our_importance(base.float(), (expert.float() - base.float()))
        kept_ours, kept_theirs = (ours[name] == expert)[changed], (reference == expert)[changed]
        _assert_one_cut(mine[changed], kept_ours, name)
        differ += _assert_differs_only_within_mergekits_noise(
            kept_ours, kept_theirs, mine[changed], extra[f"{name}|importance"].reshape(base.shape)[changed], name)
    print(f"arcee_fusion: {differ} changed elements kept by one of mergekit and mergepipe only")


def test_arcee_fusion_importance_is_the_formula_on_every_cpu(parity):
    """Our importance is the formula in fp64 rounded to fp32 (within an ulp): no CPU-dependent
    fp32 kernel enters it, so the mask is the same on every machine."""
    models = parity["models"]
    for name, w0 in models["base"].items():
        base, delta = w0.float(), models["expert_0"][name].float() - w0.float()
        mine, exact = _our_importance(base, delta), _exact_importance(base, delta)
        assert bool(((mine.double() - exact.double()).abs() <= ulp(exact, torch.float32)).all()), name


@pytest.mark.parametrize("case", ["ties", "near_equal"])
def test_arcee_fusion_on_hard_tensors_cuts_once(parity, case):
    base, expert = _fusion_cases()[case]
    extra = parity["extra"]
    delta = expert - base
    ours = run_joint("arcee_fusion", {}, base, [{"name": "e0", "hash": "00", "weight": 1.0, "delta": delta}],
                     boundaries=[7, 13, 29])
    mine = _our_importance(base, delta)
    kept = ours == expert
    _assert_one_cut(mine, kept, case)
    _assert_differs_only_within_mergekits_noise(kept, extra[f"{case}|merged"] == expert, mine,
                                                extra[f"{case}|importance"], case)
    if case == "near_equal":  # in exact arithmetic every importance is one value: every element is at the cut
        assert bool(kept.all()) and mine.unique().numel() <= 2
    else:  # the cut is at a value that most elements share
        assert 0 < int(kept.sum()) < kept.numel()
        assert int((mine == mine[kept].min()).sum()) > kept.numel() // 2


def _sce_formula(base: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SCE in fp64 at a given selection (mergekit's formula), rounded to bf16."""
    d = deltas.double() * mask.double()
    w = (d ** 2).reshape(d.shape[0], -1).mean(1)
    w = w / w.sum() if float(w.sum()) >= 1e-6 else torch.full_like(w, 1 / d.shape[0])
    sign = torch.where(d.sum(0) >= 0, 1.0, -1.0).double()
    erased = w.reshape((-1,) + (1,) * (d.dim() - 1)) * (torch.sign(d) == sign).double()
    return (base.double() + (d * erased).sum(0) / erased.sum(0).clamp(min=1e-6)).to(torch.bfloat16)


def _our_sce_mask(deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(our selection, the elements tied at the threshold): the k largest variances, ties in flat
    order, with the variance as mergepipe computes it (equal to torch.var here, checked)."""
    var = torch.var(deltas, dim=0, unbiased=False).reshape(-1)
    k = int(np.float32(int((var != 0).sum())) * np.float32(0.5))
    threshold = var.sort(descending=True).values[k - 1]
    tied = var == threshold
    keep = var > threshold
    keep[tied.nonzero().reshape(-1)[:k - int(keep.sum())]] = True
    return keep.reshape(deltas.shape[1:]), tied.reshape(deltas.shape[1:])


def test_sce_differs_from_mergekit_only_through_the_tie_at_its_threshold(parity):
    from mergepipe.methods.sce import _var_bits

    models, extra = parity["models"], parity["extra"]
    ours, theirs = parity["ours"]["sce"], parity["theirs"]["sce"]
    ties_chosen_apart = 0
    for name, w0 in models["base"].items():
        base = w0.float()
        deltas = torch.stack([models[e][name].float() - base for e in EXPERTS])
        var_ours = _var_bits(deltas.reshape(3, -1).numpy()).view(np.float32)
        assert np.array_equal(var_ours, torch.var(deltas, dim=0, unbiased=False).reshape(-1).numpy())
        mine, tied = _our_sce_mask(deltas)
        mergekits = extra[f"{name}|sce_mask"].bool()
        assert int(mine.sum()) == int(mergekits.sum())
        assert torch.equal(mine[~tied], mergekits[~tied]), name  # the selections differ only inside the tie
        scale = sum(models[m][name].double().abs() for m in models).reshape(-1)
        for out, mask in ((ours[name], mine), (theirs[name], mergekits)):
            verdict = judge(out.reshape(-1), _sce_formula(base, deltas, mask).reshape(-1), scale=scale)
            assert verdict.misses == 0, f"{name}: {verdict}"
        if torch.equal(mine, mergekits):  # the same selection: the same model by the rule
            verdict = judge(ours[name].reshape(-1), theirs[name].reshape(-1), scale=scale)
            assert verdict.misses == 0, f"{name}: {verdict}"
        else:
            ties_chosen_apart += 1
    assert ties_chosen_apart > 0  # the family has the case the issue saw
