"""Seeded demo families: one base Llama-layout checkpoint and K fine-tuned experts.

Owns the synthetic checkpoints that tests, benchmarks and the quick start merge:
`OUT/base/` and `OUT/expert_{k}/`, each a Hugging Face folder (config.json,
generation_config.json, a tiny character tokenizer, model.safetensors or shards).
Experts carry fine-tune-like structure: low-rank deltas plus dense noise whose size
varies by layer and expert, frozen embeddings, frozen layers, untouched norms and
"new token" rows, so the index, the planner and the engine all have something to skip.

It writes with `safetensors.torch.save_file` on purpose, not with our own writer, so
that tests never check mergepipe's I/O against itself. Nothing in the merge path may
import this module. Same arguments give byte-identical files.
"""
import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from blake3 import blake3
from safetensors.torch import save_file

from mergepipe.commands.demo_args import DESCRIPTION, add_arguments
from mergepipe.errors import ConfigError, MergepipeError, OutputError
from mergepipe.util.fs import atomic_write_bytes, canonical_json, hash_file


@dataclass(frozen=True, slots=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    tied: bool


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 4, 4, 2, 384, 2048, context=2048, tied=False),
    "small": Preset(512, 6, 8, 2, 1408, 8192, context=4096, tied=False),
    "bench": Preset(896, 24, 14, 2, 4864, 151936, context=32768, tied=True),  # Qwen2.5-0.5B
    "bench3b": Preset(2048, 36, 16, 2, 11008, 151936, context=32768, tied=True),  # Qwen2.5-3B: ~6.2 GB bf16
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NEW_TOKENS = 32  # vocabulary rows that "new tokens" experts learn; all other rows stay put
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
SPECIALS = ["<unk>", "<s>", "</s>"]


def _shapes(p: Preset, *, tied: bool) -> dict[str, tuple[int, ...]]:
    kv = p.kv_heads * (p.hidden // p.heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (p.vocab, p.hidden)}
    for i in range(p.layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (p.hidden, p.hidden),
            layer + "self_attn.k_proj.weight": (kv, p.hidden),
            layer + "self_attn.v_proj.weight": (kv, p.hidden),
            layer + "self_attn.o_proj.weight": (p.hidden, p.hidden),
            layer + "mlp.gate_proj.weight": (p.intermediate, p.hidden),
            layer + "mlp.up_proj.weight": (p.intermediate, p.hidden),
            layer + "mlp.down_proj.weight": (p.hidden, p.intermediate),
            layer + "input_layernorm.weight": (p.hidden,),
            layer + "post_attention_layernorm.weight": (p.hidden,),
        }
    shapes["model.norm.weight"] = (p.hidden,)
    if not tied:
        shapes["lm_head.weight"] = (p.vocab, p.hidden)
    return shapes


def _generator(seed: int, model: str, name: str) -> torch.Generator:
    # blake3, not hash(): Python salts str hashes per process.
    digest = blake3(f"{seed}:{model}:{name}".encode()).digest(8)
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """How expert k was "fine-tuned"; kinds cycle so any K >= 3 shows every pattern."""

    scale: float  # std of the low-rank delta in a middle layer
    rank: int
    embeddings: str  # "trained" | "frozen" | "new_tokens"
    frozen_layers: frozenset[int]
    norms_trained: bool  # only the last layer's norms and the final norm, as in short runs


def _expert_shape(k: int) -> ExpertShape:
    kind = k % 3
    return ExpertShape(
        scale=2e-3 * (1 + 0.5 * k),
        rank=4 + k % 5,
        embeddings=("trained", "frozen", "new_tokens")[kind],
        frozen_layers=frozenset(range(kind)),  # bottom layers frozen, as partial fine-tunes do
        norms_trained=kind == 0,
    )


def _delta(name: str, shape: tuple[int, ...], e: ExpertShape, *, layers: int,
           g: torch.Generator) -> tuple[slice, torch.Tensor] | None:
    """The fp32 change to the rows `slice` of one tensor, or None if it stays byte-identical."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    if layer in e.frozen_layers:
        return None
    if len(shape) == 1:
        if not (e.norms_trained and layer in (None, layers - 1)):
            return None
        # Norm gains sit near 1, where a bf16 ulp is 2**-7: a smaller change would vanish.
        return slice(None), 10 * e.scale * torch.randn(shape, generator=g)
    if name in EMBEDDINGS and e.embeddings == "frozen":
        return None
    if name in EMBEDDINGS and e.embeddings == "new_tokens":
        rows = slice(shape[0] - NEW_TOKENS, shape[0])
        return rows, 0.02 * torch.randn(NEW_TOKENS, shape[1], generator=g)
    depth = 0.5 + (layer if layer is not None else layers - 1) / max(layers - 1, 1)
    scale = e.scale * depth  # later layers move more in most fine-tunes
    a = torch.randn(shape[0], e.rank, generator=g)
    b = torch.randn(e.rank, shape[1], generator=g)
    noise = torch.randn(shape, generator=g)  # updated in place: 0.5 GB for the bench embedding
    return slice(None), noise.addmm_(a, b, beta=0.1 * scale, alpha=scale / math.sqrt(e.rank))


def _base_tensor(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return 1 + 0.1 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g)


def _json(path: Path, obj: dict) -> None:
    path.write_bytes(canonical_json(obj, indent=2))


def _write_metadata(folder: Path, p: Preset, *, tied: bool, dtype: str) -> None:
    _json(folder / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": p.hidden, "intermediate_size": p.intermediate,
        "num_hidden_layers": p.layers, "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads, "head_dim": p.hidden // p.heads,
        "vocab_size": p.vocab, "max_position_embeddings": p.context,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
        "tie_word_embeddings": tied, "torch_dtype": dtype, "use_cache": True,
        "bos_token_id": 1, "eos_token_id": 2,
    })
    _json(folder / "generation_config.json",
          {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    # A character-level WordLevel tokenizer: real enough to load and round-trip ASCII text.
    chars = [chr(c) for c in range(32, 127)]
    names = (SPECIALS + chars + [f"<extra_{i}>" for i in range(p.vocab)])[: p.vocab]
    _json(folder / "tokenizer.json", {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False,
                              normalized=False, special=True) for i, s in enumerate(SPECIALS)],
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated",
                          "invert": False},
        "post_processor": None, "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": {s: i for i, s in enumerate(names)},
                  "unk_token": "<unk>"},
    })
    _json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": p.context,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    })


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], *,
                   shard_bytes: int | None) -> None:
    for stale in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a rerun may switch between one file and shards
    if shard_bytes is None:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and filled + nbytes > shard_bytes:
            shards.append({})
            filled = 0
        shards[-1][name] = tensor
        filled += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _json(folder / "model.safetensors.index.json",
          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _expert(k: int, base: dict[str, torch.Tensor], *, seed: int, layers: int,
            dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Expert k's tensors (unchanged ones shared with `base`) and its partly changed rows."""
    tensors, changed_rows = {}, {}
    for name, tensor in base.items():
        change = _delta(name, tuple(tensor.shape), _expert_shape(k), layers=layers,
                        g=_generator(seed, f"expert_{k}", name))
        if change is None:
            tensors[name] = tensor
            continue
        rows, delta = change
        updated = delta.add_(tensor[rows]).to(dtype)  # fp32 sum, one rounding
        if updated.shape != tensor.shape:
            updated, part = tensor.clone(), updated
            updated[rows] = part
            changed_rows[name] = [rows.start, rows.stop]
        tensors[name] = updated
    return tensors, changed_rows


DEMO_MARKER = ".mergepipe-demo"  # beside base/ and expert_*/: a rerun may rewrite them
_MARKER_TEXT = "written by `mergepipe demo`; its base/ and expert_*/ may be rewritten\n"
_METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "model.safetensors.index.json")


