"""Path resolution: params.yaml paths made absolute against its folder (as written kept
for `normalized()`), and the output folder refused where it overlaps an input or the cache
(output/safety.overlaps, asked at load so that a config error names its key).
`check_models_exist` is for the plan step (loading a config checks no path's existence)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.checkpoint.lora import is_adapter
from mergepipe.config.hf_cache import hub_repo, hub_snapshot, looks_like_hub_id
from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.units import short_repr
# the one owner of output safety (layer exception: test_layers)
from mergepipe.output.safety import overlaps, writes_into

if TYPE_CHECKING:
    from mergepipe.config.models import MergeConfig


def _absolute(root: Path, path: Path) -> Path:
    return Path(os.path.normpath(root / path.expanduser()))


_VARIABLE = re.compile(r"\$(\{?[A-Za-z_])")


def _refuse_variables(written: dict[str, str], source: str) -> None:
    """`output.dir: $SCRATCH/merged` made a folder literally named `$SCRATCH` in the params
    folder: params.yaml paths are taken as written (only ~ is expanded), so say so."""
    for key, path in written.items():
        if _VARIABLE.search(path):
            raise ConfigError(f"{source}: {key}: {path!r} holds a shell variable; params.yaml paths are not "
                              "expanded (only ~ is): write the path itself")


def _key(i: int, expert) -> str:
    return f"experts[{i}].adapter" if expert.adapter is not None else f"experts[{i}].path"


def adapter_folder(root: Path, adapter: Path) -> tuple[str, Path]:
    """(as normalized() writes it, absolute folder) of an `adapter:` path: a folder relative to
    params.yaml, else a Hugging Face id whose repository is in the local cache, written as its
    snapshot folder (so that plans name the folder they read). The Snakemake rules resolve
    `adapter:` with it too (rules/common.smk)."""
    local = _absolute(root, adapter)
    ref = adapter.as_posix()
    if local.exists() or not looks_like_hub_id(ref) or not hub_repo(ref).is_dir():
        return ref, local
    snapshot = hub_snapshot(ref)
    return snapshot.as_posix(), snapshot


def resolve_paths(cfg: MergeConfig, root: Path, source: str) -> MergeConfig:
    written = {"base": cfg.base.as_posix(), "output.dir": cfg.output.dir.as_posix(),
               "cache_dir": cfg.cache_dir.as_posix()}
    experts = []
    for i, expert in enumerate(cfg.experts):
        if expert.adapter is not None:
            written[f"experts[{i}].adapter"], folder = adapter_folder(root, expert.adapter)
            experts.append(expert.model_copy(update={"path": folder, "adapter": folder}))
            continue
        written[f"experts[{i}].path"] = expert.path.as_posix()
        experts.append(expert.model_copy(update={"path": _absolute(root, expert.path)}))
    output = {"dir": _absolute(root, cfg.output.dir)}
    if cfg.output.tokenizer_dir is not None:
        written["output.tokenizer_source"] = cfg.output.tokenizer_dir.as_posix()
        output["tokenizer_source"] = _absolute(root, cfg.output.tokenizer_dir)
    _refuse_variables(written, source)
    resolved = cfg.model_copy(update={
        "base": _absolute(root, cfg.base),
        "experts": experts,
        "output": cfg.output.model_copy(update=output),
        "cache_dir": _absolute(root, cfg.cache_dir),
    })
    resolved._written = written
    resolved._source = source
    resolved._root = root
    resolved._method_params = cfg._method_params

    first: dict[str, int] = {}
    for i, e in enumerate(resolved.experts):  # a copied entry whose path was not edited
        j = first.setdefault(os.path.realpath(e.path), i)
        if j != i:
            raise ConfigError(f"{source}: {_key(i, e)}: {written[_key(i, e)]!r} is the same model "
                              f"as experts[{j}]; list each model once (with the weight it should have)")
    inputs = [("base", resolved.base)] + [(_key(i, e), e.path) for i, e in enumerate(resolved.experts)]
    out = resolved.output.dir
    for key, path in inputs:
        if overlaps(out, path):
            raise ConfigError(
                f"{source}: output.dir: {written['output.dir']!r} overlaps the input model "
                f"{key} ({written[key]!r}); write the merge to a separate folder")
    for key, path in inputs:  # a cache's entries written into a model would change that model's folder
        if writes_into(resolved.cache_dir, path):
            raise ConfigError(
                f"{source}: cache_dir: {written['cache_dir']!r} is or lies in the input model {key} "
                f"({written[key]!r}); keep the cache outside the models")
    if overlaps(resolved.cache_dir, out):
        raise ConfigError(
            f"{source}: cache_dir: {written['cache_dir']!r} overlaps output.dir "
            f"({written['output.dir']!r}); publishing the output would replace the cache")
    return resolved


def check_models_exist(cfg: MergeConfig) -> None:
    """Refuse a base or expert path that is neither a folder nor a file, before any model is
    read, naming the key, the expert and the folder (the reader names only the folder).

    Raises:
        CheckpointError: the first such path.
    """
    models = [("base", "the base", cfg.base)] + [
        (_key(i, e), f"expert {short_repr(e.name)}", e.path) for i, e in enumerate(cfg.experts)]
    for key, what, path in models:
        if not path.exists():
            written = cfg._written.get(key, path.as_posix())
            raise CheckpointError(f"{cfg.source}: {key} ({what}): {short_repr(written)} is no model folder or "
                                  f"file ({path} does not exist)")


def check_expert_kinds(cfg: MergeConfig) -> None:
    """Refuse an expert folder that is not what its key says: a PEFT LoRA adapter folder under
    `path:` or, under `adapter:`, an existing folder that is not one (checkpoint/lora.is_adapter).

    Raises:
        ConfigError: the first such expert, naming the key.
    """
    for i, e in enumerate(cfg.experts):
        written = cfg._written.get(_key(i, e), e.path.as_posix())
        if e.adapter is None and is_adapter(e.path):
            raise ConfigError(f"{cfg.source}: experts[{i}].path: {short_repr(written)} is a PEFT LoRA "
                              "adapter folder; list it as adapter: (the expert is then the base with it merged "
                              "in)")
        if e.adapter is not None and e.path.exists() and not is_adapter(e.path):
            raise ConfigError(f"{cfg.source}: experts[{i}].adapter: {short_repr(written)} is not a PEFT "
                              "LoRA adapter folder (adapter_config.json and adapter_model.safetensors, no model "
                              "weights); list a model folder as path:")
