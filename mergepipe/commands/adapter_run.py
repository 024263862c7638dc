"""`run` of a params.yaml with `output.adapter`: the experts' LoRA adapters combined into one
adapter of the base, published atomically (docs/design.md, "Adapters out").

Reads the base's headers (its tensor table, to check every adapter against it) and the
adapters' files; never a weight of the base, so no index, plan or budget. The output is up to
date when its manifest's recipe_hash is this run's and its files verify.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mergepipe.checkpoint.lora import ADAPTER_WEIGHTS, AdapterCheckpoint, open_adapter
from mergepipe.checkpoint.lora_combine import Term, combine
from mergepipe.methods._lora_dense import DENSE_COMBINATIONS, DenseSpec, DenseTerm, combine_dense
from mergepipe.checkpoint.json_files import parse_json, read_bounded
from mergepipe.checkpoint.lora_config import ADAPTER_CONFIG, MAX_CONFIG_BYTES
from mergepipe.checkpoint.safetensors import Checkpoint, open_checkpoint
from mergepipe.commands.stack import stacked_sources
from mergepipe.config.adapter_output import check_adapter_output
from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.output.adapter_out import (ADAPTER_KIND, OutModule, adapter_config, adapter_manifest,
                                          recipe_hash, write_adapter, write_adapter_manifest, write_report)
from mergepipe.output.manifest import load_manifest, refuse_other_replay, verify_outputs
from mergepipe.output.publish import Publisher
from mergepipe.output.safety import WriteInputs, check_output_path, refuse_overlap
from mergepipe.util.canonical import canonical_blake3
from mergepipe.util.fs import hash_file


@dataclass(frozen=True, slots=True)
class Source:
    """One expert's adapter, opened against the base, with its merge coefficient."""

    name: str
    written: str  # the adapter path as params.yaml gives it
    checkpoint: AdapterCheckpoint
    config: dict
    coefficient: float


def base_table_hash(base: Checkpoint) -> str:
    """blake3 of the base's tensor table (names, dtypes, shapes): all of the base an adapter
    output depends on (its weights are never read)."""
    return canonical_blake3(sorted([t.name, t.dtype, list(t.shape)] for t in base.tensors.values()))


def open_sources(cfg, base: Checkpoint, table_hash: str, coefficients: dict[str, float]) -> list[Source]:
    """The adapters, in canonical order (their identity, then name): listing the experts in
    another order writes the same bytes."""
    norm = cfg.normalized()["experts"]
    out = []
    for e, e_norm in zip(cfg.experts, norm):
        ckpt = open_adapter(e.path, base, table_hash)
        path = Path(e.path) / ADAPTER_CONFIG
        config = parse_json(read_bounded(path, MAX_CONFIG_BYTES), path)
        out.append(Source(e.name, e_norm["adapter"], ckpt, config, coefficients[e.name]))
    return sorted(out, key=lambda s: (s.checkpoint.identity, s.name))


def _refuse_unsupported(s: Source, nonfinite: str) -> None:
    """Whole tensors that change the base (modules_to_save, a base_layer of other bytes) and
    LoRA biases cannot be written as LoRA factors; NaN/Inf factors unless nonfinite: allow."""
    adapter = s.checkpoint.adapter
    changed = _changed_whole_tensors(s.checkpoint)
    if changed:
        raise ConfigError(f"{s.checkpoint.root}: tensor {changed[0]!r}: a whole tensor (modules_to_save, "
                          "base_layer) that differs from the base's cannot be written as LoRA factors; merge to "
                          "a model (remove output.adapter)")
    for name, d in sorted(adapter.deltas.items()):
        if d.vector is not None:
            raise ConfigError(f"{s.checkpoint.root}: module {d.module!r}: a LoRA bias (lora_B.bias) is not "
                              "written to an adapter output; merge to a model (remove output.adapter)")
        if nonfinite == "error":
            import torch
            for part, t in zip(("A", "B"), d.peft_factors()):
                if not bool(torch.isfinite(t).all()):
                    raise ConfigError(f"{s.checkpoint.root / ADAPTER_WEIGHTS}: module {d.module!r}: "
                                      f"lora_{part} holds NaN or Inf (nonfinite: allow passes it through)")


def _changed_whole_tensors(ckpt: AdapterCheckpoint) -> list[str]:
    """The whole tensors of the adapter whose bytes are not the base's (PEFT saves an embedding
    LoRA's base_layer weight as it was: no change). Reads those base tensors only."""
    from mergepipe.checkpoint.safetensors import CheckpointReader
    if not ckpt.adapter.replaced:
        return []
    with CheckpointReader(ckpt.base, random_access=False) as reader:
        changed = []
        for name, data in sorted(ckpt.adapter.replaced.items()):
            t = ckpt.base.tensors[name]
            if bytes(reader.read_range(t, t.begin, t.end)) != bytes(data):
                changed.append(name)
        return changed