def _demo_writes(name: str) -> bool:
    """A file name a rerun replaces or deletes in a model folder (_write_metadata, _write_weights)."""
    return name in _METADATA or (name.startswith("model") and name.endswith(".safetensors"))


def _read_marker(out: Path) -> dict | None:
    """The marker's record {"files": {model/name: blake3}, "writing": [model]}; None for a
    marker of an earlier version (no record: its folders are trusted as before)."""
    import json
    try:
        rest = (out / DEMO_MARKER).read_text(encoding="utf-8").split("\n", 1)[1]
        record = json.loads(rest) if rest.strip() else None
    except (OSError, ValueError, IndexError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("files"), dict) and isinstance(record.get("writing"), list)
    return record if ok else None


def _write_marker(out: Path, record: dict) -> None:
    atomic_write_bytes(out / DEMO_MARKER, _MARKER_TEXT.encode() + canonical_json(record) + b"\n")


def _check_target(out: Path, models: list[str]) -> None:
    """`mergepipe demo models` where models/base is the user's real model must not replace its
    weights: model folders are rewritten only under a folder that demo wrote before (its marker),
    and there only files of the bytes demo wrote (the marker records their blake3): a fine-tune
    saved into expert_0/, or a user's model put at expert_3/, is refused, not replaced.
    A file or a dangling link where a folder goes is refused too (mkdir's traceback before)."""
    for path in (out, *(out / m for m in models)):
        if (path.is_symlink() or path.exists()) and not path.is_dir():
            raise OutputError(f"{path}: exists and is not a folder; give the demo a new folder")
    if (out / DEMO_MARKER).is_file():
        record = _read_marker(out)
        if record is None:
            return
        for model in models:
            folder = out / model
            if model in record["writing"] or not folder.is_dir():
                continue  # a rerun of one cut short rewrites it
            for f in sorted(folder.iterdir()):
                if _demo_writes(f.name) and not (f.is_file() and not f.is_symlink()
                                                 and record["files"].get(f"{model}/{f.name}") == hash_file(f)):
                    raise OutputError(f"{f}: was not written by `mergepipe demo` (not the bytes it wrote); "
                                      "refusing to overwrite it; move it out, or give the demo a new folder")
        return
    for model in models:
        folder = out / model
        if folder.is_dir() and any(folder.iterdir()):
            raise OutputError(f"{folder}: exists and was not written by `mergepipe demo`; refusing to "
                              "overwrite its weights; give the demo a new folder")


