"""Adapters out with PEFT's dense combinations (output.adapter.combination ties_svd,
magnitude_prune_svd, dare_linear_svd, dare_ties_svd; methods/_lora_dense.py) against PEFT
0.21.2: the merged dense Δ before the SVD bit for bit where PEFT's definition is deterministic
(magnitude pruning, sign election, weights; DARE at density 1), DARE's seeded masks (ours, not
PEFT's Bernoulli draws) by their statistics and the truncation error; negative weights;
determinism; the recorded seed in verify --replay; refusals."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.methods._lora_dense import DenseSpec, DenseTerm, merge_dense
from mergepipe.cli import main
from tests.helpers import fails_in_one_line

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
merge_utils = pytest.importorskip("peft.utils.merge_utils")
PREFIX = "base_model.model."
QV = ["q_proj", "v_proj"]


def _model(folder: Path):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _adapter(base: Path, out: Path, *, seed: int, **lora) -> Path:
    torch.manual_seed(seed)
    model = peft.get_peft_model(_model(base), peft.LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-combinations")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    base = root / "base"
    a = _adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=QV)
    shutil.copytree(a, root / "a-copy")
    return {
        "base": base, "a": a, "a-copy": root / "a-copy",
        "b": _adapter(base, root / "b", seed=2, r=4, lora_alpha=16, target_modules=QV),
        "c": _adapter(base, root / "c", seed=3, r=4, lora_alpha=4, use_rslora=True, target_modules=QV),
    }


def _params(tmp_path: Path, fam: dict, experts: list[tuple[str, str, float]], adapter: dict, *,
            tag: str = "out", **extra) -> Path:
    cfg = {"base": str(fam["base"]), "method": "task_arithmetic",
           "experts": [{"name": n, "adapter": str(fam[a]), "weight": w} for n, a, w in experts],
           "output": {"dir": str(tmp_path / tag), "adapter": adapter}, "cache_dir": str(tmp_path / "cache"), **extra}
    path = tmp_path / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _run(tmp_path: Path, fam: dict, experts, adapter: dict, *, tag: str = "out", **extra) -> Path:
    assert main(["run", "-q", str(_params(tmp_path, fam, experts, adapter, tag=tag, **extra))]) == 0
    return tmp_path / tag


def _report(out: Path) -> dict:
    return json.loads((out / "adapter_report.json").read_text())


def _products(out: Path) -> dict[str, torch.Tensor]:
    """B·A (fp64) of every module of an adapter output (scale 1), by module."""
    t = load_file(out / "adapter_model.safetensors")
    return {k[len(PREFIX):-len(".lora_A.weight")]: t[k.replace("lora_A", "lora_B")].double() @ v.double()
            for k, v in t.items() if k.endswith(".lora_A.weight")}


def _peft_deltas(fam: dict, order: list[str]) -> dict[str, list[torch.Tensor]]:
    """PEFT's get_delta_weight of each adapter in `order`, by module."""
    model = peft.PeftModel.from_pretrained(_model(fam["base"]), fam[order[0]], adapter_name=order[0])
    for name in order[1:]:
        model.load_adapter(fam[name], adapter_name=name)
    out = {}
    for module, layer in model.base_model.model.named_modules():
        if hasattr(layer, "lora_A") and (order[0] in layer.lora_A or order[0] in layer.lora_embedding_A):
            with torch.no_grad():
                out[module] = [layer.get_delta_weight(n).detach().clone() for n in order]
    return out


def _peft_factors(fam: dict, order: list[str], weights: list[float], combination: str, **kw):
    """B·A (fp64) by module of PEFT's add_weighted_adapter."""
    model = peft.PeftModel.from_pretrained(_model(fam["base"]), fam[order[0]], adapter_name=order[0])
    for name in order[1:]:
        model.load_adapter(fam[name], adapter_name=name)
    model.add_weighted_adapter(order, weights, "combined", combination_type=combination, **kw)
    state = model.state_dict()
    return {k[len(PREFIX):-len(".lora_A.combined.weight")]:
            state[k.replace("lora_A", "lora_B")].double() @ v.double()
            for k, v in state.items() if k.endswith(".lora_A.combined.weight")}