def combined_modules(sources: list[Source], spec, seed: int = 0) -> list[OutModule]:
    """Every module any adapter targets, its terms in the sources' order, combined as `spec`
    (output.adapter) says; `seed`: params.yaml's, for DARE's masks."""
    by_module: dict[str, list] = {}
    for s in sources:
        for tensor, d in s.checkpoint.adapter.deltas.items():
            by_module.setdefault(d.module, []).append((s, tensor, d))
    out = []
    for module, triples in sorted(by_module.items()):
        kinds = {d.embedding for _, _, d in triples}
        if len(kinds) > 1:
            raise ConfigError(f"module {module!r}: an embedding LoRA in {triples[0][0].name!r} and a linear one "
                              f"in {triples[-1][0].name!r}; they cannot be one adapter's module")
        if spec.combination in DENSE_COMBINATIONS:
            combined = _dense(triples, spec, seed)
        else:
            terms = [Term(*d.peft_factors(), d.scale, s.coefficient) for s, _, d in triples]
            combined = combine(terms, spec.combination, spec.rank)
        out.append(OutModule(module, combined, kinds.pop()))
    return out


def _dense(triples: list, spec, seed: int):
    """PEFT's dense combination of the module's Δs (methods/_lora_dense.py); each DARE mask
    drawn from the generator of (seed, the adapter's identity, the tensor), as a DARE merge's
    block generator (methods/base.block_rng) with the whole tensor one block."""
    from mergepipe.methods.base import block_rng
    random = spec.seeded
    terms = []
    for s, tensor, d in triples:
        rows = d.left.shape[0]
        generator = block_rng(seed, s.checkpoint.identity, tensor, 0) if random else None
        terms.append(DenseTerm(d.rows(0, rows), s.coefficient, generator))
    dense = DenseSpec(spec.combination, spec.rank, spec.density, spec.majority_sign_method or "total")
    return combine_dense(terms, dense, transposed=triples[0][2].transposed)


def _common(sources: list[Source], key: str):
    """The adapters' value of adapter_config.json `key` when they all agree, else None."""
    values = {repr(s.config.get(key)) for s in sources}
    return sources[0].config.get(key) if len(values) == 1 else None


def _fan_in_fan_out(sources: list[Source]) -> bool:
    flag = bool(sources[0].config.get("fan_in_fan_out"))
    for s in sources[1:]:
        if bool(s.config.get("fan_in_fan_out")) != flag:
            raise ConfigError(f"{s.checkpoint.root}: fan_in_fan_out {not flag}, but {flag} in "
                              f"{sources[0].checkpoint.root}; adapters of one base's layers agree on it")
    return flag


def recipe_and_inputs(cfg, sources: list[Source], table_hash: str) -> tuple[dict, dict]:
    norm = cfg.normalized()
    weights = {e.name: float(e.weight) for e in cfg.experts}
    recipe = {"method": norm["method"], "parameters": norm["parameters"],
              "adapter": norm["output"]["adapter"], "dtype": norm["output"]["dtype"],
              "nonfinite": norm["nonfinite"],
              "experts": [{"name": s.name, "weight": weights[s.name], "coefficient": s.coefficient}
                          for s in sources]}
    if cfg.output.adapter.seeded:  # DARE's masks follow the seed; no other output does
        recipe["seed"] = cfg.seed
    inputs = {"base": {"path": norm["base"], "tensor_table": table_hash},
              "experts": [{"name": s.name, "adapter": s.written,
                           "config_blake3": hash_file(s.checkpoint.root / ADAPTER_CONFIG),
                           "weights_blake3": hash_file(s.checkpoint.root / ADAPTER_WEIGHTS)}
                          for s in sources]}
    return recipe, inputs


def output_inputs(cfg, protect: tuple[Path, ...] = ()) -> WriteInputs:
    """What an adapter output folder may not overlap (output/safety.py): the base, the adapters,
    a stacked base's source models, the cache, and `protect` (params.yaml)."""
    models = (cfg.base, *(e.path for e in cfg.experts))
    return WriteInputs(models=models, sources=stacked_sources(models), cache=cfg.cache_dir,
                       command=tuple(protect))