def make_family(out_dir: str | Path, *, preset: str = "tiny", n_experts: int = 3,
                dtype: str = "bfloat16", tied: bool | None = None, seed: int = 0,
                shard_expert: int | None = 0, shard_bytes: int | None = None,
                progress: bool = False) -> dict:
    """Write `out_dir/base` and `out_dir/expert_0 .. expert_{n_experts-1}`.

    Expert `shard_expert` (-1: the base; None: none) is written as shards of at most
    `shard_bytes` (default: a third of the model) with a model.safetensors.index.json.
    Holds the base and one expert in memory at a time (peak RSS 3.3 GB for "bench", bf16).
    Returns a description: paths, preset, dtype, tied, the sharded expert, and per expert
    the tensors byte-identical to the base and the row ranges of partly changed tensors.
    Raises ConfigError on an unknown preset or dtype, or n_experts < 1.
    """
    if preset not in PRESETS or dtype not in DTYPES or n_experts < 1:
        raise ConfigError(f"demo family: need preset in {sorted(PRESETS)}, dtype in "
                          f"{sorted(DTYPES)} and n_experts >= 1; got {preset!r}, {dtype!r}, "
                          f"{n_experts}")
    p, out = PRESETS[preset], Path(out_dir)
    _check_target(out, ["base", *(f"expert_{k}" for k in range(n_experts))])
    out.mkdir(parents=True, exist_ok=True)
    models = ["base", *(f"expert_{k}" for k in range(n_experts))]
    record = _read_marker(out) or {"files": {}, "writing": []}
    record = {"files": {k: v for k, v in record["files"].items() if k.split("/")[0] not in models},
              "writing": sorted(set(record["writing"]) | set(models))}
    _write_marker(out, record)
    tied = p.tied if tied is None else tied
    family: dict = {"preset": preset, "dtype": dtype, "tied": tied, "seed": seed,
                    "base": str(out / "base"), "experts": [], "sharded": None,
                    "identical": {}, "changed_rows": {}}
    base: dict[str, torch.Tensor] = {}
    for k in range(-1, n_experts):  # -1 is the base
        started, model = time.perf_counter(), "base" if k < 0 else f"expert_{k}"
        if k < 0:
            tensors = base = {
                name: _base_tensor(shape, _generator(seed, model, name)).to(DTYPES[dtype])
                for name, shape in _shapes(p, tied=tied).items()}
        else:
            tensors, family["changed_rows"][model] = _expert(
                k, base, seed=seed, layers=p.layers, dtype=DTYPES[dtype])
            family["experts"].append(str(out / model))
            # Compared, not assumed: a small delta can round away entirely in bf16.
            family["identical"][model] = [n for n in base if torch.equal(tensors[n], base[n])]
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        if k == shard_expert:
            family["sharded"] = model
        (out / model).mkdir(parents=True, exist_ok=True)
        _write_metadata(out / model, p, tied=tied, dtype=dtype)
        _write_weights(out / model, tensors, shard_bytes=(
            shard_bytes or -(-total // 3)) if k == shard_expert else None)
        record["files"].update({f"{model}/{f.name}": hash_file(f) for f in sorted((out / model).iterdir())
                                if _demo_writes(f.name) and f.is_file()})
        record["writing"].remove(model)
        _write_marker(out, record)
        if progress:
            print(f"demo: {model} {total / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
        del tensors  # else the last expert is still alive while the next one is built
    return family


def run(args: argparse.Namespace) -> int:
    """Write the family `args` describe; print its folders unless quiet.

    Raises:
        MergepipeError: a folder that is not the demo's, a bad count; OutputError for an
            OSError (a parent that is a file, no permission, disk full).
    """
    try:
        family = make_family(args.out, preset=args.preset, n_experts=args.experts,
                             dtype=args.dtype, tied=args.tied, seed=args.seed,
                             progress=not args.quiet)
    except OSError as e:
        raise OutputError(f"{e.filename or args.out}: cannot write the demo family: {e.strerror}") from None
    if not args.quiet:
        print("\n".join([family["base"], *family["experts"]]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mergepipe.commands.demo", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except MergepipeError as error:  # one line: a newline in a name is shown escaped (as cli.one_line)
        print("error: " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(error)), file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
