"""Hostile inputs, built by code in a temp folder (no binary files in the repo).

Each case is a generator `build(ctx, work) -> Setup`: it writes one malformed or
hostile input (a checkpoint file, a model folder, a params.yaml, an output path)
under `work`, and returns the `mergepipe` command line that must fail on it, the
output path that must stay absent (or untouched), and the names (file, tensor,
key) that the one error line must contain. `tests/test_corpus.py` runs them all.

Inputs are copies of a seeded demo family (`mergepipe.commands.demo.make_family`, preset
"tiny"): the hostile expert is `ctx.experts[1]` (one file) or `ctx.experts[0]`
(sharded, with an index json), copied into `work/bad` and then damaged.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

INDEX_JSON = "model.safetensors.index.json"
VICTIM = "model.layers.1.self_attn.q_proj.weight"  # changed in every demo expert, 128 x 128 bf16
WIDE = "model.layers.1.mlp.gate_proj.weight"  # 384 x 128


@dataclass(frozen=True)
class Ctx:
    """A read-only demo family and a cache folder shared by all cases."""

    base: Path
    experts: tuple[Path, ...]
    cache: Path


@dataclass(frozen=True)
class Setup:
    argv: list[str]  # mergepipe command line (without the program name)
    out: Path  # the output path: must stay absent, or untouched if it existed
    expect: tuple[str, ...]  # substrings of the error line: file, tensor or key names
    exit_code: int  # the error class's exit code (errors.py)
    marker: Path | None = None  # a file that a pickle payload would create; must never appear
    existing_ok: bool = True  # whether a previous complete output may be placed at `out` first


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Ctx, Path], Setup]
    doc: str = field(default="")


CASES: dict[str, Case] = {}

CONFIG, CHECKPOINT, BUDGET, METHOD, INTEGRITY, OUTPUT = 2, 3, 4, 5, 6, 7


def case(fn: Callable[[Ctx, Path], Setup]) -> Callable[[Ctx, Path], Setup]:
    name = fn.__name__.removeprefix("c_")
    CASES[name] = Case(name, fn, (fn.__doc__ or "").strip())
    return fn


# ------------------------------------------------------------------ helpers

def write_params(work: Path, ctx: Ctx, bad: Path | None = None, **overrides) -> Path:
    """params.yaml: base + a good expert (+ the hostile one as `bad`), task_arithmetic, full budget."""
    experts = [{"name": "good", "path": str(ctx.experts[2]), "weight": 0.5}]
    if bad is not None:
        experts.append({"name": "bad", "path": str(bad), "weight": 1.0})
    cfg = {"base": str(ctx.base), "experts": experts, "method": "task_arithmetic",
           "parameters": {"lambda": 1.0}, "seed": 0, "budget": "full", "block_bytes": "16KiB",
           "output": {"dir": str(work / "out")}, "cache_dir": str(ctx.cache)}
    for key, value in overrides.items():
        cfg[key] = value
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(work: Path, ctx: Ctx, bad: Path | None, expect: tuple[str, ...], exit_code: int, *,
        marker: Path | None = None, extra: tuple[str, ...] = (), **overrides) -> Setup:
    params = write_params(work, ctx, bad, **overrides)
    out = Path(overrides.get("output", {}).get("dir", work / "out"))
    return Setup(["run", str(params), "-q", *extra], out, expect, exit_code, marker)


def copy_expert(ctx: Ctx, work: Path, k: int = 1, name: str = "bad") -> Path:
    dst = work / name
    shutil.copytree(ctx.experts[k], dst)
    return dst


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header: dict | bytes, data: bytes, *, length: int | None = None) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)


def damage_header(ctx: Ctx, work: Path, edit: Callable[[dict], dict | bytes | None],
                  expect_tensor: str | None = None, exit_code: int = CHECKPOINT) -> Setup:
    """Copy expert_1 (one file), rewrite its header with `edit`, keep the data."""
    bad = copy_expert(ctx, work)
    f = bad / "model.safetensors"
    header, data = read_st(f)
    new = edit(header)
    write_st(f, header if new is None else new, data)
    return run(work, ctx, bad, (str(f),) + ((expect_tensor,) if expect_tensor else ()), exit_code)


def rewrite_tensors(ctx: Ctx, work: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy expert_1 and rewrite its tensors with safetensors itself (a valid file, wrong content)."""
    bad = copy_expert(ctx, work)
    f = bad / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    f.unlink()
    save_file(tensors, f, metadata={"format": "pt"})
    return bad


def last_tensor(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def first_tensor(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


class _Payload:
    """Unpickling this creates `marker`: proof that a pickle was (wrongly) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps({"model.embed_tokens.weight": _Payload(marker)}, protocol=4)


def sharded(ctx: Ctx, work: Path, edit: Callable[[Path, dict], None], expect: tuple[str, ...],
            exit_code: int = CHECKPOINT) -> Setup:
    """Copy expert_0 (sharded) and edit its index json (the weight_map) with `edit(folder, index)`."""
    bad = copy_expert(ctx, work, k=0)
    index = json.loads((bad / INDEX_JSON).read_text())
    edit(bad, index)
    if index is not None:
        (bad / INDEX_JSON).write_text(json.dumps(index))
    return run(work, ctx, bad, tuple(str(bad / e) if e == INDEX_JSON else e for e in expect), exit_code)


def shard_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


# ------------------------------------------------------------- file level

@case
def c_empty_file(ctx, work):
    """model.safetensors of 0 bytes."""
    bad = copy_expert(ctx, work)
    (bad / "model.safetensors").write_bytes(b"")
    return run(work, ctx, bad, (str(bad / "model.safetensors"),), CHECKPOINT)


@case
def c_shorter_than_length_field(ctx, work):
    """3 bytes: not even the 8-byte header length."""
    bad = copy_expert(ctx, work)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00")
    return run(work, ctx, bad, (str(bad / "model.safetensors"),), CHECKPOINT)


@case
def c_truncated_in_header(ctx, work):
    """File cut in the middle of the JSON header."""
    bad = copy_expert(ctx, work)
    f = bad / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    f.write_bytes(raw[:8 + n // 2])
    return run(work, ctx, bad, (str(f),), CHECKPOINT)


@case
def c_truncated_in_data(ctx, work):
    """File cut inside the last tensor's data: that tensor is named."""
    bad = copy_expert(ctx, work)
    f = bad / "model.safetensors"
    header, _ = read_st(f)
    f.write_bytes(f.read_bytes()[:-1000])
    return run(work, ctx, bad, (str(f), "tensor '", "out of range"), CHECKPOINT)


@case
def c_header_length_past_eof(ctx, work):
    """Header length field larger than the file."""
    bad = copy_expert(ctx, work)
    f = bad / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) + 4096)
    f.write_bytes(bytes(raw))
    return run(work, ctx, bad, (str(f),), CHECKPOINT)


@case
def c_header_length_over_limit(ctx, work):
    """Header length claims 1 TB (> the 100 MB limit): refused before any allocation."""
    bad = copy_expert(ctx, work)
    f = bad / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", 10**12)
    f.write_bytes(bytes(raw))
    return run(work, ctx, bad, (str(f), "limit"), CHECKPOINT)


