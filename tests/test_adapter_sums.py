"""Task arithmetic over LoRA adapters in one pass over the base (engine/adapter_sums.py,
checkpoint/_lorac.c): the same bytes as merging the adapters' virtual experts with the compiled
task-arithmetic kernel, at every installed vector width; merges (full and partial budgets,
fan_in_fan_out, rank patterns, embeddings, an adapter without a tensor, whole tensors, LoRA
biases, a dense expert) give the virtual experts' output files and manifests, and the one-pass
path is taken where it applies."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.checkpoint import _lora_kernel
from mergepipe.checkpoint.lora import Delta
from mergepipe.cli import main
from mergepipe.engine import adapter_sums
from mergepipe.methods._compiled import kernels
from mergepipe.util import cpu
from tests.helpers import kernel_build

summed = _lora_kernel.load_sum()
pytestmark = pytest.mark.skipif(summed is None, reason="mergepipe.checkpoint._lorac not built")


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()


def _virtual_merge(base: np.ndarray, rows: int, cols: int, terms, weights, divisor, normalize, lam) -> np.ndarray:
    """The adapters' experts (Delta.rows, rounded as Adapter.merged_rows rounds them) merged by
    the task-arithmetic kernel of methods/_bf16c.c."""
    b = torch.from_numpy(base.view(np.int16).copy()).view(torch.bfloat16).reshape(rows, cols)
    experts = []
    for term in terms:
        if term is None:
            experts.append(base.copy())
            continue
        left, right, scale = term
        experts.append(_bits((b.float() + Delta("m", scale, left=left, right=right).rows(0, rows)).to(torch.bfloat16)))
    out = np.empty(rows * cols, dtype=np.uint16)
    kernels().task_arithmetic_bf16(base, tuple(experts), np.array(weights, dtype=np.float32), np.float32(divisor),
                                   normalize, np.float32(lam), lam != 1, out)
    return out


CASES = [(37, 901, (16, 4, None, 1), False, 1.0), (5, 33, (3,), True, 0.7), (64, 256, (8, 8), True, 1.0),
         (1, 1, (2, None), False, -2.0), (130, 600, (16, 16, 16), False, 1.0), (9, 257, (None, None), True, 1.0)]


def _case(rows: int, cols: int, ranks, normalize: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, cols)).to(torch.bfloat16)
    base[0, 0] = float("nan")
    if rows * cols > 2:
        base.view(-1)[1], base.view(-1)[2] = float("-inf"), -0.0
    terms = [None if r is None else (torch.randn(rows, r, generator=g) * torch.logspace(-5, 0, r),
                                     torch.randn(r, cols, generator=g) * torch.logspace(-4, 1, cols),
                                     float(torch.rand(1, generator=g)) * 3 - 1)
             for r in ranks]
    weights = [float(np.float32(w)) for w in torch.rand(len(ranks), generator=g) - 0.3]
    divisor = np.float32(1)
    if normalize:
        divisor = np.float32(0)
        for w in weights:
            divisor = np.float32(divisor + np.float32(w))
    return _bits(base), terms, weights, float(divisor)


def _check(fn, rows, cols, ranks, normalize, lam, seed):
    base, terms, weights, divisor = _case(rows, cols, ranks, normalize, seed)
    out = np.empty_like(base)
    fn(base, rows, cols, terms, weights, divisor, normalize, lam, lam != 1, out)
    want = _virtual_merge(base, rows, cols, terms, weights, divisor, normalize, lam)
    assert np.array_equal(out, want), f"{(out != want).sum()} of {out.size} elements differ"


@pytest.mark.parametrize(("rows", "cols", "ranks", "normalize", "lam"), CASES)
def test_one_pass_sum_is_the_kernel_over_the_virtual_experts(rows, cols, ranks, normalize, lam):
    _check(summed, rows, cols, ranks, normalize, lam, rows * 31 + cols)


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_every_vector_width_gives_the_same_bytes(level):
    """Each installed build (SSE2, AVX2, AVX-512), where this CPU runs it (else skipped, naming
    the width), against the virtual experts' merge."""
    build = _lora_kernel._bind_sum(ctypes.CDLL(str(kernel_build(_lora_kernel.MODULE, level))))
    for i, (rows, cols, ranks, normalize, lam) in enumerate(CASES):
        _check(build, rows, cols, ranks, normalize, lam, level * 100 + i)


