"""A PEFT LoRA adapter as an expert (checkpoint/lora.py): its tensors against PEFT's own
merge_and_unload(), merges of adapters and dense experts against merges of the experts they
stand for, PEFT's conventions (rsLoRA, rank and alpha patterns, fan_in_fan_out, embeddings,
modules_to_save, LoRA biases), and the adapters that are refused, each in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergepipe.checkpoint.lora import AdapterCheckpoint, LoraReader, open_adapter
from mergepipe.checkpoint.lora_config import parse_settings
from mergepipe.checkpoint.safetensors import CheckpointReader, as_tensor, open_checkpoint
from mergepipe.cli import main
from mergepipe.errors import ConfigError
from mergepipe.index.store import Store
from tests.helpers.equivalence import EPS32, RESIDUE_ULPS, merge_scale, ulp
from tests.helpers import load_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _config(**extra):
    return transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                    attention_bias=True, max_position_embeddings=64, **extra)


def _model(folder: Path, dtype=torch.float32):
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype)


def _adapter(base: Path, out: Path, *, dtype=torch.float32, seed: int = 1, perturb=None, **lora) -> Path:
    """A LoRA adapter of `base` made by peft, its B random (not PEFT's zeros), saved as PEFT does."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(_model(base, dtype), peft.LoraConfig(init_lora_weights=False, **lora))
    if perturb is not None:
        with torch.no_grad():
            perturb(model)
    model.save_pretrained(out)
    return out


def _bump_saved_modules(model) -> None:
    """Train-like changes where PEFT keeps whole tensors or biases (else they equal the base)."""
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if "modules_to_save" in name or name.endswith("lora_B.default.bias"):
            p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> dict[str, Path]:
    """An untied tiny Llama (fp32, attention biases), a bf16 copy, a dense expert and adapters."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    model.save_pretrained(root / "base")
    model.to(torch.bfloat16).save_pretrained(root / "base16")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.float().parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "dense")
    base = root / "base"
    return {
        "root": root, "base": base, "base16": root / "base16", "dense": root / "dense",
        "r4": _adapter(base, root / "r4", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "rslora": _adapter(base, root / "rslora", seed=2, r=8, lora_alpha=16, use_rslora=True,
                           target_modules="all-linear"),
        "patterns": _adapter(base, root / "patterns", seed=3, r=4, lora_alpha=8,
                             target_modules=["q_proj", "o_proj"],
                             rank_pattern={"layers.1.self_attn.q_proj": 2},
                             alpha_pattern={"o_proj": 3}),
        "embedding": _adapter(base, root / "embedding", seed=4, r=4, lora_alpha=4,
                              target_modules=["embed_tokens", "k_proj"], modules_to_save=["lm_head"],
                              perturb=_bump_saved_modules),
        "bias": _adapter(base, root / "bias", seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                         lora_bias=True, perturb=_bump_saved_modules),
        "bf16": _adapter(root / "base16", root / "bf16", dtype=torch.bfloat16, seed=6, r=8, lora_alpha=8,
                         target_modules="all-linear"),
    }


def _virtual(fam: dict, name: str, base: str = "base") -> AdapterCheckpoint:
    return open_adapter(fam[name], open_checkpoint(fam[base]), "0" * 64)


def _tensors(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as its reader returns it (a virtual one's: base + Δ)."""
    with CheckpointReader(ckpt, random_access=False) as reader:
        return {name: as_tensor(reader.read_range(t, t.begin, t.end), t.dtype, t.shape)
                for name, t in ckpt.tensors.items()}


def _peft_merged(fam: dict, name: str, base: str = "base", dtype=torch.float32) -> dict[str, torch.Tensor]:
    model = peft.PeftModel.from_pretrained(_model(fam[base], dtype), fam[name]).merge_and_unload()
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def _magnitudes(ckpt: AdapterCheckpoint, name: str, base: torch.Tensor) -> torch.Tensor:
    """|W| + |scale| Σ_k |L_ik R_kj|: the magnitudes summed into each element of W + Δ."""
    delta = ckpt.adapter.deltas.get(name)
    mags = base.double().abs()
    if delta is None:
        return mags
    if delta.vector is not None:
        return mags + abs(delta.scale) * delta.vector.double().abs()
    return mags + abs(delta.scale) * (delta.left.double().abs() @ delta.right.double().abs())


def _compare(ours: torch.Tensor, theirs: torch.Tensor, mags: torch.Tensor) -> tuple[int, int]:
    """(identical, compared); asserts every element is within one ulp of the larger of the two,
    or within RESIDUE_ULPS fp32 roundings of the magnitudes summed into it (PEFT's fp32 product
    is a BLAS reduction whose order, FMA use and so last bits follow the CPU; ours is a fixed-order
    sum: both are within a few roundings of the exact value, not of each other's last bit)."""
    a, b = ours.double(), theirs.double()
    diff = (a - b).abs()
    allowed = torch.maximum(ulp(torch.maximum(a.abs(), b.abs()), ours.dtype), RESIDUE_ULPS * EPS32 * mags)
    bad = diff > allowed
    worst = float((diff / allowed).max())
    assert not bool(bad.any()), f"{int(bad.sum())} elements outside the rule, worst {worst}x"
    return int((a == b).sum()), a.numel()


ADAPTERS = ["r4", "rslora", "patterns", "embedding", "bias"]


@pytest.mark.parametrize("name", [*ADAPTERS, "bf16"])
def test_an_adapter_expert_is_peft_merge_and_unload(fam, name, capsys):
    base = "base16" if name == "bf16" else "base"
    ckpt = _virtual(fam, name, base)
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    ours, theirs = _tensors(ckpt), _peft_merged(fam, name, base, dtype)
    base_tensors = load_model(fam[base])
    assert ours.keys() == theirs.keys() == base_tensors.keys()
    identical = compared = 0
    for tensor, got in ours.items():
        assert got.dtype == base_tensors[tensor].dtype and got.shape == base_tensors[tensor].shape
        if tensor in ckpt.adapter.deltas:
            same, n = _compare(got, theirs[tensor], _magnitudes(ckpt, tensor, base_tensors[tensor]))
            identical, compared = identical + same, compared + n
        else:  # not a LoRA target: the base's bytes, or the adapter's whole tensor (modules_to_save)
            assert torch.equal(got, theirs[tensor]), tensor
    assert compared > 0
    with capsys.disabled():
        print(f"\n[lora] {name}: {identical} of {compared} LoRA target elements bit-identical to PEFT's")


def test_patterns_bias_and_modules_to_save_are_peft_s(fam):
    patterns = _virtual(fam, "patterns").adapter.deltas
    assert patterns["model.layers.1.self_attn.q_proj.weight"].left.shape[1] == 2  # rank_pattern
    assert patterns["model.layers.1.self_attn.q_proj.weight"].scale == 8 / 2
    assert patterns["model.layers.0.self_attn.o_proj.weight"].scale == 3 / 4  # alpha_pattern
    assert _virtual(fam, "rslora").adapter.deltas["model.layers.0.mlp.up_proj.weight"].scale == 16 / 8 ** 0.5
    embedding = _virtual(fam, "embedding").adapter
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= embedding.replaced.keys()
    bias = _virtual(fam, "bias").adapter.deltas
    assert bias["model.layers.0.self_attn.q_proj.bias"].vector is not None


def test_pattern_keys_match_modules_as_peft_does():
    from peft.utils.other import get_pattern_key
    patterns = {"q_proj": 2, r"layers\.1\.self_attn\.v_proj": 3, "^model.layers.0.mlp.up_proj": 5, "proj": 7,
                "k_proj|o_proj": 9}
    settings = parse_settings({"peft_type": "LORA", "r": 8, "rank_pattern": patterns}, "adapter_config.json")
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj",
               "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj",
               "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "lm_head",
               "model.layers.0.self_attn.xq_proj"]
    for module in modules:
        key = get_pattern_key(patterns.keys(), module)
        assert settings.rank_of(module) == patterns.get(key, 8), module