@case
def c_header_not_utf8(ctx, work):
    """A tensor name with a byte that is not UTF-8."""
    return damage_header(ctx, work, lambda h: json.dumps(h).encode().replace(VICTIM.encode(), b"bad\xff\xfename"))


@case
def c_header_invalid_json(ctx, work):
    """Header JSON cut short (closing brace replaced)."""
    return damage_header(ctx, work, lambda h: json.dumps(h).encode()[:-1] + b",")


@case
def c_header_not_object(ctx, work):
    """Header is a JSON array."""
    return damage_header(ctx, work, lambda h: b"[" + b",".join(json.dumps(k).encode() for k in h) + b"]")


@case
def c_header_deeply_nested(ctx, work):
    """100,000 nested arrays: JSON parsers that recurse blow the stack."""
    return damage_header(ctx, work, lambda h: b"[" * 100_000 + b"]" * 100_000)


@case
def c_unknown_dtype(ctx, work):
    """dtype 'F128'."""
    return damage_header(ctx, work, lambda h: h[VICTIM].update(dtype="F128"), VICTIM)


@case
def c_dtype_not_a_string(ctx, work):
    """dtype given as a list (unhashable)."""
    return damage_header(ctx, work, lambda h: h[VICTIM].update(dtype=["BF16"]), VICTIM)


@case
def c_negative_shape(ctx, work):
    return damage_header(ctx, work, lambda h: h[VICTIM].update(shape=[-128, -128]), VICTIM)


@case
def c_float_shape(ctx, work):
    return damage_header(ctx, work, lambda h: h[VICTIM].update(shape=[128.0, 128]), VICTIM)


@case
def c_huge_shape(ctx, work):
    """Shape entries of 2**62: no overflow, no allocation, just an error."""
    return damage_header(ctx, work, lambda h: h[VICTIM].update(shape=[2**62, 2**62]), VICTIM)


@case
def c_shape_product_overflows_int64(ctx, work):
    """Each entry < 2**53, product far beyond int64."""
    return damage_header(ctx, work, lambda h: h[VICTIM].update(shape=[2**40, 2**40, 2**40]), VICTIM)


@case
def c_shape_not_a_list(ctx, work):
    return damage_header(ctx, work, lambda h: h[VICTIM].update(shape="128x128"), VICTIM)


@case
def c_offsets_out_of_range(ctx, work):
    """The last tensor ends 100 bytes past the end of the file."""
    def edit(h):
        last = last_tensor(h)
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [b + 100, e + 100]
    bad = copy_expert(ctx, work)
    header, _ = read_st(bad / "model.safetensors")
    shutil.rmtree(bad)
    return damage_header(ctx, work, edit, last_tensor(header))


@case
def c_offsets_overlapping(ctx, work):
    """One tensor shifted 2 bytes back into its predecessor."""
    def edit(h):
        b, e = h[VICTIM]["data_offsets"]
        h[VICTIM]["data_offsets"] = [b - 2, e - 2]
    return damage_header(ctx, work, edit, VICTIM)


@case
def c_offsets_reversed(ctx, work):
    """data_offsets [end, begin]."""
    return damage_header(ctx, work, lambda h: h[VICTIM].update(data_offsets=h[VICTIM]["data_offsets"][::-1]),
                         VICTIM)


@case
def c_offsets_not_integers(ctx, work):
    return damage_header(ctx, work, lambda h: h[VICTIM].update(
        data_offsets=[str(o) for o in h[VICTIM]["data_offsets"]]), VICTIM)


@case
def c_offsets_leave_gap(ctx, work):
    """The first tensor starts 2 bytes into the data region (an undescribed gap)."""
    def edit(h):
        first = first_tensor(h)
        b, e = h[first]["data_offsets"]
        h[first]["data_offsets"] = [b + 2, e + 2]
    bad = copy_expert(ctx, work)
    header, _ = read_st(bad / "model.safetensors")
    shutil.rmtree(bad)
    return damage_header(ctx, work, edit, first_tensor(header))


@case
def c_nbytes_not_shape_times_itemsize(ctx, work):
    """shape [128, 127] for 128 x 128 x 2 bytes."""
    return damage_header(ctx, work, lambda h: h[VICTIM].update(shape=[128, 127]), VICTIM)


@case
def c_duplicate_tensor_name(ctx, work):
    """The same key twice in the header JSON (a plain dict parser keeps the last one silently)."""
    def edit(h):
        text = json.dumps(h)
        dup = json.dumps({VICTIM: h[VICTIM]})[1:-1]
        return (text[:-1] + ", " + dup + "}").encode()
    return damage_header(ctx, work, edit, VICTIM)


@case
def c_metadata_non_string_value(ctx, work):
    return damage_header(ctx, work, lambda h: h.update(__metadata__={"format": "pt", "step": 1000}), "__metadata__")


@case
def c_metadata_not_an_object(ctx, work):
    """__metadata__ is an (empty) list."""
    return damage_header(ctx, work, lambda h: h.update(__metadata__=[]), "__metadata__")


@case
def c_entry_with_extra_field(ctx, work):
    return damage_header(ctx, work, lambda h: h[VICTIM].update(quantized=True), VICTIM)


@case
def c_tensor_name_lone_surrogate(ctx, work):
    """A tensor name that is not valid Unicode (JSON escape of a lone surrogate)."""
    def edit(h):
        h["\ud800" + VICTIM] = h.pop(VICTIM)
    return damage_header(ctx, work, edit)


@case
def c_file_name_with_control_characters(ctx, work):
    """A damaged file named with a newline and a terminal escape: the error stays one line."""
    bad = copy_expert(ctx, work)
    evil = bad / "evil\n\x1b[2J.safetensors"
    (bad / "model.safetensors").rename(evil)
    evil.write_bytes(evil.read_bytes()[:100])
    return run(work, ctx, bad, ("evil\\n\\x1b[2J.safetensors",), CHECKPOINT)


@case
def c_directory_named_safetensors(ctx, work):
    """model.safetensors is a directory."""
    bad = copy_expert(ctx, work)
    (bad / "model.safetensors").unlink()
    (bad / "model.safetensors").mkdir()
    return run(work, ctx, bad, (str(bad / "model.safetensors"),), CHECKPOINT)


@case
def c_fifo_named_safetensors(ctx, work):
    """model.safetensors is a named pipe: opening it must not block forever."""
    bad = copy_expert(ctx, work)
    (bad / "model.safetensors").unlink()
    os.mkfifo(bad / "model.safetensors")
    return run(work, ctx, bad, (str(bad / "model.safetensors"),), CHECKPOINT)


# ------------------------------------------------------------- pickles

@case
def c_pickle_only_folder(ctx, work):
    """pytorch_model.bin whose unpickling would create a marker file: refused, never loaded."""
    bad = work / "bad"
    bad.mkdir()
    shutil.copyfile(ctx.experts[1] / "config.json", bad / "config.json")
    marker = work / "UNPICKLED"
    (bad / "pytorch_model.bin").write_bytes(evil_pickle(marker))
    return run(work, ctx, bad, (str(bad), "pytorch_model.bin"), CHECKPOINT, marker=marker)


@case
def c_pt_file_as_model_path(ctx, work):
    """The expert path is a .pt pickle file."""
    marker = work / "UNPICKLED"
    pt = work / "expert.pt"
    pt.write_bytes(evil_pickle(marker))
    return run(work, ctx, pt, (str(pt), "pickle"), CHECKPOINT, marker=marker)