_PEFT = {"ties_svd": "ties", "magnitude_prune_svd": "magnitude_prune", "dare_linear_svd": "dare_linear",
         "dare_ties_svd": "dare_ties"}


def _theirs(combination: str, deltas: list[torch.Tensor], weights: list[float], density: float, sign: str):
    fn = getattr(merge_utils, _PEFT[combination])
    w = torch.tensor(weights)
    return fn(deltas, w, density, sign) if "ties" in combination else fn(deltas, w, density)


@pytest.mark.parametrize("combination, density, sign", [
    ("ties_svd", 0.5, "total"), ("ties_svd", 0.2, "frequency"), ("ties_svd", 1.0, "total"),
    ("magnitude_prune_svd", 0.3, "total"), ("magnitude_prune_svd", 1.0, "total"),
    ("dare_linear_svd", 1.0, "total"), ("dare_ties_svd", 1.0, "frequency"),
])
def test_the_dense_delta_is_peft_s_bit_for_bit(fam, combination, density, sign):
    """PEFT's own deltas (get_delta_weight) of three adapters, unequal and negative weights: our
    merge of them before the SVD is PEFT's merge_utils result, every bit."""
    order, weights = ["a", "b", "c"], [0.7, -1.3, 0.45]
    for module, deltas in _peft_deltas(fam, order).items():
        terms = [DenseTerm(d, w, torch.Generator().manual_seed(1)) for d, w in zip(deltas, weights)]
        ours = merge_dense(terms, DenseSpec(combination, 4, density, sign))
        with pytest.warns(UserWarning) if density >= 1 else _nothing():
            theirs = _theirs(combination, deltas, weights, density, sign)
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs), module


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("combination, density", [("ties_svd", 0.5), ("magnitude_prune_svd", 0.4),
                                                  ("dare_linear_svd", 1.0)])
@pytest.mark.parametrize("rank", [3, 32])
def test_the_output_truncates_the_merge_as_peft_s_add_weighted_adapter(fam, tmp_path, combination, density, rank):
    """End to end: the written factors' B·A against the dense merge of PEFT's deltas (our Δ_k are
    fixed-order products, PEFT's are BLAS's: equal to rounding), the reported error the optimal one
    (svdvals), and PEFT's add_weighted_adapter's truncation of the same merge as good."""
    weights = {"a": 0.8, "b": -0.6}
    out = _run(tmp_path, fam, [(n, n, w) for n, w in weights.items()],
               {"combination": combination, "rank": rank, "density": density})
    report = _report(out)
    order = report["experts"]
    ws = [weights[n] for n in order]
    ours = _products(out)
    with pytest.warns(UserWarning) if density >= 1 else _nothing():
        peft_ba = _peft_factors(fam, order, ws, combination, svd_rank=rank, density=density,
                                svd_full_matrices=False)  # PEFT's full V does not fit a rank above a side
    for module, deltas in _peft_deltas(fam, order).items():
        with pytest.warns(UserWarning) if density >= 1 else _nothing():
            dense = _theirs(combination, deltas, ws, density, "total").double()
        sigma = torch.linalg.svdvals(dense)
        optimal = float(sigma[rank:].norm() / sigma.norm())
        entry = report["modules"][module]
        assert entry["rank"] == min(rank, *dense.shape)
        assert entry["relative_error"] == pytest.approx(optimal, rel=1e-3, abs=1e-6), module
        error = float((dense - ours[module]).norm() / dense.norm())
        assert error == pytest.approx(optimal, rel=1e-3, abs=1e-5), module
        theirs = float((dense - peft_ba[module]).norm() / dense.norm())
        assert theirs == pytest.approx(error, rel=1e-3, abs=1e-5), module
    assert all(m["relative_error"] > 0.01 for m in report["modules"].values()) == (rank == 3)