def test_fan_in_fan_out_transposes_delta(fam, tmp_path):
    """A synthetic adapter of a Conv1D-style layer (weight stored [in, out]): Δ = scale (B A)ᵀ."""
    base = open_checkpoint(fam["base"])
    name = "model.layers.0.mlp.up_proj.weight"  # [64, 32]: read as in=64, out=32
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(4, 64, generator=g), torch.randn(32, 4, generator=g)
    folder = tmp_path / "fifo"
    folder.mkdir()
    key = "base_model.model.model.layers.0.mlp.up_proj"
    save_file({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 6, "fan_in_fan_out": True}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    ckpt = open_adapter(folder, base, "0" * 64)
    got = _tensors(ckpt)[name]
    w = load_model(fam["base"])[name]
    exact = w.double() + 1.5 * (b.double() @ a.double()).T
    _compare(got, exact.float(), _magnitudes(ckpt, name, w))
    (folder / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": False}))
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.up_proj': B·A is \[32, 64\], the base's"):
        open_adapter(folder, base, "0" * 64)


def test_reads_give_the_same_bytes_however_they_are_cut(fam):
    """A block's bytes do not depend on the reads around it (the index hashes blocks one by one,
    the engine reads runs of them): ranges that cut through rows and tensors, and runs of rows."""
    ckpt = _virtual(fam, "rslora")
    whole = {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in _tensors(ckpt).items()}
    f = ckpt.files[0]
    t0 = ckpt.tensors["model.layers.0.mlp.up_proj.weight"]
    with CheckpointReader(ckpt) as reader:
        assert isinstance(reader, LoraReader)
        cuts = [(t0.begin + 5, t0.begin + 999), (t0.begin + 130, t0.end + 77), (f.data_start, f.size)]
        for begin, end in cuts:
            got = bytes(reader.read_range(t0, begin, end))
            want = b"".join(whole[t.name][max(begin, t.begin) - t.begin:min(end, t.end) - t.begin]
                            for t in ckpt.tensors.values() if t.begin < end and t.end > begin)
            assert got == want
        rows = [bytes(reader.read_rows(t0.name, r, r + 1)) for r in range(t0.shape[0])]
        assert b"".join(rows) == whole[t0.name]
        assert bytes(reader.read_blocks(t0.name, [(0, 7), (7, 30), (30, 64)])[1]) == b"".join(rows[7:30])


def _materialise(tensors: dict[str, torch.Tensor], like: Path, out: Path) -> Path:
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    shutil.copy(like / "config.json", out / "config.json")
    return out


def _run(tmp_path: Path, fam: dict, experts: list[dict], tag: str, budget: str = "full") -> tuple[Path, dict]:
    cfg = {"base": str(fam["base"]), "experts": experts, "method": "task_arithmetic",
           "parameters": {"lambda": 0.8}, "budget": budget, "block_bytes": "4KiB",
           "output": {"dir": str(tmp_path / f"out-{tag}")},
           "cache_dir": str(tmp_path / "cache")}
    path = tmp_path / f"params-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", "-q", str(path)]) == 0
    out = tmp_path / f"out-{tag}"
    return out, json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("budget", ["full", "40%"])