@case
def c_pickle_disguised_as_safetensors(ctx, work):
    """A pickle renamed to model.safetensors."""
    bad = copy_expert(ctx, work)
    marker = work / "UNPICKLED"
    (bad / "model.safetensors").write_bytes(evil_pickle(marker))
    return run(work, ctx, bad, (str(bad / "model.safetensors"),), CHECKPOINT, marker=marker)


@case
def c_pickle_beside_sharded_index(ctx, work):
    """weight_map points at a .bin pickle inside the folder."""
    marker = work / "UNPICKLED"

    def edit(folder, index):
        (folder / "pytorch_model-00001.bin").write_bytes(evil_pickle(marker))
        first = shard_names(folder)[0]
        (folder / first).unlink()
        for k, v in index["weight_map"].items():
            if v == first:
                index["weight_map"][k] = "pytorch_model-00001.bin"
    s = sharded(ctx, work, edit, ("pytorch_model-00001.bin",))
    return Setup(s.argv, s.out, s.expect, s.exit_code, marker)


# ------------------------------------------------------------- folders and index json

@case
def c_empty_model_folder(ctx, work):
    bad = work / "bad"
    bad.mkdir()
    return run(work, ctx, bad, (str(bad),), CHECKPOINT)


@case
def c_missing_model_folder(ctx, work):
    return run(work, ctx, work / "no-such-model", (str(work / "no-such-model"),), CHECKPOINT)


@case
def c_two_files_without_index(ctx, work):
    """Shards but no model.safetensors.index.json."""
    bad = copy_expert(ctx, work, k=0)
    (bad / INDEX_JSON).unlink()
    return run(work, ctx, bad, (str(bad), INDEX_JSON), CHECKPOINT)


@case
def c_weight_map_parent_dir(ctx, work):
    """weight_map names '../outside.safetensors' (a valid file outside the folder)."""
    def edit(folder, index):
        first = shard_names(folder)[0]
        shutil.copyfile(folder / first, work / "outside.safetensors")
        for k, v in index["weight_map"].items():
            if v == first:
                index["weight_map"][k] = "../outside.safetensors"
    return sharded(ctx, work, edit, (INDEX_JSON, "../outside.safetensors"))


@case
def c_weight_map_absolute_path(ctx, work):
    def edit(folder, index):
        first = shard_names(folder)[0]
        shutil.copyfile(folder / first, work / "outside.safetensors")
        for k, v in index["weight_map"].items():
            if v == first:
                index["weight_map"][k] = str(work / "outside.safetensors")
    return sharded(ctx, work, edit, (INDEX_JSON, str(work / "outside.safetensors")))


@case
def c_weight_map_symlink_out(ctx, work):
    """weight_map names a file in the folder that is a symlink to a file outside it."""
    def edit(folder, index):
        first = shard_names(folder)[0]
        shutil.move(folder / first, work / "outside.safetensors")
        os.symlink(work / "outside.safetensors", folder / first)
    bad_first = shard_names(ctx.experts[0])[0]
    return sharded(ctx, work, edit, (INDEX_JSON, bad_first))


@case
def c_weight_map_missing_file(ctx, work):
    def edit(folder, index):
        index["weight_map"][VICTIM] = "model-00009-of-00009.safetensors"
    return sharded(ctx, work, edit, (INDEX_JSON, "model-00009-of-00009.safetensors"))


@case
def c_weight_map_not_a_string(ctx, work):
    def edit(folder, index):
        index["weight_map"][VICTIM] = 7
    return sharded(ctx, work, edit, (INDEX_JSON, "7"))


@case
def c_index_disagrees_with_shards(ctx, work):
    """weight_map puts a tensor in the wrong shard."""
    def edit(folder, index):
        names = shard_names(folder)
        now = index["weight_map"][VICTIM]
        index["weight_map"][VICTIM] = names[0] if now != names[0] else names[1]
    return sharded(ctx, work, edit, (INDEX_JSON, VICTIM))


@case
def c_index_lists_unknown_tensor(ctx, work):
    def edit(folder, index):
        index["weight_map"]["model.layers.99.ghost.weight"] = shard_names(folder)[0]
    return sharded(ctx, work, edit, (INDEX_JSON, "model.layers.99.ghost.weight"))


@case
def c_index_omits_a_tensor(ctx, work):
    def edit(folder, index):
        del index["weight_map"][VICTIM]
    return sharded(ctx, work, edit, (INDEX_JSON, VICTIM))


@case
def c_index_invalid_json(ctx, work):
    bad = copy_expert(ctx, work, k=0)
    (bad / INDEX_JSON).write_text('{"weight_map": {')
    return run(work, ctx, bad, (str(bad / INDEX_JSON),), CHECKPOINT)


@case
def c_index_deeply_nested(ctx, work):
    bad = copy_expert(ctx, work, k=0)
    (bad / INDEX_JSON).write_text("[" * 100_000 + "]" * 100_000)
    return run(work, ctx, bad, (str(bad / INDEX_JSON),), CHECKPOINT)


# ------------------------------------------------------------- expert vs base

@case
def c_expert_missing_tensor(ctx, work):
    bad = rewrite_tensors(ctx, work, lambda t: t.pop(VICTIM))
    return run(work, ctx, bad, (str(bad), VICTIM, "missing"), CHECKPOINT)


@case
def c_expert_extra_tensor(ctx, work):
    bad = rewrite_tensors(ctx, work, lambda t: t.update({"model.extra.weight": torch.zeros(4, dtype=torch.bfloat16)}))
    return run(work, ctx, bad, (str(bad), "model.extra.weight"), CHECKPOINT)


@case
def c_expert_shape_mismatch(ctx, work):
    bad = rewrite_tensors(ctx, work, lambda t: t.update({WIDE: t[WIDE][:-1].clone()}))
    return run(work, ctx, bad, (str(bad), WIDE), CHECKPOINT)


@case
def c_expert_dtype_mismatch(ctx, work):
    bad = rewrite_tensors(ctx, work, lambda t: t.update({VICTIM: t[VICTIM].to(torch.float16)}))
    return run(work, ctx, bad, (str(bad), VICTIM, "F16"), CHECKPOINT)


def _poison(value: float):
    def edit(t):
        x = t[VICTIM].clone()
        x[3, 5] = value
        t[VICTIM] = x
    return edit


@case
def c_expert_nan(ctx, work):
    """One NaN in an expert tensor: error by default (nonfinite: error), tensor named."""
    bad = rewrite_tensors(ctx, work, _poison(float("nan")))
    return run(work, ctx, bad, (str(bad), VICTIM, "NaN"), CHECKPOINT)


@case
def c_expert_inf(ctx, work):
    bad = rewrite_tensors(ctx, work, _poison(float("-inf")))
    return run(work, ctx, bad, (str(bad), VICTIM, "nonfinite"), CHECKPOINT)


@case
def c_base_header_damaged(ctx, work):
    """The base (not an expert) has an unknown dtype."""
    base = work / "base"
    shutil.copytree(ctx.base, base)
    f = base / "model.safetensors"
    header, data = read_st(f)
    header[VICTIM]["dtype"] = "Q4_K"
    write_st(f, header, data)
    return run(work, ctx, None, (str(f), VICTIM), CHECKPOINT, base=str(base))