def _published(out_dir: Path, wanted: str) -> dict | None:
    try:
        man = load_manifest(out_dir)
        if man.get("kind") != ADAPTER_KIND or man.get("recipe_hash") != wanted:
            return None
        return verify_outputs(out_dir)
    except (IntegrityError, OSError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class AdapterRun:
    manifest: dict
    report: dict | None  # adapter_report.json's content; None: the output was up to date


def run_adapter_output(cfg, *, out_dir: Path | None = None, force: bool = False,
                       protect: tuple[Path, ...] = ()) -> AdapterRun:
    """Combine, publish and verify. `protect`: the command's other inputs (params.yaml), which
    the output folder may not hold.

    Raises:
        ConfigError: the config cannot make an adapter (config/adapter_output.py), an adapter
        that does not fit the base or holds what an adapter output cannot write.
        OutputError: the output folder may not be written (output/safety.py).
    """
    coefficients = check_adapter_output(cfg)
    out_dir = check_output_path(out_dir if out_dir is not None else cfg.output.dir)
    refuse_overlap(out_dir, output_inputs(cfg, protect))
    base = open_checkpoint(cfg.base)
    table_hash = base_table_hash(base)
    sources = open_sources(cfg, base, table_hash, coefficients)
    recipe, inputs = recipe_and_inputs(cfg, sources, table_hash)
    done = _published(out_dir, recipe_hash(recipe, inputs))
    if done is not None:
        return AdapterRun(done, None)
    for s in sources:
        _refuse_unsupported(s, cfg.nonfinite)
    spec = cfg.output.adapter
    modules = combined_modules(sources, spec, cfg.seed)
    config = adapter_config(modules, fan_in_fan_out=_fan_in_fan_out(sources),
                            base_model=_common(sources, "base_model_name_or_path"),
                            task_type=_common(sources, "task_type"))
    report = {"combination": spec.combination, "rank": spec.rank, "experts": [s.name for s in sources],
              "modules": {m.name: {"rank": m.combined.rank, "relative_error": m.combined.relative_error}
                          for m in modules}}
    publisher = Publisher(out_dir, force=force)
    with publisher as tmp:
        files, tensors = write_adapter(tmp, modules, config, dtype=cfg.output.dtype)
        files.update(write_report(tmp, report))
        # last: a folder with a manifest is a finished output
        write_adapter_manifest(tmp, adapter_manifest(recipe, inputs, files, tensors))
        publisher.commit()
    return AdapterRun(verify_outputs(out_dir), report)


def check_recorded_inputs(out_dir: Path, man: dict, root: Path, *, replay: bool) -> list[str]:
    """`verify --inputs/--replay` of an adapter output: each recorded input rehashed (the
    adapters' two files by blake3, the base's tensor table), and with `replay` the adapter
    combined again from them into a temporary folder and its outputs compared.

    Raises:
        IntegrityError: an input that is not the recorded bytes, or a replay that differs.
    """
    import tempfile
    where = out_dir / "manifest.json"
    try:
        recorded = man["inputs"]
        base_dir = _resolve(recorded["base"]["path"], root)
        adapters = {e["name"]: e for e in recorded["experts"]}
    except (KeyError, TypeError):
        raise IntegrityError(f"{where}: inputs malformed; not a mergepipe adapter manifest") from None
    if base_table_hash(open_checkpoint(base_dir)) != recorded["base"]["tensor_table"]:
        raise IntegrityError(f"{base_dir}: the base's tensor names, dtypes or shapes are not the recorded "
                             "ones")
    for e in adapters.values():
        folder = _resolve(e["adapter"], root)
        for file, key in ((ADAPTER_CONFIG, "config_blake3"), (ADAPTER_WEIGHTS, "weights_blake3")):
            if not (folder / file).is_file() or hash_file(folder / file) != e[key]:
                raise IntegrityError(f"{folder / file}: not the recorded adapter file (missing or edited "
                                     "since)")
    checked = [f"1 base tensor table, {len(adapters)} adapters"]
    if replay:
        from mergepipe.config.params import config_from_dict
        recipe = man["recipe"]
        with tempfile.TemporaryDirectory(prefix="mergepipe-verify-") as tmp:
            cfg = config_from_dict({
                "base": str(base_dir), "method": recipe["method"], "parameters": recipe["parameters"],
                "nonfinite": recipe["nonfinite"], "seed": recipe.get("seed", 0),
                "experts": [{"name": e["name"], "weight": e["weight"],
                             "adapter": str(_resolve(adapters[e["name"]]["adapter"], root))}
                            for e in recipe["experts"]],
                "output": {"dir": str(Path(tmp) / "replay"), "dtype": recipe["dtype"],
                           "adapter": recipe["adapter"]},
                "cache_dir": str(Path(tmp) / "cache")}, source=f"{where}: recipe")
            again = run_adapter_output(cfg).manifest
        refuse_other_replay(out_dir, man, again)
        checked.append("replay identical")
    return checked


def _resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p
