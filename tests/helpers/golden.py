"""Golden merges: a portable seeded family and the output hashes of every method on it.

`python -m tests.helpers.golden OUT [--threads N] [--torch-path]` writes the family under OUT,
runs each case of CASES through `mergepipe run` (in process) and prints one JSON object:
case -> {"weights": blake3 over the output's weight files, "plan": the manifest's
version-free digest, "manifest": blake3 of its manifest.json}. tests/test_golden.py runs it
under different CPU settings and compares.

The family is built from integers only (numpy's PCG64 integers, exact fp32 scaling, a
bf16 rounding written with integer ops, safetensors written by hand), so its bytes are
the same on any CPU: a golden hash that moves is the merge's doing, never the fixture's.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import yaml
from blake3 import blake3

HIDDEN, INTER, LAYERS, VOCAB = 64, 160, 3, 512
WEIGHTS = [1.0, 0.5, 0.7]


def _shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.up_proj.weight": (INTER, HIDDEN), p + "mlp.down_proj.weight": (HIDDEN, INTER),
                   p + "input_layernorm.weight": (HIDDEN,)}
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def _values(rng: np.random.Generator, n: int, scale_log2: int) -> np.ndarray:
    # exact: integers below 2**21 times a power of two
    return rng.integers(-(1 << 20), 1 << 20, n).astype(np.float32) * np.float32(2.0 ** (scale_log2 - 20))


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even (no NaN here)
    return rounded.astype(np.uint16)


def _tensor_bytes(x: np.ndarray, dtype: str) -> bytes:
    return (_bf16_bits(x) if dtype == "BF16" else x.astype("<f4")).tobytes()


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(tensors):
            f.write(tensors[name][2])


def _write_model(folder: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], *, shards: int = 1) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "hidden_size": HIDDEN, "num_hidden_layers": LAYERS}))
    if shards == 1:
        _write_safetensors(folder / "model.safetensors", tensors)
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        _write_safetensors(folder / fname, {n: tensors[n] for n in part})
        weight_map |= dict.fromkeys(part, fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_golden_family(root: Path, *, dtype: str, seed: int, n_experts: int = 3, shard_base: bool = False) -> None:
    """base + experts; expert k: tensors frozen (byte-identical), partly changed rows, or fully changed."""
    rng = np.random.Generator(np.random.PCG64(seed))
    base = {name: _values(rng, int(np.prod(shape)), -3).reshape(shape) for name, shape in _shapes().items()}
    enc = {n: (dtype, v.shape, _tensor_bytes(v, dtype)) for n, v in base.items()}
    _write_model(root / "base", enc, shards=3 if shard_base else 1)
    for k in range(n_experts):
        tensors = {}
        for i, (name, v) in enumerate(base.items()):
            kind = (i + k) % 4  # 0 frozen, 1 some rows changed, 2/3 all changed (two sizes)
            w = v.copy()
            if kind == 1 and v.ndim == 2:
                rows = rng.integers(0, v.shape[0], max(1, v.shape[0] // 8))
                w[rows] += _values(rng, len(rows) * v.shape[1], -8 - k).reshape(len(rows), v.shape[1])
            elif kind >= 2:
                w += _values(rng, v.size, -9 + kind - k).reshape(v.shape)
            tensors[name] = (dtype, v.shape, _tensor_bytes(w, dtype))
        _write_model(root / f"expert_{k}", tensors, shards=2 if k == 0 else 1)


# case -> (family, method, parameters, per-expert extras, budget, output dtype[, plan options])
DENS = {"density": [0.4, 0.3, 0.55]}
CASES: dict[str, tuple] = {
    **{f"bf16-{m}": ("bf16", m, p, x, "full", None) for m, p, x in [
        ("linear", {}, {}), ("task_arithmetic", {"lambda": 0.8}, {}), ("ties", {}, DENS),
        ("dare_linear", {"density": 0.6}, {}), ("dare_ties", {"density": 0.5}, {}),
        ("breadcrumbs", {"gamma": 0.02}, DENS), ("breadcrumbs_ties", {"lambda": 1.2, "gamma": 0.02}, DENS),
        ("slerp", {"t": 0.3}, {})]},
    **{f"f32-{m}": ("f32", m, p, x, "full", None) for m, p, x in [
        ("task_arithmetic", {"lambda": 1.0}, {}), ("ties", {}, DENS), ("dare_ties", {"density": 0.5}, {}),
        ("breadcrumbs_ties", {"gamma": 0.02}, DENS), ("slerp", {"t": 0.6}, {})]},
    # whole-block reads (strategy energy, the default before sketches)
    "bf16-ta-30pct": ("bf16", "task_arithmetic", {"lambda": 1.0}, {}, "30%", None, {"strategy": "energy"}),
    "bf16-ties-30pct": ("bf16", "ties", {}, DENS, "30%", None, {"strategy": "energy"}),
    # no `plan:`: the default below full budget, sketches (plan/strategies/default.py)
    "bf16-ta-30pct-sketch": ("bf16", "task_arithmetic", {"lambda": 0.9}, {}, "30%", None),
    "bf16-ties-30pct-sketch": ("bf16", "ties", {}, DENS, "30%", None),
    "bf16-ta-to-f32": ("bf16", "task_arithmetic", {"lambda": 0.5}, {}, "full", "float32"),
    "sharded-base-ties": ("sharded", "ties", {}, DENS, "full", None),
}
FAMILIES = {"bf16": dict(dtype="BF16", seed=0), "f32": dict(dtype="F32", seed=1),
            "sharded": dict(dtype="BF16", seed=2, shard_base=True)}


def _config(path: Path, case: tuple) -> None:
    # paths relative to params.yaml (cases/NAME/), so the manifest does not depend on OUT
    family, method, params, extras, budget, out_dtype, *plan = case
    fam = f"../../{family}"
    n = 1 if method == "slerp" else 3
    experts = [{"name": f"e{k}", "path": f"{fam}/expert_{k}", "weight": WEIGHTS[k],
                **{key: vals[k] for key, vals in extras.items()}} for k in range(n)]
    cfg = {"base": f"{fam}/base", "experts": experts, "method": method, "parameters": params, "seed": 7,
           "budget": budget, "block_bytes": "4KiB", "output": {"dir": "out", "dtype": out_dtype},
           "cache_dir": "../../cache"}
    if plan:
        cfg["plan"] = plan[0]
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def weights_hash(out: Path) -> str:
    h = blake3()
    for p in sorted(out.iterdir()):
        if p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json"):
            h.update(p.name.encode() + b"\0" + blake3(p.read_bytes()).digest())
    return h.hexdigest()


def manifest_digest(out: Path) -> str:
    """blake3 of the manifest without what names the version (versions, plan hash, model
    card): pins plans, bytes, bounds and hashes across refactors, not across releases."""
    man = json.loads((out / "manifest.json").read_text())
    for key in ("versions", "plan_hash", "manifest_hash"):
        man.pop(key)
    man["plan"] = {k: v for k, v in man["plan"].items() if k not in ("mergepipe_version", "plan_hash")}
    man["outputs"]["files"].pop("README.md")
    return blake3(json.dumps(man, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def run_cases(root: Path, *, threads: int, torch_path: bool) -> dict[str, dict[str, str]]:
    from mergepipe.engine import merge as engine
    from mergepipe.commands import pipeline
    from mergepipe.cli import main
    if torch_path:  # every block through the methods' torch code instead of the compiled kernels
        real = pipeline.run_merge
        pipeline.run_merge = lambda *a, **kw: real(*a, **kw, compiled=False)
        assert engine.run_merge is real
    for fam, kw in FAMILIES.items():
        make_golden_family(root / fam, **kw)
    result = {}
    for name, case in CASES.items():
        work = root / "cases" / name
        work.mkdir(parents=True)
        _config(work / "params.yaml", case)
        if main(["run", str(work / "params.yaml"), "-q", "--threads", str(threads)]) != 0:
            raise SystemExit(f"golden case {name} failed")
        result[name] = {"weights": weights_hash(work / "out"), "plan": manifest_digest(work / "out"),
                        "manifest": blake3((work / "out" / "manifest.json").read_bytes()).hexdigest()}
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-path", action="store_true")
    a = ap.parse_args()
    json.dump(run_cases(Path(a.out), threads=a.threads, torch_path=a.torch_path), sys.stdout, indent=1,
              sort_keys=True)