# ------------------------------------------------------------- config

@case
def c_unknown_method(ctx, work):
    return run(work, ctx, None, ("params.yaml", "method", "frankenmerge"), CONFIG, method="frankenmerge")


@case
def c_zero_budget(ctx, work):
    return run(work, ctx, None, ("params.yaml", "budget"), CONFIG, budget=0)


@case
def c_negative_budget(ctx, work):
    return run(work, ctx, None, ("params.yaml", "budget", "-5%"), CONFIG, budget="-5%")


@case
def c_zero_budget_on_command_line(ctx, work):
    return run(work, ctx, None, ("budget", "0"), CONFIG, extra=("--budget", "0"))


@case
def c_expert_density_zero(ctx, work):
    params = write_params(work, ctx)
    cfg = yaml.safe_load(params.read_text())
    cfg["method"], cfg["parameters"] = "ties", {"density": 0.5}
    cfg["experts"][0]["density"] = 0.0
    params.write_text(yaml.safe_dump(cfg))
    return Setup(["run", str(params), "-q"], work / "out", ("params.yaml", "experts[0].density"), CONFIG)


@case
def c_density_above_one(ctx, work):
    return run(work, ctx, None, ("params.yaml", "density", "1.5"), CONFIG, method="ties",
               parameters={"density": 1.5})


@case
def c_negative_density(ctx, work):
    return run(work, ctx, None, ("params.yaml", "density"), CONFIG, method="ties",
               parameters={"density": -0.1})


@case
def c_weights_sum_to_zero_under_normalize(ctx, work):
    params = write_params(work, ctx, copy_expert(ctx, work, k=1, name="e1"), method="linear", parameters={})
    cfg = yaml.safe_load(params.read_text())
    cfg["experts"][0]["weight"], cfg["experts"][1]["weight"] = 0.5, -0.5
    params.write_text(yaml.safe_dump(cfg))
    return Setup(["run", str(params), "-q"], work / "out", ("params.yaml", "weights", "normalize"), CONFIG)


@case
def c_config_not_a_mapping(ctx, work):
    params = work / "params.yaml"
    params.write_text("- base\n- experts\n")
    return Setup(["run", str(params), "-q"], work / "out", (str(params),), CONFIG)


@case
def c_config_invalid_yaml(ctx, work):
    params = work / "params.yaml"
    params.write_text("base: [unclosed\nexperts: {\n")
    return Setup(["run", str(params), "-q"], work / "out", (str(params),), CONFIG)


@case
def c_config_unknown_key(ctx, work):
    return run(work, ctx, None, ("params.yaml", "budgett"), CONFIG, budgett="10%")


@case
def c_nonfinite_mode_unknown(ctx, work):
    return run(work, ctx, None, ("params.yaml", "nonfinite"), CONFIG, nonfinite="ignore")


# ------------------------------------------------------------- output path

@case
def c_output_is_an_input_dir(ctx, work):
    """output.dir is the (copied) expert folder: the input must stay untouched."""
    bad = copy_expert(ctx, work, name="e1")
    s = run(work, ctx, bad, ("params.yaml", "output.dir", "experts[1].path"), CONFIG, output={"dir": str(bad)})
    return Setup(s.argv, s.out, s.expect, s.exit_code, existing_ok=False)


@case
def c_output_inside_an_input_dir(ctx, work):
    bad = copy_expert(ctx, work, name="e1")
    s = run(work, ctx, bad, ("params.yaml", "output.dir"), CONFIG, output={"dir": str(bad / "merged")})
    return s


@case
def c_output_is_the_base_via_cli(ctx, work):
    base = work / "base"
    shutil.copytree(ctx.base, base)
    s = run(work, ctx, None, ("output.dir", "base"), CONFIG, base=str(base), extra=("-o", str(base)))
    return Setup(s.argv, base, s.expect, s.exit_code, existing_ok=False)


@case
def c_output_is_a_file(ctx, work):
    out = work / "out"
    out.write_text("not a folder\n")
    s = run(work, ctx, None, (str(out), "not a folder"), OUTPUT)
    return Setup(s.argv, s.out, s.expect, s.exit_code, existing_ok=False)


@case
def c_output_parent_is_a_file(ctx, work):
    (work / "blocker").write_text("x")
    s = run(work, ctx, None, (str(work / "blocker"),), OUTPUT, output={"dir": str(work / "blocker" / "out")})
    return Setup(s.argv, s.out, s.expect, s.exit_code, existing_ok=False)


@case
def c_cache_dir_is_output_dir(ctx, work):
    return run(work, ctx, None, ("params.yaml", "cache_dir"), CONFIG, cache_dir=str(work / "out"))


# ------------------------------------------------------------- plan files (`mergepipe merge`)

@case
def c_plan_file_not_json(ctx, work):
    plan = work / "plan.json"
    plan.write_text("{not json")
    return Setup(["merge", str(plan), "-o", str(work / "out"), "--cache-dir", str(ctx.cache), "-q"],
                 work / "out", (str(plan),), CONFIG)


@case
def c_plan_file_edited(ctx, work):
    """A plan whose fields were edited by hand (here: a key removed)."""
    plan = work / "plan.json"
    plan.write_text(json.dumps({"schema": 1, "plan_hash": "0" * 64, "experts": []}))
    return Setup(["merge", str(plan), "-o", str(work / "out"), "--cache-dir", str(ctx.cache), "-q"],
                 work / "out", (str(plan), "plan_hash"), CONFIG)


@case
def c_plan_file_deeply_nested(ctx, work):
    plan = work / "plan.json"
    plan.write_text("[" * 100_000 + "]" * 100_000)
    return Setup(["merge", str(plan), "-o", str(work / "out"), "--cache-dir", str(ctx.cache), "-q"],
                 work / "out", (str(plan),), CONFIG)


# ------------------------------------------------------------- plans edited with their hash recomputed (issue 15)
# plan_hash has no key: anyone who edits a plan can recompute it. `merge` must check every field.

def edited_plan(ctx: Ctx, work: Path, edit: Callable[[dict], None], expect: tuple[str, ...],
                exit_code: int = CONFIG, budget: str = "30%") -> Setup:
    """A real plan (base + two experts, 30% budget, whole-block reads: strategy energy; the
    sketch plans' own edits are tests/test_sketch.py's) edited by `edit`, its plan_hash recomputed."""
    from mergepipe.cli import main
    from mergepipe.plan.planner import plan_hash
    params = write_params(work, ctx, ctx.experts[1], budget=budget, plan={"strategy": "energy"})
    plan_path = work / "plan.json"
    assert main(["plan", str(params), "-q", "-o", str(plan_path)]) == 0
    plan = json.loads(plan_path.read_text())
    edit(plan)
    plan["plan_hash"] = plan_hash(plan)
    plan_path.write_text(json.dumps(plan))
    return Setup(["merge", str(plan_path), "-o", str(work / "out"), "--cache-dir", str(ctx.cache), "-q"],
                 work / "out", (str(plan_path), *expect), exit_code)