def test_a_merge_of_adapters_and_a_dense_expert_is_the_merge_of_the_experts_they_stand_for(fam, tmp_path,
                                                                                           budget):
    names = ("r4", "rslora")
    ours = {n: _materialise(_tensors(_virtual(fam, n)), fam["base"], tmp_path / f"ours-{n}") for n in names}
    peft_made = {n: _materialise(_peft_merged(fam, n), fam["base"], tmp_path / f"peft-{n}") for n in names}
    weights = {"r4": 1.0, "rslora": -0.5, "dense": 0.7}
    dense = {"name": "dense", "path": str(fam["dense"]), "weight": weights["dense"]}
    with_adapters = [{"name": n, "adapter": str(fam[n]), "weight": weights[n]} for n in names] + [dense]
    out, man = _run(tmp_path, fam, with_adapters, "adapters", budget)
    out_ours, man_ours = _run(tmp_path, fam, [{"name": n, "path": str(p), "weight": weights[n]}
                                              for n, p in ours.items()] + [dense], "ours", budget)
    out_peft, _ = _run(tmp_path, fam, [{"name": n, "path": str(p), "weight": weights[n]}
                                       for n, p in peft_made.items()] + [dense], "peft", budget)
    # an adapter's expert is the dense expert of its bytes: same content hash, plan reads, output bytes
    hashes = [[e["content_hash"] for e in m["plan"]["experts"]] for m in (man, man_ours)]
    assert hashes[0] == hashes[1]
    assert man["plan"]["reads"] == man_ours["plan"]["reads"]
    assert (out / "model.safetensors").read_bytes() == (out_ours / "model.safetensors").read_bytes()
    # against PEFT's materialised experts: as close as the experts are to each other
    merged, merged_peft = load_file(out / "model.safetensors"), load_file(out_peft / "model.safetensors")
    ours_t = {n: load_file(p / "model.safetensors") for n, p in ours.items()}
    peft_t = {n: load_file(p / "model.safetensors") for n, p in peft_made.items()}
    base, dense_t = load_model(fam["base"]), load_model(fam["dense"])
    identical = total = 0
    for tensor, got in merged.items():
        apart = sum(0.8 * abs(weights[n]) * (ours_t[n][tensor].double() - peft_t[n][tensor].double()).abs()
                    for n in ours)
        experts = [*(ours_t[n][tensor] for n in ours), dense_t[tensor]]
        rounding = RESIDUE_ULPS * EPS32 * merge_scale(base[tensor], experts, list(weights.values()), lam=0.8)
        diff = (got.double() - merged_peft[tensor].double()).abs()
        assert bool((diff <= apart + rounding).all()), tensor
        identical, total = identical + int((diff == 0).sum()), total + got.numel()
    assert identical > total // 2


