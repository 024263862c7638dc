"""Hugging Face model ids resolved from the local Hugging Face cache, never the network.

The hub cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`;
a model `org/name` lives in `models--org--name/`, its revisions in `snapshots/<commit>/`
and `refs/main` names the commit of the main branch. `hub_snapshot` returns that snapshot
folder (the only one when there is no `refs/main`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from mergepipe.errors import ConfigError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_cache() -> Path:
    """The hub cache folder, from the environment as huggingface_hub reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


def looks_like_hub_id(ref: str) -> bool:
    """`org/name` with Hub-legal characters (a path like ./a/b or /a/b is not an id)."""
    return bool(_ID.match(ref)) and ".." not in ref


def hub_repo(model_id: str) -> Path:
    """The cache folder of `model_id`'s repository (whether or not it exists)."""
    return hub_cache() / ("models--" + model_id.replace("/", "--"))


def hub_snapshot(model_id: str) -> Path:
    """The cached snapshot folder of `model_id`.

    Raises:
        ConfigError: not in the cache, or several snapshots and no refs/main (naming the id).
    """
    repo = hub_repo(model_id)
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        raise ConfigError(f"Hugging Face model {model_id!r} is neither a local folder nor in the local "
                          f"Hugging Face cache ({repo}); download it first (hf download "
                          f"{model_id}) or give a local path")
    ref = repo / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        folder = snapshots / commit
        if commit not in ("", ".", "..") and "/" not in commit and folder.is_dir():  # (".." is the repo)
            return folder
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) == 1:
        return found[0]
    raise ConfigError(f"Hugging Face model {model_id!r}: {len(found)} cached snapshots in {snapshots} and no "
                      "usable refs/main; give the snapshot folder as a local path")