def _unplanned_block(plan: dict, ctx: Ctx) -> tuple[str, str, int, int]:
    """(expert, tensor, block, bytes) of a block of VICTIM that the plan does not read but could."""
    from mergepipe.checkpoint.safetensors import open_checkpoint
    from mergepipe.index.store import Store
    bb = plan["block_bytes"]
    store = Store(ctx.cache)
    base, base_index = store.model_index(ctx.base, block_bytes=bb)
    for e in plan["experts"]:
        ck, idx = store.model_index(e["path"], block_bytes=bb)
        delta = store.delta_index(base, base_index, ck, idx)
        for name, entry in idx.tensors.items():
            planned = set(plan["reads"][e["name"]].get(name, []))
            t = open_checkpoint(e["path"]).tensors[name]
            for b, (r0, r1) in enumerate(entry.ranges):
                if b not in planned and not delta.tensors[name].identical[b] and t.dtype == "BF16":
                    return e["name"], name, b, (r1 - r0) * t.row_bytes()
    raise AssertionError("no unplanned block")


def _add_read(plan: dict, expert: str, tensor: str, block: int, nbytes: int) -> None:
    plan["reads"][expert][tensor] = sorted({*plan["reads"][expert].get(tensor, []), block})
    plan["bytes"]["planned_by_expert"][expert] += nbytes
    plan["bytes"]["planned_expert_bytes"] += nbytes
    plan["bytes"]["planned_pairs"] += 1


@case
def c_plan_reads_over_budget(ctx, work):
    """One more block read, counts updated: more than budget_bytes."""
    def edit(plan):
        e, t, b, n = _unplanned_block(plan, ctx)
        _add_read(plan, e, t, b, plan["budget_bytes"])  # claim the bytes that make it exceed
    return edited_plan(ctx, work, edit, ("budget_bytes",))


@case
def c_plan_reads_over_budget_with_budget_raised(ctx, work):
    """Reads added and budget_bytes raised to fit them: the budget (30%) of these inputs says otherwise."""
    def edit(plan):
        e, t, b, n = _unplanned_block(plan, ctx)
        _add_read(plan, e, t, b, n)
        plan["budget_bytes"] += n
    return edited_plan(ctx, work, edit, ("budget_bytes", "30%"))


@case
def c_plan_reads_bytes_undercounted(ctx, work):
    """A read added without counting its bytes: the recomputed bytes differ."""
    def edit(plan):
        e, t, b, n = _unplanned_block(plan, ctx)
        _add_read(plan, e, t, b, 0)
    return edited_plan(ctx, work, edit, ("planned_by_expert",))


@case
def c_plan_block_outside_tensor(ctx, work):
    """A read of block 9999 of a tensor with a few blocks (counts kept consistent)."""
    def edit(plan):
        e = plan["experts"][0]["name"]
        _add_read(plan, e, VICTIM, 9999, 0)
    return edited_plan(ctx, work, edit, (VICTIM, "9999", "outside"))


@case
def c_plan_unknown_tensor(ctx, work):
    def edit(plan):
        _add_read(plan, plan["experts"][0]["name"], "model.ghost.weight", 0, 0)
    return edited_plan(ctx, work, edit, ("model.ghost.weight",))


@case
def c_plan_reads_unknown_expert(ctx, work):
    def edit(plan):
        plan["reads"]["intruder"] = {VICTIM: [0]}
    return edited_plan(ctx, work, edit, ("reads.intruder",))


@case
def c_plan_reads_identical_block(ctx, work):
    """A read of a block identical to the base (counts kept consistent)."""
    def edit(plan):
        from mergepipe.index.store import Store
        store = Store(ctx.cache)
        base, base_index = store.model_index(ctx.base, block_bytes=plan["block_bytes"])
        for e in plan["experts"]:
            ck, idx = store.model_index(e["path"], block_bytes=plan["block_bytes"])
            delta = store.delta_index(base, base_index, ck, idx)
            for name, td in delta.tensors.items():
                if ck.tensors[name].dtype == "BF16" and any(td.identical):
                    b = td.identical.index(True)
                    r0, r1 = idx.tensors[name].ranges[b]
                    n = (r1 - r0) * ck.tensors[name].row_bytes()
                    _add_read(plan, e["name"], name, b, n)
                    plan["budget_bytes"] += n
                    return
        raise AssertionError("no identical block in the tiny family")
    return edited_plan(ctx, work, edit, ("identical",))


@case
def c_plan_bad_output_dtype(ctx, work):
    return edited_plan(ctx, work, lambda p: p["output"].update(dtype="float8"), ("output.dtype",))


@case
def c_plan_bad_shard_bytes(ctx, work):
    return edited_plan(ctx, work, lambda p: p["output"].update(shard_bytes=-1), ("output.shard_bytes",))


@case
def c_plan_shard_bytes_a_string(ctx, work):
    return edited_plan(ctx, work, lambda p: p["output"].update(shard_bytes="lots"), ("output.shard_bytes",))


@case
def c_plan_bad_lambda(ctx, work):
    return edited_plan(ctx, work, lambda p: p["parameters"].update({"lambda": "x"}), ("parameters.lambda",))


@case
def c_plan_unknown_parameter(ctx, work):
    return edited_plan(ctx, work, lambda p: p["parameters"].update(densty=0.5), ("parameters.densty",))


@case
def c_plan_density_out_of_range(ctx, work):
    def edit(plan):
        plan["method"] = "ties"
        plan["parameters"] = {"density": 7}
    return edited_plan(ctx, work, edit, ("parameters.density",))


@case
def c_plan_block_bytes_tiny(ctx, work):
    return edited_plan(ctx, work, lambda p: p.update(block_bytes=1), ("block_bytes",))


@case
def c_plan_unknown_method(ctx, work):
    return edited_plan(ctx, work, lambda p: p.update(method="frankenmerge"), ("method", "frankenmerge"))


@case
def c_plan_expert_weight_a_string(ctx, work):
    return edited_plan(ctx, work, lambda p: p["experts"][0].update(weight="1"), ("experts.0.weight",))


@case
def c_plan_reads_unsorted(ctx, work):
    def edit(plan):
        e = plan["experts"][0]["name"]
        t = next(t for t, bs in plan["reads"][e].items() if len(bs) > 1)
        plan["reads"][e][t] = plan["reads"][e][t][::-1]
    return edited_plan(ctx, work, edit, ("sorted",), budget="full")


@case
def c_part_count_huge(ctx, work):
    """--part 1/1000000000: refused at once (was a MemoryError after 34 s)."""
    s = edited_plan(ctx, work, lambda p: None, ("--part", "1000000000"))
    return Setup([*s.argv, "--part", "1/1000000000"], s.out, s.expect[1:], CONFIG)


@case
def c_part_count_above_tensor_count(ctx, work):
    s = edited_plan(ctx, work, lambda p: None, ("--part", "tensors"))
    return Setup([*s.argv, "--part", "1/500000"], s.out, s.expect[1:], CONFIG)


# ------------------------------------------------------------- output paths that hold the user's data (issue 15)

def _merge_to(ctx: Ctx, work: Path, out: str | Path, expect: tuple[str, ...], *, force: bool = False,
              exit_code: int = OUTPUT, existing_ok: bool = False) -> Setup:
    s = edited_plan(ctx, work, lambda p: None, ())
    argv = [a if a != str(work / "out") else str(out) for a in s.argv] + (["--force"] if force else [])
    return Setup(argv, Path(out) if str(out) else work / "out", expect, exit_code, existing_ok=existing_ok)


