"""The output's config.json: the base's, with its dtype fields naming the dtype the weights
were written in (`output.dtype`), so that `from_pretrained(..., dtype="auto")` loads the
merge as written. No weight I/O here; the caller copies or writes the bytes returned.
"""
from __future__ import annotations

import json
from pathlib import Path

from mergepipe.errors import CheckpointError

# transformers writes `torch_dtype` (before 4.56) or `dtype`, and reads `dtype` first
DTYPE_KEYS = ("torch_dtype", "dtype")


def _set_dtype(node: dict, dtype: str, *, top: bool) -> bool:
    """Set every dtype field of `node` and of the sub-configs in it (text_config, vision_config,
    ...) to `dtype`; at the top level add `torch_dtype` where there is none. Returns whether
    anything changed."""
    changed = False
    keys = [k for k in DTYPE_KEYS if k in node]
    if top and not keys:
        keys = ["torch_dtype"]
    for key in keys:
        if node.get(key) != dtype:
            node[key] = dtype
            changed = True
    for value in node.values():
        if isinstance(value, dict) and any(k in value for k in DTYPE_KEYS):
            changed |= _set_dtype(value, dtype, top=False)
    return changed


def output_config(src: Path, dtype: str | None) -> bytes:
    """The bytes of the output's config.json made from the base's `src`: the base's bytes
    unchanged when `dtype` is None (each tensor keeps the base's dtype) or every dtype field
    already names it; else the config with those fields set, as transformers writes it
    (indent 2, sorted keys).

    Raises:
        CheckpointError: `src` is not a JSON object while the output dtype must be written into it.
    """
    data = src.read_bytes()
    if dtype is None:
        return data
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{src}: not valid JSON ({e}); the output dtype {dtype} cannot be recorded in "
                              "it; fix the base's config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{src}: not a JSON object; the output dtype {dtype} cannot be recorded in it; "
                              "fix the base's config.json")
    if not _set_dtype(config, dtype, top=True):
        return data
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
