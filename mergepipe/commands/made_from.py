"""What a plan file was made from: the blake3 of the params file's bytes, recorded by
`plan -o` beside the plan (plan/record.py MadeFromRecord) and checked by `merge --params`
and `gather --params`, so a plan made before an edit of params.yaml is refused instead of
merged under the edited file (a build tool that judges by modification times cannot tell:
a plan written after an edit made during its job looks newer than the edit).

It reads the params file's bytes and nothing else; the plan itself records the content of
everything else the config names (models, calibration text, tokenizer files).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from blake3 import blake3

from mergepipe.config.yaml_io import MAX_YAML_BYTES
from mergepipe.errors import ConfigError

if TYPE_CHECKING:  # the workflow's parse step imports params_hash: no pydantic models, no torch
    from mergepipe.plan.record import MadeFromRecord

T = TypeVar("T")


def params_hash(path: str | os.PathLike[str]) -> str:
    """blake3 hex digest of the params file's bytes (one over MAX_YAML_BYTES is no config).

    Raises:
        ConfigError: the file cannot be read, naming it.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{os.fspath(path)}: cannot read: {e.strerror}") from None
    return blake3(data).hexdigest()


def loaded_with_record(path: str | os.PathLike[str], load: Callable[[], T], *,
                       budget: str | None = None) -> tuple[T, dict]:
    """`load()` (which reads `path`) and the made_from record of the bytes it read
    (`budget`: the command line's override of the file's budget, recorded when given).

    The file is hashed before and after the load: an edit in between would record bytes
    the config did not come from, so it is refused.
    """
    before = params_hash(path)
    loaded = load()
    if params_hash(path) != before:
        raise ConfigError(f"{os.fspath(path)}: changed while it was read; run the command again")
    return loaded, {"params": before} | ({} if budget is None else {"budget": budget})


def check_made_from(made_from: MadeFromRecord | None, params: str | os.PathLike[str], where: str) -> None:
    """Refuse a plan file that was not made from `params` as it is now.

    Raises:
        ConfigError: no record (a plan of an earlier mergepipe), a plan made with `--budget`
            (not the file's budget), or a record of other bytes (params.yaml edited after
            planning), naming both files.
    """
    again = f"make it again with `mergepipe plan {os.fspath(params)} -o {where}`"
    if made_from is None:
        raise ConfigError(f"{where}: records no params file it was made from, so --params "
                          f"{os.fspath(params)} cannot be checked; {again}")
    if made_from.budget is not None:
        raise ConfigError(f"{where}: made with --budget {made_from.budget}, not {os.fspath(params)}'s budget; "
                          f"{again}")
    if params_hash(params) != made_from.params:
        raise ConfigError(f"{where}: made from another version of {os.fspath(params)} (edited after "
                          f"planning); {again}")