@case
def c_output_is_a_users_folder(ctx, work):
    """-o names an existing folder of the user's (not a merge): refused, nothing deleted."""
    mine = work / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work\n")
    return _merge_to(ctx, work, mine, (str(mine), "did not write", "--force"))


@case
def c_output_is_a_users_folder_via_run(ctx, work):
    mine = work / "data"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "x.csv").write_text("1,2\n")
    s = run(work, ctx, None, (str(mine), "did not write"), OUTPUT, extra=("-o", str(mine)))
    return Setup(s.argv, mine, s.expect, s.exit_code, existing_ok=False)


@case
def c_output_holds_a_users_manifest_json(ctx, work):
    """A folder of the user's that happens to hold a manifest.json (not ours)."""
    mine = work / "webapp"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"name": "my app"}')
    (mine / "index.html").write_text("<html></html>")
    return _merge_to(ctx, work, mine, (str(mine), "not a valid mergepipe manifest"))


@case
def c_output_merge_with_a_users_file_added(ctx, work):
    """A previous merge to which the user added notes: replacing it would delete them."""
    from mergepipe.cli import main
    params = write_params(work, ctx)
    out = work / "merged"
    assert main(["run", str(params), "-q", "-o", str(out)]) == 0
    (out / "notes.md").write_text("eval results\n")
    return _merge_to(ctx, work, out, (str(out), "notes.md"))


def _card_edited(ctx: Ctx, work: Path, out: Path, params: Path) -> None:
    """`out` published by `run`, then its model card edited by the user (a rebuild would lose it)."""
    from mergepipe.cli import main
    assert main(["run", str(params), "-q", "-o", str(out)]) == 0
    card = out / "README.md"
    card.write_text(card.read_text() + "\n## Our evaluation\n\n71.2 on the benchmark.\n")


@case
def c_output_merge_with_its_model_card_edited(ctx, work):
    """A merge into a previous output whose model card the user edited: refused, the edit kept."""
    out = work / "merged"
    _card_edited(ctx, work, out, write_params(work, ctx))
    return _merge_to(ctx, work, out, (str(out), "README.md", "edited"))


@case
def c_output_run_after_its_model_card_was_edited(ctx, work):
    """`run` rebuilds an output whose files changed since publication; an edited card is the
    user's, not damage: refused, the edit kept (--force replaces it)."""
    out = work / "merged"
    _card_edited(ctx, work, out, write_params(work, ctx, output={"dir": str(out)}))
    s = run(work, ctx, None, (str(out), "README.md", "edited", "--force"), OUTPUT, output={"dir": str(out)})
    return Setup(s.argv, out, s.expect, s.exit_code, existing_ok=False)


@case
def c_output_empty_string(ctx, work):
    """-o "" (an unset shell variable): refused, never the current folder."""
    return _merge_to(ctx, work, "", ("empty",), force=True)


@case
def c_output_empty_string_via_run(ctx, work):
    s = run(work, ctx, None, ("empty",), OUTPUT, extra=("-o", "", "--force"))
    return Setup(s.argv, work / "out", s.expect, s.exit_code, existing_ok=False)


@case
def c_output_dot(ctx, work):
    return _merge_to(ctx, work, ".", ("current folder",), force=True)


@case
def c_output_cwd_absolute(ctx, work):
    return _merge_to(ctx, work, os.getcwd(), ("current folder",), force=True)


@case
def c_output_parent_of_cwd(ctx, work):
    return _merge_to(ctx, work, "..", ("contains the current folder",), force=True)


@case
def c_output_root(ctx, work):
    return _merge_to(ctx, work, "/", ("root folder",), force=True)


@case
def c_output_home(ctx, work):
    return _merge_to(ctx, work, str(Path.home()), ("home folder",), force=True)


@case
def c_output_parent_of_an_input(ctx, work):
    """--force does not let the output replace a folder holding an input model."""
    from mergepipe.cli import main
    from mergepipe.plan.planner import plan_hash
    models = work / "models"
    models.mkdir()
    expert = copy_expert(ctx, models, k=1, name="e1")
    params = write_params(work, ctx, expert)
    plan_path = work / "plan.json"
    assert main(["plan", str(params), "-q", "-o", str(plan_path)]) == 0
    plan = json.loads(plan_path.read_text())
    assert plan["plan_hash"] == plan_hash(plan)
    return Setup(["merge", str(plan_path), "-o", str(models), "--force", "--cache-dir", str(ctx.cache), "-q"],
                 models, (str(models), "input model"), OUTPUT, existing_ok=False)


@case
def c_output_dangling_symlink(ctx, work):
    link = work / "out"
    link.symlink_to(work / "nowhere")
    return _merge_to(ctx, work, link, (str(link), "dangling symbolic link"))


@case
def c_output_symlink_to_a_users_folder(ctx, work):
    mine = work / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    link = work / "out"
    link.symlink_to(mine)
    return _merge_to(ctx, work, link, (str(link), "symbolic link"), force=True)


@case
def c_byte_budget_below_one_block(ctx, work):
    """`budget: 10` (meant 10%) is 10 bytes: a merge that reads nothing would publish the base as merged
    (the default strategy here, sketch, reads 196-byte sketches at least)."""
    return run(work, ctx, None, ("budget", "10B", "smaller than any expert sketch"), BUDGET, budget=10)


# ------------------------------------------------------------- third red-team pass (issue 15): other inputs, the cache

@case
def c_run_force_into_the_folder_of_its_params(ctx, work):
    """`mergepipe run proj/params.yaml -o proj --force`: --force must not let the publish delete
    the config being run (and the user's files beside it)."""
    proj = work / "proj"
    proj.mkdir()
    (proj / "notes.md").write_text("why these weights\n")
    params = write_params(proj, ctx, output={"dir": str(proj)})
    return Setup(["run", str(params), "-q", "--force"], proj, (str(proj), "params.yaml", "input of this command"),
                 OUTPUT, existing_ok=False)


@case
def c_merge_force_into_the_folder_of_its_plan(ctx, work):
    """`mergepipe merge job/plan.json -o job --force`: the plan file is an input of the command."""
    s = edited_plan(ctx, work, lambda p: None, ())
    job = work / "job"
    job.mkdir()
    plan = job / "plan.json"
    Path(s.argv[1]).rename(plan)
    argv = ["merge", str(plan), "-o", str(job), "--force", "--cache-dir", str(ctx.cache), "-q"]
    return Setup(argv, job, (str(job), "plan.json", "input of this command"), OUTPUT, existing_ok=False)


def _own_cache(ctx: Ctx, work: Path) -> tuple[Path, Path]:
    """A plan made with a cache folder inside `work` (indexed now, so the case itself adds nothing there)."""
    from mergepipe.cli import main
    cache = work / "cache"
    params = write_params(work, ctx, cache_dir=str(cache))
    plan = work / "plan.json"
    assert main(["plan", str(params), "-q", "-o", str(plan)]) == 0
    return cache, plan


