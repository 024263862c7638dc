"""`output.tokenizer_source`: the output's tokenizer files come from another model folder.

At plan time the folder's tokenizer files are hashed into the plan (`output.tokenizer_source`
= {path as written, files: {name: blake3}}), so the plan hash covers them; the merge copies
them and refuses files that changed since. Unless the embeddings are rebuilt in its
vocabulary (`tokens:`, `pad_to_multiple_of`: checkpoint/vocab.py), its vocabulary must be the
base's (config.json `vocab_size`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.util.fs import hash_file

# chat_template.jinja: where transformers keeps a tokenizer's chat template (mergekit copies it too)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _vocab_size(folder: Path) -> int | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") if isinstance(config, dict) else None
    if size is None and isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        size = config["text_config"].get("vocab_size")
    return size if isinstance(size, int) else None


def plan_tokenizer(folder: Path, written: str, base_root: Path, *, same_vocabulary: bool = True) -> dict:
    """The plan's `output.tokenizer_source` for `folder` (written as `written`). `same_vocabulary`:
    its vocab_size must be the base's (False: the embeddings are rebuilt in its vocabulary,
    checkpoint/vocab.py).

    Raises:
        ConfigError: not a folder, a tokenizer name that is not a readable file (a dangling
            link, a folder: the output would silently lack it), no tokenizer file there, or a
            vocabulary size other than the base's.
    """
    if not folder.is_dir():
        raise ConfigError(f"output.tokenizer_source: {folder} is not a folder")
    for name in TOKENIZER_FILES:
        if os.path.lexists(folder / name) and not (folder / name).is_file():
            raise ConfigError(f"output.tokenizer_source: {folder / name} is not a regular file (a dangling link, "
                              "a folder or a special file); fix the tokenizer folder or give another")
    files = {name: hash_file(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}
    if not files:
        raise ConfigError(f"output.tokenizer_source: {folder} has none of the tokenizer files "
                          f"({', '.join(TOKENIZER_FILES)})")
    ours, base = _vocab_size(folder), _vocab_size(base_root)
    if same_vocabulary and ours is not None and base is not None and ours != base:
        raise ConfigError(f"output.tokenizer_source: {folder} has vocab_size {ours}, the base {base}; "
                          "mergepipe does not remap embeddings to another vocabulary")
    return {"path": written, "files": dict(sorted(files.items()))}


def copy_tokenizer(spec: dict, folder: Path, out: Path) -> dict[str, str]:
    """Copy the planned tokenizer files from `folder` into `out`; {name: blake3}.

    Raises:
        IntegrityError: a file that changed (or went missing) since the plan was made.
    """
    copied = {}
    for name, digest in spec["files"].items():
        src = folder / name
        if not src.is_file():
            raise IntegrityError(f"{src}: tokenizer file planned but missing; re-plan")
        shutil.copyfile(src, out / name)
        copied[name] = hash_file(out / name)
        if copied[name] != digest:
            raise IntegrityError(f"{src}: tokenizer file changed since the plan was made; re-plan")
    return copied