def test_dare_s_seeded_masks_match_peft_s_random_ones_in_distribution(fam):
    """Our DARE masks are not PEFT's Bernoulli draws: the kept fraction is within binomial bounds of
    the density, kept entries are Δ/density exactly, and the rank-4 truncation error of the merged Δ
    lies within PEFT's spread over 30 of its random draws."""
    order, weights, density = ["a", "b", "c"], [1.0, 0.5, -0.7], 0.3
    for module, deltas in _peft_deltas(fam, order).items():
        generators = [torch.Generator().manual_seed(100 + k) for k in range(3)]
        terms = [DenseTerm(d, w, g) for d, w, g in zip(deltas, weights, generators)]
        for sparsify in ("dare_linear_svd",):
            single = merge_dense([DenseTerm(deltas[0], 1.0, torch.Generator().manual_seed(7))],
                                 DenseSpec(sparsify, 4, density))
            kept = single != 0
            n = kept.numel()
            assert abs(float(kept.sum()) - density * n) <= 4 * (n * density * (1 - density)) ** 0.5, module
            assert torch.equal(single[kept], deltas[0][kept] / density)
        for combination in ("dare_linear_svd", "dare_ties_svd"):
            ours = _error(merge_dense(terms, DenseSpec(combination, 4, density)), 4)
            theirs = []
            for seed in range(30):
                torch.manual_seed(seed)
                theirs.append(_error(_theirs(combination, deltas, weights, density, "total"), 4))
            spread = torch.tensor(theirs)
            mean, std = float(spread.mean()), float(spread.std())
            assert abs(ours - mean) <= 4 * std + 1e-3, (module, combination, ours, mean, std)


def _error(delta: torch.Tensor, rank: int) -> float:
    sigma = torch.linalg.svdvals(delta.double())
    return float(sigma[rank:].norm() / sigma.norm())


@pytest.mark.parametrize("combination", ["ties_svd", "magnitude_prune_svd", "dare_linear_svd", "dare_ties_svd"])
def test_an_adapter_minus_itself_is_zero(fam, tmp_path, combination):
    """Negative weights subtract: one adapter at +0.9 and (a copy of its folder: one identity, so
    one DARE mask) at -0.9 leaves every module's Δ exactly zero, at any density."""
    out = _run(tmp_path, fam, [("plus", "a", 0.9), ("minus", "a-copy", -0.9)],
               {"combination": combination, "rank": 4, "density": 0.5})
    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors and all(not bool(t.any()) for t in tensors.values())
    assert all(m["relative_error"] == 0.0 for m in _report(out)["modules"].values())


def test_magnitude_prune_at_density_1_is_the_svd_combination(fam, tmp_path):
    experts = [("a", "a", 1.2), ("b", "b", -0.4)]
    dense = _products(_run(tmp_path, fam, experts, {"combination": "magnitude_prune_svd", "rank": 3,
                                                    "density": 1.0}, tag="dense"))
    svd = _products(_run(tmp_path, fam, experts, {"combination": "svd", "rank": 3}, tag="svd"))
    assert dense.keys() == svd.keys()
    for module in dense:
        assert torch.allclose(dense[module], svd[module], rtol=0, atol=1e-6), module