@case
def c_merge_force_onto_the_cache(ctx, work):
    """`merge plan.json -o .mergepipe --force` (the cache it reads): would replace every index and stored merge."""
    cache, plan = _own_cache(ctx, work)
    return Setup(["merge", str(plan), "-o", str(cache), "--force", "--cache-dir", str(cache), "-q"], cache,
                 (str(cache), "cache folder"), OUTPUT, existing_ok=False)


@case
def c_merge_output_inside_the_cache(ctx, work):
    """An output under the cache folder (.mergepipe/merges/mine) is the store's to prune: `gc` would delete it."""
    cache, plan = _own_cache(ctx, work)
    out = cache / "merges" / "mine"
    return Setup(["merge", str(plan), "-o", str(out), "--cache-dir", str(cache), "-q"], out,
                 (str(out), "cache folder"), OUTPUT)


@case
def c_sweep_into_a_users_folder(ctx, work):
    """`sweep -o report` where report/ is the user's: its files must not be mixed with or replaced by a sweep's."""
    report = work / "report"
    report.mkdir()
    (report / "sweep.md").write_text("# my own notes on sweeping\n")
    params = write_params(work, ctx)
    return Setup(["sweep", str(params), "--budgets", "50%", "--no-plot", "-o", str(report), "-q"], report,
                 (str(report), "sweep.md", "--force"), OUTPUT, existing_ok=False)


@case
def c_sweep_with_a_users_model_under_models(ctx, work):
    """A sweep folder whose models/ holds a model the user put there: refused, even a previous sweep's folder."""
    from mergepipe.cli import main
    params = write_params(work, ctx)
    sweep = work / "sweep"
    assert main(["sweep", str(params), "--budgets", "50%", "--no-plot", "-o", str(sweep), "-q"]) == 0
    shutil.copytree(ctx.experts[0], sweep / "models" / "my-finetune")
    return Setup(["sweep", str(params), "--budgets", "50%", "--no-plot", "-o", str(sweep), "-q"], sweep,
                 (str(sweep), "models/my-finetune", "--force"), OUTPUT, existing_ok=False)


@case
def c_merge_part_into_an_input_model(ctx, work):
    """`merge plan.json --part 1/2 -o models/expert` (a slip for parts/): a second .safetensors file in
    the expert's folder, with no index json, would make it unreadable as a checkpoint."""
    from mergepipe.cli import main
    expert = copy_expert(ctx, work, k=1, name="e1")
    params = write_params(work, ctx, expert)
    plan = work / "plan.json"
    assert main(["plan", str(params), "-q", "-o", str(plan)]) == 0
    return Setup(["merge", str(plan), "--part", "1/2", "-o", str(expert), "--cache-dir", str(ctx.cache), "-q"],
                 expert, (str(expert), "input"), OUTPUT, existing_ok=False)


# ------------------------------------------------------------- red-team of the newer features (issue 15):
# tokenizer_source, stacking, calibration and joint-statistics caches, per-tensor settings

def _tokenizer_folder(ctx: Ctx, work: Path, broken: str) -> Path:
    """A tokenizer folder whose tokenizer.json is `broken`: a dangling link, a folder or a fifo;
    tokenizer_config.json is fine, so the output would have had a config without its tokenizer."""
    tok = work / "tok"
    tok.mkdir()
    shutil.copyfile(ctx.experts[2] / "config.json", tok / "config.json")
    shutil.copyfile(ctx.experts[2] / "tokenizer_config.json", tok / "tokenizer_config.json")
    bad = tok / "tokenizer.json"
    if broken == "dangling":
        bad.symlink_to(work / "blobs" / "not-downloaded")
    elif broken == "folder":
        bad.mkdir()
    else:
        os.mkfifo(bad)
    return bad


def _tokenizer_case(broken: str):
    def build(ctx, work):
        bad = _tokenizer_folder(ctx, work, broken)
        return run(work, ctx, None, ("output.tokenizer_source", str(bad)), CONFIG,
                   output={"dir": str(work / "out"), "tokenizer_source": "tok"})
    build.__doc__ = f"output.tokenizer_source whose tokenizer.json is a {broken}: was published without it, verify OK."
    return build


for _kind in ("dangling", "folder", "fifo"):
    CASES[f"tokenizer_source_{_kind}_tokenizer_json"] = Case(f"tokenizer_source_{_kind}_tokenizer_json",
                                                             _tokenizer_case(_kind), f"tokenizer.json: {_kind}")


@case
def c_tokenizer_source_missing_folder(ctx, work):
    return run(work, ctx, None, ("output.tokenizer_source", "not a folder"), CONFIG,
               output={"dir": str(work / "out"), "tokenizer_source": "tok-typo"})


def _stack_config(ctx: Ctx, work: Path, second: dict, name: str = "mk.yml") -> Path:
    """A mergekit passthrough config stacking base layers 0-2 and `second` (one source)."""
    mk = work / name
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(ctx.base), "layer_range": [0, 3]}]}, {"sources": [second]}]}))
    return mk


@case
def c_stack_layer_range_past_the_last_layer(ctx, work):
    """[2, 5] of a 4-layer model: the error names the config file and the slice."""
    mk = _stack_config(ctx, work, {"model": str(ctx.experts[1]), "layer_range": [2, 5]})
    return Setup(["import-mergekit", str(mk), "-o", str(work / "params.yaml"), "-q"], work / "params.stacked",
                 (str(mk), "slices[1]", "layer_range", "4 layers"), CONFIG, existing_ok=False)


@case
def c_stack_layer_range_of_booleans(ctx, work):
    """layer_range: [true, 4] (a half-edited YAML): was read as [1, 4]."""
    mk = _stack_config(ctx, work, {"model": str(ctx.experts[1]), "layer_range": [True, 4]})
    return Setup(["import-mergekit", str(mk), "-o", str(work / "params.yaml"), "-q"], work / "params.stacked",
                 (str(mk), "slices[1].sources[0].layer_range"), CONFIG, existing_ok=False)


@case
def c_stack_of_its_own_stacked_folder(ctx, work):
    """A slice of params.stacked, the folder the import replaces: the next import would read
    this one's output (a different model at every import)."""
    from mergepipe.cli import main
    first = _stack_config(ctx, work, {"model": str(ctx.experts[1]), "layer_range": [2, 4]}, "first.yml")
    assert main(["import-mergekit", str(first), "-o", str(work / "params.yaml"), "-q"]) == 0
    mk = _stack_config(ctx, work, {"model": str(work / "params.stacked"), "layer_range": [1, 5]})
    return Setup(["import-mergekit", str(mk), "-o", str(work / "params.yaml"), "-q", "--force"],
                 work / "params.stacked", (str(mk), "slices[1].sources[0].model", "stacked folder"), CONFIG,
                 existing_ok=False)


@case
def c_stack_folder_is_a_symlink_to_a_users_folder(ctx, work):
    """params.stacked is a link to the user's folder; --force (meant for params.yaml) used to
    reach shutil.rmtree on the link: a traceback, and through a link a deleted folder."""
    mine = work / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work\n")
    (work / "params.stacked").symlink_to(mine)
    mk = _stack_config(ctx, work, {"model": str(ctx.experts[1]), "layer_range": [2, 4]})
    return Setup(["import-mergekit", str(mk), "-o", str(work / "params.yaml"), "-q", "--force"],
                 work / "params.stacked", (str(work / "params.stacked"), "symbolic link"), OUTPUT, existing_ok=False)


