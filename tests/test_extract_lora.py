"""LoRA extraction's factorization (checkpoint/lora_factor.py): full rank reproduces Δ, a
truncated rank retains the energy it reports, --energy's rank rule, and fixed signs."""
from __future__ import annotations

import torch

from mergepipe.checkpoint import lora_extract
from mergepipe.checkpoint.lora_factor import factors, spectrum


def _delta(shape, seed=0, rank=None):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(shape, generator=g, dtype=torch.float64) * 1e-2
    if rank is not None:
        d = (d[:, :rank] @ torch.randn(rank, shape[1], generator=g, dtype=torch.float64))
    return d


def test_full_rank_factors_reproduce_delta_within_fp32_rounding():
    for shape in [(24, 40), (40, 24)]:
        d = _delta(shape)
        spec = spectrum(d)
        b, a = factors(d, spec, spec.full_rank)
        assert b.shape == (shape[0], min(shape)) and a.shape == (min(shape), shape[1])
        assert b.dtype == a.dtype == torch.float32
        err = (b.double() @ a.double() - d).abs().max()
        assert float(err) < 1e-6 * float(d.abs().max())


def test_a_truncated_rank_retains_the_energy_it_reports():
    d = _delta((30, 50), seed=1)
    spec = spectrum(d)
    b, a = factors(d, spec, 5)
    kept = float((b.double() @ a.double()).square().sum() / d.square().sum())
    assert abs(kept - spec.energy(5)) < 1e-6
    assert 0 < spec.energy(5) < spec.energy(6) < 1


def test_energy_picks_the_smallest_rank_reaching_it():
    d = _delta((20, 30), seed=2, rank=3)  # rank 3: energy 1 at r = 3
    spec = spectrum(d)
    assert spec.rank_for_energy(1.0 - 1e-9) == 3
    r = spec.rank_for_energy(0.8)
    assert spec.energy(r) >= 0.8 and (r == 1 or spec.energy(r - 1) < 0.8)


def test_signs_are_fixed_and_factors_equal_for_a_negated_delta_up_to_sign():
    d = _delta((16, 24), seed=3)
    spec = spectrum(d)
    pivot = spec.vectors.abs().argmax(dim=0)
    assert bool((spec.vectors.gather(0, pivot.unsqueeze(0)) > 0).all())
    b, a = factors(-d, spectrum(-d), 4)
    b0, a0 = factors(d, spec, 4)
    assert torch.equal(b, b0) and torch.equal(a, -a0)