def test_an_adapter_index_is_cached_by_content(fam, tmp_path):
    store = Store(tmp_path / "cache")
    base, base_index = store.model_index(fam["base"], block_bytes=4096)
    folder = tmp_path / "r4"
    shutil.copytree(fam["r4"], folder)
    ckpt, index, _ = store.expert_index(folder, base, base_index)
    assert isinstance(ckpt, AdapterCheckpoint) and store.builds == 2
    dense = _materialise(_tensors(ckpt), fam["base"], tmp_path / "dense-r4")
    assert store.expert_index(dense, base, base_index)[1].content_hash == index.content_hash
    builds = store.builds
    again = Store(tmp_path / "cache")
    assert again.expert_index(folder, base, base_index)[1].content_hash == index.content_hash
    assert again.builds == 0 and again.hits == 2  # model and delta index
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    changed = store.expert_index(folder, base, base_index)[1]
    assert changed.content_hash != index.content_hash and store.builds == builds + 1


def _write_params(tmp_path: Path, fam: dict, expert: dict) -> Path:
    cfg = {"base": str(fam["base"]), "experts": [expert], "method": "task_arithmetic",
           "output": {"dir": str(tmp_path / "out")}, "cache_dir": str(tmp_path / "cache")}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fails(capsys, argv: list[str], code: int, *fragments: str) -> None:
    capsys.readouterr()  # what making the adapter printed
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def _broken(fam: dict, tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(fam["r4"], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file(edit(tensors), folder / "adapter_model.safetensors")
    return folder


def _dora(fam, tmp_path):
    return _adapter(fam["base"], tmp_path / "dora", r=4, lora_alpha=8, target_modules=["q_proj"],
                    use_dora=True)


def _ia3(fam, tmp_path):
    model = peft.get_peft_model(_model(fam["base"]), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                                    feedforward_modules=["down_proj"]))
    model.save_pretrained(tmp_path / "ia3")
    return tmp_path / "ia3"


def _missing_target(fam, tmp_path):
    return _broken(fam, tmp_path, "missing",
                   lambda ts: {k.replace("layers.1.", "layers.7."): v for k, v in ts.items()})


def _shape_mismatch(fam, tmp_path):
    other = tmp_path / "wide"
    transformers.LlamaForCausalLM(_config(head_dim=16)).save_pretrained(other)
    return _adapter(other, tmp_path / "mismatch", r=4, lora_alpha=8, target_modules=["q_proj"])


def _pickle_only(fam, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(fam["r4"], folder)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")  # never read, so any bytes
    return folder


@pytest.mark.parametrize("make, fragments", [
    (_dora, ["use_dora", "DoRA is not supported"]),
    (_ia3, ["peft_type: 'IA3'", "only LORA adapters"]),
    (_missing_target, ["module 'model.layers.7.self_attn.q_proj'", "not in the base"]),
    (_shape_mismatch, ["module 'model.layers.0.self_attn.q_proj'", "B·A is [64, 32], the base's"]),
    (_pickle_only, ["adapter_model.bin: pickled adapter weights are refused"]),
], ids=["dora", "ia3", "missing-target", "shape-mismatch", "pickle"])
def test_adapters_that_cannot_be_merged_are_refused_in_one_line(fam, tmp_path, capsys, make, fragments):
    folder = make(fam, tmp_path)
    params = _write_params(tmp_path, fam, {"name": "x", "adapter": str(folder), "weight": 1.0})
    _fails(capsys, ["run", str(params)], 2, *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, fragment", [
    ({"r": 0}, "r: must be an integer rank"),
    ({"r": "8"}, "r: must be an integer rank"),
    ({"lora_alpha": float("nan")}, "lora_alpha: must be a finite number"),
    ({"use_rslora": "yes"}, "use_rslora: must be true or false"),
    ({"rank_pattern": {"(q_proj)+": 2}}, "quantified group"),
    ({"rank_pattern": {"q_proj": 2.5}}, "must be an integer rank"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights: 'pissa'"),
    ({"peft_type": "LOHA"}, "peft_type: 'LOHA'"),
])
def test_bad_adapter_configs_are_named(config, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        parse_settings({"peft_type": "LORA", "r": 8, "lora_alpha": 8, **config}, "adapter_config.json")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_an_adapter_folder_is_listed_as_adapter_and_indexed_with_its_base(fam, tmp_path, capsys):
    params = _write_params(tmp_path, fam, {"name": "x", "path": str(fam["r4"]), "weight": 1.0})
    _fails(capsys, ["run", str(params)], 2, "experts[0].path",
           "is a PEFT LoRA adapter folder; list it as adapter:")
    params = _write_params(tmp_path, fam, {"name": "x", "adapter": str(fam["dense"]), "weight": 1.0})
    _fails(capsys, ["run", str(params)], 2, "experts[0].adapter", "is not a PEFT LoRA adapter folder")
    cache = ["--cache-dir", str(tmp_path / "c")]
    _fails(capsys, ["index", str(fam["r4"]), *cache], 3, "index it with --base BASE")
    assert main(["index", str(fam["r4"]), "--base", str(fam["base"]), *cache]) == 0


def test_an_adapter_is_found_by_id_in_the_local_hugging_face_cache(fam, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snapshot = hub / "models--someone--tiny-lora" / "snapshots" / "abc123"
    shutil.copytree(fam["r4"], snapshot)
    (hub / "models--someone--tiny-lora" / "refs").mkdir()
    (hub / "models--someone--tiny-lora" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)
    out, man = _run(tmp_path, fam, [{"name": "hub", "adapter": "someone/tiny-lora", "weight": 1.0}], "hub")
    assert man["plan"]["experts"][0]["path"] == snapshot.as_posix()
    local, _ = _run(tmp_path, fam, [{"name": "hub", "adapter": str(fam["r4"]), "weight": 1.0}], "local")
    assert (out / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()


def test_a_mergekit_model_plus_lora_imports_as_an_adapter_expert(fam, tmp_path, monkeypatch, capsys):
    """mergekit's `BASE+ADAPTER` (an adapter on the merge's base) is an adapter expert, and the
    imported recipe merges what the params.yaml form merges, byte for byte."""
    monkeypatch.chdir(fam["root"])  # mergekit reads model paths against the working directory
    mk = tmp_path / "mk.yml"
    mk.write_text("merge_method: task_arithmetic\nbase_model: base\nparameters: {lambda: 0.8}\n"
                  "models:\n  - {model: base+r4, parameters: {weight: 1.0}}\n"
                  "  - {model: dense, parameters: {weight: 0.7}}\n")
    params = tmp_path / "mk.params.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    cfg = yaml.safe_load(params.read_text())
    assert [sorted(e) for e in cfg["experts"]] == [["adapter", "name", "weight"], ["name", "path", "weight"]]
    assert (params.parent / cfg["experts"][0]["adapter"]).resolve() == fam["r4"].resolve()
    cfg.update(block_bytes="4KiB", cache_dir=str(tmp_path / "cache"), output={"dir": str(tmp_path / "imported")})
    params.write_text(yaml.safe_dump(cfg))
    assert main(["run", "-q", str(params)]) == 0
    out, _ = _run(tmp_path, fam, [{"name": "r4", "adapter": str(fam["r4"]), "weight": 1.0},
                                  {"name": "dense", "path": str(fam["dense"]), "weight": 0.7}], "direct")
    assert (tmp_path / "imported" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_mergekit_lora_on_another_model_is_refused_naming_it(fam, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(fam["root"])
    mk = tmp_path / "mk.yml"
    mk.write_text("merge_method: task_arithmetic\nbase_model: base\n"
                  "models:\n  - {model: dense+r4, parameters: {weight: 1.0}}\n")
    assert main(["import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "models[0].model: the LoRA adapter is on '" in err
    assert "/dense', not on the base model '" in err