_PER_TENSOR = {"lambda": [{"filter": "mlp", "value": [0.0, 1.0]}, {"value": 0.5}]}


def _typo(tensors: dict) -> None:
    tensors[VICTIM[:-1] + "tt"] = tensors.pop(VICTIM)  # ...weight -> ...weigtt: that tensor falls to the top level


_TENSOR_PARAMETER_EDITS = {
    "tensor_name_typo": (lambda tp: _typo(tp["tensors"]), (VICTIM[:-1] + "tt", "no such tensor")),
    "group_index_out_of_range": (lambda tp: tp["tensors"].update({VICTIM: len(tp["groups"])}),
                                 (f"tensor_parameters.tensors.{VICTIM}", "group index")),
    "group_index_a_string": (lambda tp: tp["tensors"].update({VICTIM: "0"}), (f"tensor_parameters.tensors.{VICTIM}",)),
    "group_parameter_a_string": (lambda tp: tp["groups"][0]["parameters"].update({"lambda": "half"}),
                                 ("tensor_parameters.groups.0.parameters",)),
    "group_expert_unknown": (lambda tp: tp["groups"][0]["experts"].update({"gone": {"weight": 1.0}}),
                             ("tensor_parameters.groups.0.experts.gone",)),
    "groups_emptied": (lambda tp: tp.update(groups=[]), ("tensor_parameters.tensors.",)),
}


def _tensor_parameters_case(edit, expect):
    def build(ctx, work):
        from mergepipe.cli import main
        from mergepipe.plan.planner import plan_hash
        params = write_params(work, ctx, ctx.experts[1], budget="30%", parameters=_PER_TENSOR)
        plan_path = work / "plan.json"
        assert main(["plan", str(params), "-q", "-o", str(plan_path)]) == 0
        plan = json.loads(plan_path.read_text())
        edit(plan["tensor_parameters"])
        plan["plan_hash"] = plan_hash(plan)
        plan_path.write_text(json.dumps(plan))
        return Setup(["merge", str(plan_path), "-o", str(work / "out"), "--cache-dir", str(ctx.cache), "-q"],
                     work / "out", (str(plan_path), *expect), CONFIG)
    build.__doc__ = "A plan's per-tensor parameters hand-edited (plan_hash recomputed)."
    return build


for _name, (_edit, _expect) in _TENSOR_PARAMETER_EDITS.items():
    CASES[f"plan_tensor_parameters_{_name}"] = Case(f"plan_tensor_parameters_{_name}",
                                                    _tensor_parameters_case(_edit, _expect))


def _base_aux_case(broken: str):
    def build(ctx, work):
        base = work / "base"
        shutil.copytree(ctx.base, base)
        bad = base / "tokenizer.json"
        bad.unlink()
        if broken == "dangling":
            bad.symlink_to("../../blobs/not-downloaded")
        else:
            bad.mkdir()
        return run(work, ctx, None, (str(bad), "not a regular file"), CHECKPOINT, base=str(base))
    build.__doc__ = f"The base's tokenizer.json is a {broken}: the merge was published without a tokenizer, verify OK."
    return build


for _kind in ("dangling", "folder"):
    CASES[f"base_tokenizer_json_{_kind}"] = Case(f"base_tokenizer_json_{_kind}", _base_aux_case(_kind))


@case
def c_run_force_into_the_folder_of_its_calibration_text(ctx, work):
    """`output.dir: data` with `plan.text: data/calib.txt` and --force: publishing replaced data/,
    deleting the calibration text the plan was made from (an input, like params.yaml)."""
    data = work / "data"
    data.mkdir()
    (data / "calib.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    s = run(work, ctx, None, (str(data), "calib.txt", "input of this command"), OUTPUT, extra=("--force",),
            output={"dir": str(data)},
            plan={"strategy": "calibrated", "text": "data/calib.txt", "max_tokens": 64, "seq_len": 32})
    return Setup(s.argv, data, s.expect, s.exit_code, existing_ok=False)


# ------------------------------------------------------------- red-team pass 4 (issue 15): ordinary mistakes

def _variable_case(key: str):
    def build(ctx, work):
        written = "$SCRATCH/mp" if key != "base" else "${SCRATCH}/models/base"
        where = {"output.dir": {"output": {"dir": written}}, "cache_dir": {"cache_dir": written},
                 "base": {"base": written}}[key]
        s = run(work, ctx, None, ("params.yaml", key, written, "not expanded"), CONFIG, **where)
        return Setup(s.argv, work / written.split("/")[0], s.expect, s.exit_code, existing_ok=False)
    build.__doc__ = (f"{key}: '$SCRATCH/...' (a shell variable in params.yaml, as on a cluster): a folder "
                     "literally named '$SCRATCH' was made in the params folder and the merge or cache went there.")
    return build


for _key in ("output.dir", "cache_dir", "base"):
    CASES[f"params_shell_variable_in_{_key.replace('.', '_')}"] = Case(
        f"params_shell_variable_in_{_key.replace('.', '_')}", _variable_case(_key))


@case
def c_model_folder_with_shards_and_a_stray_model_safetensors(ctx, work):
    """A sharded expert whose folder also holds a model.safetensors that its index json does not
    name (a re-save or re-download over the old folder): mergepipe merged the shards, while
    transformers (and so the user) loads model.safetensors first: another model than intended."""
    bad = copy_expert(ctx, work, k=0)
    shutil.copyfile(ctx.experts[1] / "model.safetensors", bad / "model.safetensors")
    return run(work, ctx, bad, (str(bad / "model.safetensors"), INDEX_JSON), CHECKPOINT)


def _filter_typo_case(where: str):
    def build(ctx, work):
        typo = [{"filter": "self_atn", "value": 0.2}, {"value": 1.0}]  # self_attn misspelled
        if where == "parameters.lambda":
            return run(work, ctx, None, ("params.yaml", where, "self_atn"), CONFIG, parameters={"lambda": typo})
        experts = [{"name": "good", "path": str(ctx.experts[2]), "weight": typo}]
        return run(work, ctx, None, ("params.yaml", "experts[0].weight", "self_atn"), CONFIG, experts=experts)
    build.__doc__ = (f"{where}: a per-tensor condition whose filter is misspelled matched no tensor, so it "
                     "silently applied nowhere and the merge used the fallback value everywhere.")
    return build


for _where in ("parameters.lambda", "experts.weight"):
    CASES[f"setting_filter_matches_no_tensor_{_where.replace('.', '_')}"] = Case(
        f"setting_filter_matches_no_tensor_{_where.replace('.', '_')}", _filter_typo_case(_where))


@case
def c_params_same_expert_folder_twice(ctx, work):
    """A half-edited params.yaml: an expert entry copied and renamed, its path left as the first's
    (`{name: e1, path: models/e0}`): e0 was merged twice and e1 not at all, exit 0, verify OK.
    Now an error naming both entries."""
    experts = [{"name": "good", "path": str(ctx.experts[2]), "weight": 0.5},
               {"name": "copy", "path": str(ctx.experts[2]) + "/", "weight": 0.7}]
    return run(work, ctx, None, ("params.yaml", "experts[1].path", "experts[0]"), CONFIG, experts=experts)
