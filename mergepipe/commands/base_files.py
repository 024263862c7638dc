"""The base's non-weight files the output copies (config.json, generation_config.json, the
tokenizer files, stack.json): hashed into the plan as `base.files` {name: blake3}, so the
plan hash covers every input byte the output depends on (same plan hash, same bytes).

`plan_base_files` hashes them once per plan; `check_planned_files` (before a merge, a store
restore or a verify) and `copy_base_files` (the merge's copy step, on the bytes it copies)
refuse a file changed, gone or added since planning, as commands/tokenizer_source.py does
for a tokenizer source's files.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from mergepipe.commands.tokenizer_source import TOKENIZER_FILES
from mergepipe.errors import CheckpointError, IntegrityError
from mergepipe.output.hf_config import output_config
from mergepipe.util.fs import hash_file

AUX_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES,
             "stack.json")  # stack.json: a stacked base's tensor sources (commands/stack.py)


def _copied_names(base, *, tokenizer_source: bool) -> list[str]:
    """The AUX_FILES the output takes from the base folder: regular files, not weight files
    (a shard may be named config.json in a weight_map: never a config), and no tokenizer
    file when the tokenizer comes from another folder.

    Raises:
        CheckpointError: such a name that is not a regular file (the output would lack it).
    """
    weight_files = {os.path.realpath(h.path) for h in base.files}
    names = []
    for name in AUX_FILES:
        if tokenizer_source and name in TOKENIZER_FILES:
            continue
        src = base.root / name
        if os.path.lexists(src) and not src.is_file():
            raise CheckpointError(f"{src}: not a regular file (a dangling link, a folder or a special "
                                  "file); the output would be published without it; fix the base folder")
        if src.is_file() and os.path.realpath(src) not in weight_files:
            names.append(name)
    return names


def plan_base_files(base, *, tokenizer_source: bool, dtype: str | None) -> dict[str, str]:
    """The plan's `base.files` for the opened base checkpoint: {name: blake3}, sorted.

    Raises:
        CheckpointError: a copied name that is not a regular file; a config.json the output
            dtype cannot be written into (output/hf_config.py): found when planning, not after a merge.
    """
    names = sorted(_copied_names(base, tokenizer_source=tokenizer_source))
    if "config.json" in names:
        output_config(base.root / "config.json", dtype)
    return {name: hash_file(base.root / name) for name in names}


def _changed(src: Path) -> IntegrityError:
    return IntegrityError(f"{src}: changed since the plan was made (the plan hash covers it); re-plan")


def _check_names(plan, base) -> dict[str, str]:
    planned = plan.base.files
    names = _copied_names(base, tokenizer_source=plan.output.tokenizer_source is not None)
    missing = sorted(set(planned) - set(names))
    if missing:
        raise IntegrityError(f"{base.root / missing[0]}: planned but missing (or now a weight file); re-plan")
    added = sorted(set(names) - set(planned))
    if added:
        raise IntegrityError(f"{base.root / added[0]}: added to the base since the plan was made; re-plan")
    return planned


def check_planned_files(plan, base, tokenizer_dir: Path | None) -> None:
    """The base's copied files, and the tokenizer source's, are the bytes the plan (its
    PlanRecord, plan/record.py) records.

    Raises:
        IntegrityError: one changed, missing or (base) added since planning, named.
        CheckpointError: a copied name in the base that is not a regular file.
    """
    for name, digest in _check_names(plan, base).items():
        if hash_file(base.root / name) != digest:
            raise _changed(base.root / name)
    tokenizer = plan.output.tokenizer_source
    for name, digest in (tokenizer.files if tokenizer is not None else {}).items():
        src = tokenizer_dir / name
        if not src.is_file():
            raise IntegrityError(f"{src}: tokenizer file planned but missing; re-plan")
        if hash_file(src) != digest:
            raise IntegrityError(f"{src}: tokenizer file changed since the plan was made; re-plan")


def copy_base_files(plan, base, out: Path) -> dict[str, str]:
    """Copy the plan's `base.files` into `out` (config.json naming the output dtype,
    output/hf_config.py); {name: blake3 of the output's file}. The bytes checked are the
    bytes copied: a file edited between the check and the copy is refused too.

    Raises:
        IntegrityError: a file changed, missing or added since the plan was made.
    """
    copied = {}
    for name, digest in _check_names(plan, base).items():
        shutil.copyfile(base.root / name, out / name)
        copied[name] = hash_file(out / name)
        if copied[name] != digest:
            raise _changed(base.root / name)
        if name == "config.json":  # its dtype fields name the dtype the weights are in
            # the planned bytes, which plan_base_files found writable: this never raises
            data = output_config(out / name, plan.output.dtype)
            if data != (out / name).read_bytes():
                (out / name).write_bytes(data)
                copied[name] = hash_file(out / name)
    return copied