# --- `mergepipe extract-lora` (commands/extract_lora.py) on a tiny Llama ------------------------------

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from mergepipe.cli import main  # noqa: E402
from tests.helpers.equivalence import EPS32, ulp  # noqa: E402
from tests.helpers import fails_in_one_line, load_model  # noqa: E402

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _llama(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   attention_bias=True, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> dict[str, Path]:
    """fp32 and bf16 bases and fine-tunes: every parameter moved by ~10% (norms, embeddings too), and
    the first layer's up_proj moved by a rank-3 Δ only; the bf16 expert's o_proj left alone."""
    root = tmp_path_factory.mktemp("extract")
    out = {"root": root}
    for tag, dtype in (("32", torch.float32), ("16", torch.bfloat16)):
        model = _llama(dtype)
        model.save_pretrained(root / f"base{tag}")
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name == "model.layers.0.mlp.up_proj.weight":
                    low = torch.randn(64, 3, generator=g) @ torch.randn(3, 32, generator=g)
                    p.add_((0.001 * low).to(dtype))
                elif not (tag == "16" and "o_proj" in name):
                    p.add_((0.002 * torch.randn(p.shape, generator=g)).to(dtype))
        model.save_pretrained(root / f"expert{tag}")
        out[f"base{tag}"], out[f"expert{tag}"] = root / f"base{tag}", root / f"expert{tag}"
    return out


def _extract(fam, tag, out: Path, *args: str, capsys=None) -> Path:
    argv = ["extract-lora", str(fam[f"expert{tag}"]), "--base", str(fam[f"base{tag}"]), "-o", str(out), *args]
    assert main(argv) == 0
    return out


def _peft_merged(base: Path, adapter: Path, dtype) -> dict[str, torch.Tensor]:
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return {k: v.detach().contiguous() for k, v in merged.state_dict().items()}


def _mergepipe_merged(tmp_path: Path, base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """task_arithmetic, λ 1, the adapter as the one expert of weight 1."""
    cfg = {"base": str(base), "experts": [{"name": "x", "adapter": str(adapter), "weight": 1.0}],
           "method": "task_arithmetic", "parameters": {"lambda": 1.0}, "output": {"dir": str(tmp_path / "merged")},
           "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "-q", str(tmp_path / "params.yaml")]) == 0
    return load_model(tmp_path / "merged")


def _fp32_rounding(report: dict, adapter: Path, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per factored weight: (rank + 2) fp32 roundings of |W| + Σ_k |B_ik A_kj|, the magnitudes summed
    into each element of W + B·A (the fp32 factors' own rounding, the sum's, the add's)."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    out = {}
    for module, rec in report["modules"].items():
        emb = rec["kind"] == "embedding"
        a = tensors[f"base_model.model.{module}." + ("lora_embedding_A" if emb else "lora_A.weight")].double()
        b = tensors[f"base_model.model.{module}." + ("lora_embedding_B" if emb else "lora_B.weight")].double()
        summed = b.abs() @ a.abs()
        out[f"{module}.weight"] = (rec["rank"] + 2) * EPS32 * (base[f"{module}.weight"].double().abs()
                                                              + (summed.T if emb else summed))
    return out


def _within_rule(got: torch.Tensor, want: torch.Tensor, extra: torch.Tensor | None) -> tuple[int, int, int]:
    """One ulp of the larger value in the model's dtype, or within `extra`: the fp32 roundings of
    the magnitudes summed into the element when the reader evaluates W + B·A in fp32 (PEFT's BLAS
    product, mergepipe's fixed-order sum), which exceed W's ulp where Σ_k |B_ik A_kj| is not small
    against |W| (a fine-tune moving weights by 10%, as here) or where W + Δ cancels (e.g. to 0.0)."""
    g, w = got.double(), want.double()
    diff, one_ulp = (g - w).abs(), ulp(torch.maximum(g.abs(), w.abs()), want.dtype)
    allowed = one_ulp if extra is None else torch.maximum(one_ulp, extra)
    bad = diff > allowed
    assert not bool(bad.any()), f"{int(bad.sum())} elements outside the rule"
    return int((diff == 0).sum()), int(((diff > 0) & (diff <= one_ulp)).sum()), int((diff > one_ulp).sum())


@pytest.mark.parametrize("tag", ["32", "16"])
def test_full_rank_reproduces_the_expert_through_peft_and_through_mergepipe(fam, tmp_path, tag, capsys):
    dtype = torch.float32 if tag == "32" else torch.bfloat16
    out = _extract(fam, tag, tmp_path / "adapter", "--energy", "1")
    report = json.loads((out / "extract_report.json").read_text())
    expert, base = load_model(fam[f"expert{tag}"]), load_model(fam[f"base{tag}"])
    extra = _fp32_rounding(report, out, base)
    if tag == "16":
        assert "model.layers.0.self_attn.o_proj" not in report["modules"]  # unchanged: not a target
    for tool, merged in (("peft", _peft_merged(fam[f"base{tag}"], out, dtype)),
                         ("mergepipe", _mergepipe_merged(tmp_path, fam[f"base{tag}"], out))):
        assert merged.keys() == expert.keys()
        counts = [0, 0, 0]
        for name, want in expert.items():
            if name.removesuffix(".weight") in report["modules"]:
                counts = [c + n for c, n in zip(counts, _within_rule(merged[name], want, extra.get(name)))]
            else:  # kept whole or unchanged: the expert's bytes
                assert torch.equal(merged[name], want), name
        with capsys.disabled():
            print(f"\n[extract-lora] {dtype} via {tool}: {counts[0]} factored elements identical, {counts[1]} "
                  f"within one ulp, {counts[2]} within the fp32 rounding of B·A")


def _deltas(fam, tag) -> dict[str, torch.Tensor]:
    expert, base = load_model(fam[f"expert{tag}"]), load_model(fam[f"base{tag}"])
    return {n: expert[n].double() - base[n].double() for n in expert}


def test_a_truncated_rank_keeps_the_energy_it_reports(fam, tmp_path, capsys):
    out = _extract(fam, "32", tmp_path / "r4", "--rank", "4")
    err = capsys.readouterr().err
    report = json.loads((out / "extract_report.json").read_text())
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4 and config["rank_pattern"] == {} and not config["use_rslora"]
    tensors, deltas = load_file(out / "adapter_model.safetensors"), _deltas(fam, "32")
    for module, rec in report["modules"].items():
        a = tensors[f"base_model.model.{module}.lora_A.weight"].double()
        b = tensors[f"base_model.model.{module}.lora_B.weight"].double()
        d = deltas[f"{module}.weight"]
        assert a.shape[0] == b.shape[1] == rec["rank"] == 4
        kept = 1 - float((d - b @ a).square().sum() / d.square().sum())
        sigma = torch.linalg.svdvals(d).square()
        assert abs(rec["energy"] - float(sigma[:4].sum() / sigma.sum())) < 1e-9  # Eckart–Young's optimum
        assert abs(kept - rec["energy"]) < 1e-5, module  # the fp32 factors keep what is reported
        assert f"{module}: rank 4 of {rec['full_rank']}, retained energy {rec['energy']:.6f}" in err
    assert rec["energy"] < 0.9


def test_energy_picks_each_module_s_smallest_rank_and_records_it_in_rank_pattern(fam, tmp_path):
    out = _extract(fam, "32", tmp_path / "e", "--energy", "0.6")
    report = json.loads((out / "extract_report.json").read_text())
    config = json.loads((out / "adapter_config.json").read_text())
    deltas = _deltas(fam, "32")
    ranks = {}
    for module, rec in report["modules"].items():
        sigma = torch.linalg.svdvals(deltas[f"{module}.weight"]).square()
        energy = torch.cumsum(sigma, 0) / sigma.sum()
        r = rec["rank"]
        assert float(energy[r - 1]) >= 0.6 - 1e-12 and (r == 1 or float(energy[r - 2]) < 0.6), module
        ranks[module] = r
    assert ranks["model.layers.0.mlp.up_proj"] <= 3 and len(set(ranks.values())) > 1
    r = config["r"]
    for module, rank in ranks.items():
        pattern = config["rank_pattern"].get(module.replace(".", "\\."))
        assert (pattern if pattern is not None else r) == rank
    assert config["alpha_pattern"] == config["rank_pattern"] and config["lora_alpha"] == r  # scale 1
    exact = _extract(fam, "32", tmp_path / "e1", "--energy", "0.99999999")
    assert json.loads((exact / "extract_report.json").read_text())["modules"]["model.layers.0.mlp.up_proj"][
        "rank"] == 3  # the rank-3 Δ (fp32 rounding adds ~1e-15 of energy beyond)


def test_embedding_lora_and_modules_to_save_load_in_peft_as_the_expert(fam, tmp_path):
    out = _extract(fam, "16", tmp_path / "emb", "--energy", "1", "--embed-lora", "--modules-to-save", "lm_head",
                   "norm")
    report = json.loads((out / "extract_report.json").read_text())
    config = json.loads((out / "adapter_config.json").read_text())
    keys = set(load_file(out / "adapter_model.safetensors"))
    assert report["modules"]["model.embed_tokens"]["kind"] == "embedding"
    assert {"base_model.model.model.embed_tokens.lora_embedding_A", "base_model.model.lm_head.weight",
            "base_model.model.model.norm.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"} <= keys
    assert "lm_head" not in report["modules"] and "lm_head" in config["modules_to_save"]
    assert "model.layers.1.post_attention_layernorm" in config["modules_to_save"]  # PEFT's suffix rule
    expert, base = load_model(fam["expert16"]), load_model(fam["base16"])
    merged = _peft_merged(fam["base16"], out, torch.bfloat16)
    extra = _fp32_rounding(report, out, base)
    for name, want in expert.items():
        if name.removesuffix(".weight") in report["modules"]:
            _within_rule(merged[name], want, extra[name])
        else:
            assert torch.equal(merged[name], want), name


def test_the_adapter_does_not_depend_on_how_many_rows_delta_is_made_at_a_time(fam, tmp_path, monkeypatch):
    args = ("--energy", "0.9", "--embed-lora", "--modules-to-save", "norm")
    whole = _extract(fam, "16", tmp_path / "whole", *args)
    monkeypatch.setattr(lora_extract, "SLAB_ELEMENTS", 1000)  # every matrix in several slabs
    slabs = _extract(fam, "16", tmp_path / "slabs", *args)
    assert (whole / "adapter_model.safetensors").read_bytes() == (slabs / "adapter_model.safetensors").read_bytes()


def _pair(tmp_path: Path, shape=(960, 896)) -> tuple[Path, Path]:
    """A one-tensor fp64 base and fine-tune, large enough that MKL's fp64 eigh takes another path at
    2 threads than at 1: without the one-thread rule their fp32 factors differ (checked)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    for name, t in (("base", w), ("expert", w + 0.01 * torch.randn(shape, generator=g, dtype=torch.float64))):
        (tmp_path / name).mkdir()
        save_file({"layer.proj.weight": t.contiguous()}, tmp_path / name / "model.safetensors")
    return tmp_path / "expert", tmp_path / "base"


def test_the_adapter_has_the_same_bytes_at_every_thread_count(tmp_path):
    expert, base = _pair(tmp_path)
    files = {}
    for threads in (1, 2):
        out = tmp_path / f"out{threads}"
        code = (f"import sys, torch; torch.set_num_threads({threads}); from mergepipe.cli import main; "
                f"sys.exit(main(['extract-lora', '-q', '--threads', '{threads}', {str(expert)!r}, '--base', "
                f"{str(base)!r}, '--rank', '64', '-o', {str(out)!r}]))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        files[threads] = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "manifest.json"}
    assert files[1] == files[2] and len(files[1]) == 3


def _edited_expert(fam, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(fam["expert32"], folder)
    tensors = load_file(folder / "model.safetensors")
    save_file(edit(tensors), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _reshaped(t):
    return {**t, "model.norm.weight": torch.ones(16)}


def _nan(t):
    w = t["model.layers.1.mlp.up_proj.weight"].clone()
    w[3, 4] = float("nan")
    return {**t, "model.layers.1.mlp.up_proj.weight": w}


def _dropped(t):
    return {k: v for k, v in t.items() if k != "lm_head.weight"}


@pytest.mark.parametrize("edit, code, fragments", [
    (_reshaped, 3, ["'model.norm.weight'", "[16]", "[32]"]),
    (_nan, 3, ["'model.layers.1.mlp.up_proj.weight'", "NaN"]),
    (_dropped, 3, ["'lm_head.weight'", "not in the expert"]),
])
def test_inputs_that_do_not_fit_the_base_are_refused_naming_the_tensor(fam, tmp_path, capsys, edit, code,
                                                                       fragments):
    expert = _edited_expert(fam, tmp_path, edit)
    out = tmp_path / "out"
    fails_in_one_line(capsys, ["extract-lora", "-q", str(expert), "--base", str(fam["base32"]), "--rank", "4", "-o",
                    str(out)], code, *fragments)
    assert not out.exists()


def test_bad_ranks_patterns_and_inputs_are_refused_in_one_line(fam, tmp_path, capsys):
    base, expert, out = str(fam["base32"]), str(fam["expert32"]), str(tmp_path / "out")
    args = ["extract-lora", expert, "--base", base, "-o", out]
    fails_in_one_line(capsys, [*args, "--rank", "0"], 2, "--rank 0")
    fails_in_one_line(capsys, [*args, "--rank", "17"], 2,
                      "--rank 17", "'model.layers.0.self_attn.k_proj.weight'", "[16, 32]")
    fails_in_one_line(capsys, [*args, "--energy", "1.5"], 2, "--energy 1.5")
    fails_in_one_line(capsys, [*args, "--rank", "4", "--modules-to-save", "no_such"], 2, "'no_such'")
    missing = str(tmp_path / "nowhere")
    fails_in_one_line(capsys, ["extract-lora", missing, "--base", base, "--rank", "4", "-o", out], 3, missing)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    fails_in_one_line(capsys, ["extract-lora", str(pickled), "--base", base, "--rank", "4", "-o", out], 3,
           "pytorch_model.bin", "pickle")
    adapter = _extract(fam, "32", tmp_path / "adapter", "--rank", "2")
    fails_in_one_line(capsys, ["extract-lora", str(adapter), "--base", base, "--rank", "4", "-o", out], 2,
                      "LoRA adapter")
    fails_in_one_line(capsys, ["extract-lora", base, "--base", base, "--rank", "4", "-o", out], 2, "nothing to extract")
    fails_in_one_line(capsys, [*args[:4], "--rank", "4", "-o", str(fam["expert32"] / "sub")], 7, "overlaps")
    assert not (tmp_path / "out").exists() and not (fam["expert32"] / "sub").exists()


def test_an_output_folder_is_replaced_only_when_extract_lora_wrote_it(fam, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["extract-lora", str(fam["expert32"]), "--base", str(fam["base32"]), "--rank", "2", "-o", str(out)]
    fails_in_one_line(capsys, args, 7, str(out), "did not write", "'notes.txt'")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    assert main(args) == 0
    first = (out / "adapter_model.safetensors").read_bytes()
    assert main([*args[:-3], "4", "-o", str(out)]) == 0  # its own output: replaced
    assert (out / "adapter_model.safetensors").read_bytes() != first
    report = out / "extract_report.json"
    report.write_text(report.read_text() + " ")  # a user's edit is never overwritten
    fails_in_one_line(capsys, args, 7, "extract_report.json", "edited")
    assert report.read_text().endswith(" ")


def test_verify_rehashes_the_inputs_and_replays_the_extraction(fam, tmp_path, capsys):
    expert = tmp_path / "expert"
    shutil.copytree(fam["expert32"], expert)
    out = tmp_path / "out"
    assert main(["extract-lora", "-q", str(expert), "--base", str(fam["base32"]), "--energy", "0.7",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--inputs", "--replay"]) == 0
    assert "replay identical" in capsys.readouterr().out
    tensors = load_file(expert / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, expert / "model.safetensors", metadata={"format": "pt"})
    fails_in_one_line(capsys, ["verify", str(out), "--inputs"], 6, str(expert), "not the recorded")