def test_the_bytes_follow_the_recipe_and_seed_only(fam, tmp_path):
    def files(out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    spec = {"combination": "dare_ties_svd", "rank": 3, "density": 0.5}
    first = files(_run(tmp_path, fam, [("a", "a", 0.5), ("b", "b", 1.5)], spec, tag="one"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        second = files(_run(tmp_path, fam, [("b", "b", 1.5), ("a", "a", 0.5)], spec, tag="two"))
    finally:
        torch.set_num_threads(threads)
    assert first == second
    other = files(_run(tmp_path, fam, [("a", "a", 0.5), ("b", "b", 1.5)], spec, tag="three", seed=1))
    assert other["adapter_model.safetensors"] != first["adapter_model.safetensors"]
    man = json.loads(first["manifest.json"])
    assert man["recipe"]["seed"] == 0
    assert man["recipe"]["adapter"] == {"combination": "dare_ties_svd", "rank": 3, "density": 0.5,
                                        "majority_sign_method": "total"}


def test_verify_replays_a_seeded_combination(fam, tmp_path, capsys):
    out = _run(tmp_path, fam, [("a", "a", 1.0), ("c", "c", 0.5)],
               {"combination": "dare_linear_svd", "rank": 2, "density": 0.6}, seed=5)
    assert json.loads((out / "manifest.json").read_text())["recipe"]["seed"] == 5
    capsys.readouterr()
    assert main(["verify", str(out), "--inputs", "--replay"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("adapter, fragments", [
    ({"combination": "ties_svd", "density": 0.5}, ["ties_svd needs a rank"]),
    ({"combination": "ties_svd", "rank": 4}, ["ties_svd needs a density"]),
    ({"combination": "svd", "rank": 4, "density": 0.5}, ["density is for", "not svd"]),
    ({"combination": "magnitude_prune_svd", "rank": 4, "density": 0.5, "majority_sign_method": "total"},
     ["majority_sign_method is for ties_svd and dare_ties_svd"]),
    ({"combination": "dare_linear_svd", "rank": 4, "density": 0}, ["density"]),
    ({"combination": "dare_linear_svd", "rank": 4, "density": 1.5}, ["density"]),
    ({"combination": "linear", "rank": 4}, ["combination"]),
])
def test_bad_settings_are_refused_in_one_line(fam, tmp_path, capsys, adapter, fragments):
    fails_in_one_line(capsys, ["run", str(_params(tmp_path, fam, [("a", "a", 1.0)], adapter))], 2, *fragments)
    assert not (tmp_path / "out").exists()


def test_peft_loads_the_output_and_merges_b_times_a(fam, tmp_path):
    out = _run(tmp_path, fam, [("a", "a", 1.0), ("c", "c", 0.7)],
               {"combination": "dare_ties_svd", "rank": 3, "density": 0.7, "majority_sign_method": "frequency"})
    merged = peft.PeftModel.from_pretrained(_model(fam["base"]), out).merge_and_unload().state_dict()
    base = _model(fam["base"]).state_dict()
    products = _products(out)
    assert products
    for module, ba in products.items():
        name = f"{module}.weight"
        assert torch.allclose(merged[name].double() - base[name].double(), ba, rtol=0, atol=1e-6), module


def test_an_embedding_lora_is_merged_in_the_weight_s_layout_and_factored_as_peft_s(tmp_path_factory, fam):
    """lora_embedding_A/B hold Δᵀ (PEFT's (B·A)ᵀ): the pruning sees Δ as the embedding weight
    (vocab × dim), the written factors hold its transpose, and PEFT merges them back to Δ."""
    root = tmp_path_factory.mktemp("embedding-combinations")
    emb = {n: _adapter(fam["base"], root / n, seed=s, r=4, lora_alpha=8, target_modules=["embed_tokens"])
           for n, s in (("e1", 11), ("e2", 12))}
    both = {**fam, **emb}
    out = _run(tmp_path_factory.mktemp("emb-out"), both, [("e1", "e1", 1.0), ("e2", "e2", -0.5)],
               {"combination": "magnitude_prune_svd", "rank": 32, "density": 0.4})
    order = _report(out)["experts"]
    ws = [{"e1": 1.0, "e2": -0.5}[n] for n in order]
    deltas = _peft_deltas(both, order)["model.embed_tokens"]
    assert deltas[0].shape == (40, 32)  # the weight's layout
    dense = merge_utils.magnitude_prune(deltas, torch.tensor(ws), 0.4).double()
    t = load_file(out / "adapter_model.safetensors")
    key = f"{PREFIX}model.embed_tokens.lora_embedding_"
    ba = t[key + "B"].double() @ t[key + "A"].double()
    assert torch.allclose(ba, dense.T, rtol=0, atol=1e-5)  # full rank (32 = the smaller side): Δ itself
    merged = peft.PeftModel.from_pretrained(_model(fam["base"]), out).merge_and_unload().state_dict()
    base = _model(fam["base"]).state_dict()
    change = merged["model.embed_tokens.weight"].double() - base["model.embed_tokens.weight"].double()
    assert torch.allclose(change, dense, rtol=0, atol=1e-5)