def test_the_sum_refuses_buffers_of_other_shapes():
    base = np.zeros(12, dtype=np.uint16)
    with pytest.raises(ValueError, match="contiguous fp32"):
        summed(base, 3, 4, [(torch.ones(3, 2), torch.ones(2, 5), 1.0)], [1.0], 1.0, False, 1.0, False,
               np.empty_like(base))
    with pytest.raises(ValueError, match="one weight per term"):
        summed(base, 3, 4, [None], [], 1.0, False, 1.0, False, np.empty_like(base))


# --- merges ------------------------------------------------------------------------------

SHAPES = {"model.embed_tokens.weight": (96, 160), "model.layers.0.self_attn.q_proj.weight": (192, 160),
          "model.layers.0.self_attn.q_proj.bias": (192,), "model.layers.0.mlp.down_proj.weight": (160, 400),
          "model.layers.0.mlp.up_proj.weight": (400, 160), "model.norm.weight": (160,)}
PREFIX = "base_model.model."


def _base(root: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    folder = root / "base"
    folder.mkdir()
    save_file({n: (0.05 * torch.randn(s, generator=g)).to(torch.bfloat16) for n, s in SHAPES.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _adapter(root: Path, name: str, seed: int, modules: dict[str, int], *, fan_in_fan_out=False, whole=(),
             bias=False, **config) -> Path:
    """A PEFT-layout LoRA adapter: module -> rank (rank_pattern where not 8)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, r in modules.items():
        out_f, in_f = SHAPES[f"{module}.weight"]
        key = PREFIX + module
        if module.endswith("embed_tokens"):  # lora_embedding_A (r, vocab), _B (dim, r): Δ = (B·A)ᵀ
            tensors[f"{key}.lora_embedding_A"] = torch.randn(r, out_f, generator=g)
            tensors[f"{key}.lora_embedding_B"] = 0.01 * torch.randn(in_f, r, generator=g)
        elif fan_in_fan_out:  # the weight is [in, out] as stored: A (r, rows), B (cols, r)
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, out_f, generator=g) / out_f ** 0.5
            tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(in_f, r, generator=g)
        else:
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
            tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(out_f, r, generator=g)
        if bias and f"{module}.bias" in SHAPES:
            tensors[f"{key}.lora_B.bias"] = 0.01 * torch.randn(SHAPES[f"{module}.bias"], generator=g)
    for tensor in whole:  # modules_to_save: the whole tensor
        module, leaf = tensor.rsplit(".", 1)
        tensors[f"{PREFIX}{module}.modules_to_save.{leaf}"] = 0.05 * torch.randn(SHAPES[tensor], generator=g)
    folder = root / name
    folder.mkdir()
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    settings = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "fan_in_fan_out": fan_in_fan_out,
                "rank_pattern": {m: r for m, r in modules.items() if r != 8}, "lora_bias": bias, **config}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-sums")
    base = _base(root)
    layer = "model.layers.0"
    dense = root / "dense"
    dense.mkdir()
    g = torch.Generator().manual_seed(9)
    save_file({n: (0.05 * torch.randn(s, generator=g)).to(torch.bfloat16) for n, s in SHAPES.items()},
              dense / "model.safetensors", metadata={"format": "pt"})
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {
        "base": base, "dense": dense,
        "a": _adapter(root, "a", 1, {f"{layer}.self_attn.q_proj": 8, f"{layer}.mlp.down_proj": 4,
                                     f"{layer}.mlp.up_proj": 16, "model.embed_tokens": 4}),
        "b": _adapter(root, "b", 2, {f"{layer}.mlp.down_proj": 8, f"{layer}.mlp.up_proj": 2}, use_rslora=True),
        "c": _adapter(root, "c", 3, {f"{layer}.self_attn.q_proj": 3, f"{layer}.mlp.up_proj": 8},
                      fan_in_fan_out=True),
        "saved": _adapter(root, "saved", 4, {f"{layer}.self_attn.q_proj": 8, f"{layer}.mlp.down_proj": 8},
                          whole=(f"{layer}.mlp.down_proj.weight",), bias=True),
    }


def _merge(tmp: Path, fam: dict, experts: list[tuple[str, float]], tag: str, budget: str, **cfg) -> tuple[bytes, dict]:
    entries = [{"name": n, "path": str(fam[n]), "weight": w} if n == "dense" else
               {"name": n, "adapter": str(fam[n]), "weight": w} for n, w in experts]
    params = {"base": str(fam["base"]), "experts": entries, "method": "task_arithmetic",
              "parameters": {"lambda": 0.8}, "budget": budget, "block_bytes": "4KiB", "seed": 0,
              "output": {"dir": str(tmp / f"out-{tag}")}, "cache_dir": str(tmp / f"cache-{tag}"), **cfg}
    path = tmp / f"params-{tag}.yaml"
    path.write_text(yaml.safe_dump(params))
    assert main(["run", "-q", str(path)]) == 0
    out = tmp / f"out-{tag}"
    manifest = json.loads((out / "manifest.json").read_text())
    return (out / "model.safetensors").read_bytes(), manifest


def _stable(manifest: dict) -> dict:
    """The manifest without what differs between two runs of one plan (timings, paths)."""
    out = json.loads(json.dumps(manifest))
    out.pop("created", None)
    out.get("realized", {}).pop("seconds", None)
    out.pop("timings", None)
    return json.loads(json.dumps(out).replace("one-pass", "").replace("virtual", ""))


TARGETS = {"down_proj", "up_proj", "q_proj", "embed_tokens"}


@pytest.mark.parametrize(("experts", "budget", "cfg", "one_pass"), [
    ([("a", 1.0), ("b", -0.5), ("c", 0.7)], "full", {}, TARGETS),
    # whole blocks of some experts only: runs of blocks with different adapters present
    ([("a", 1.0), ("b", -0.5), ("c", 0.7)], "40%", {"plan": {"strategy": "energy"}}, TARGETS),
    # sketched tensors keep the virtual experts' path
    ([("a", 1.0), ("b", -0.5), ("c", 0.7)], "40%", {"plan": {"strategy": "sketch"}}, {"embed_tokens"}),
    ([("a", 0.6), ("c", 0.9)], "full", {"parameters": {"lambda": 1.0, "normalize": True}}, TARGETS),
    # `saved`'s whole down_proj: the virtual path; its LoRA bias is q_proj.bias's (packed), not q_proj's
    ([("a", 0.6), ("saved", 0.9)], "full", {}, {"up_proj", "embed_tokens", "q_proj"}),
    ([("a", 0.6), ("dense", 0.5), ("b", 0.3)], "full", {}, set()),
])
def test_a_one_pass_merge_is_the_merge_of_the_virtual_experts(fam, tmp_path, monkeypatch, experts, budget, cfg,
                                                              one_pass):
    summed_units: list[str] = []
    load = adapter_sums.AdapterSums.load

    def spy(self, name, unit):
        summed_units.append(name)
        return load(self, name, unit)

    with monkeypatch.context() as m:
        m.setattr(adapter_sums.AdapterSums, "load", spy)
        ours, man = _merge(tmp_path, fam, experts, "one-pass", budget, **cfg)
    with monkeypatch.context() as m:
        m.setattr(adapter_sums._lora_kernel, "load_sum", lambda: None)
        theirs, man_virtual = _merge(tmp_path, fam, experts, "virtual", budget, **cfg)
    assert {n.split(".")[-2] for n in summed_units} == one_pass
    assert ours == theirs
    assert _stable(man) == _stable(man_virtual)
