"""Convert a mergekit YAML config into a mergepipe params dict, and write one.

Owns the mapping from mergekit's config language to params.yaml. Only what
mergepipe can reproduce exactly is converted; everything else (slices,
modules, per-layer gradients, tensor filters, LoRA or revision references,
tokenizer merging, unsupported methods) is a ConfigError that names the
mergekit key, never a silent approximation. Reads the mergekit file and
writes params files; opens no model.

Semantics carried over from mergekit:
- A model's own parameter wins over the global one (`parameters.weight`
  applies to every model that has none).
- Task-arithmetic-style methods ignore a model entry that is the base model.
- `linear` averages all models, the base included if listed (its weight
  becomes `parameters.base_weight`); without `base_model`, the first model
  plays the base.
- `slerp` interpolates from the base (t = 0) to its one other model (t = 1).
- The output dtype is `out_dtype`, else `dtype` (mergekit writes its compute
  dtype when `out_dtype` is unset); mergepipe always computes in fp32.
- Other global parameters (lambda, normalize, density, gamma, t, rescale,
  int8_mask, ...) pass through to `parameters`, where the method's params
  model accepts or rejects them.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from mergepipe.config.params import DEFAULT_OUTPUT_DIR, config_from_dict, read_yaml
from mergepipe.errors import ConfigError
from mergepipe.util.fs import atomic_write_bytes

METHOD_NAMES = {
    "linear": "linear",
    "task_arithmetic": "task_arithmetic",
    "ties": "ties",
    "dare_linear": "dare_linear",
    "dare_ties": "dare_ties",
    "breadcrumbs": "breadcrumbs",
    "breadcrumbs_ties": "breadcrumbs_ties",
    "model_breadcrumbs": "breadcrumbs",  # older mergekit names
    "model_breadcrumbs_ties": "breadcrumbs_ties",
    "slerp": "slerp",
}
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
_TOP_KEYS = {"models", "base_model", "merge_method", "parameters", "dtype", "out_dtype",
             "tokenizer_source", "tokenizer"}
_NOT_EXPRESSIBLE = {
    "slices": "layer slices (frankenmerges) cannot be expressed; mergepipe merges whole "
              "models: use `models:`",
    "modules": "per-module merges cannot be expressed; use one `models:` list",
    "chat_template": "chat templates are not merged; mergepipe copies the base's tokenizer "
                     "files: remove it",
}
_MODEL_PARAM_KEYS = ("weight", "density", "gamma")
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def _fail(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {message}")


def _scalar(value: Any, key: str, source: str) -> Any:
    """A mergekit parameter setting that is one value for every tensor.

    Accepts a scalar, a one-element list, and a condition without a filter
    (or filter "*") as the first of a list, which mergekit applies to every
    tensor. Gradients and filtered conditions vary by layer or tensor.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"filter", "value"}
        if unknown:
            raise _fail(source, key, f"unexpected keys {sorted(unknown)} in a conditional "
                                     "parameter; expected {filter, value}")
        if value.get("filter") not in (None, "*"):
            raise _fail(source, key, f"per-tensor filter {value['filter']!r} cannot be "
                                     "expressed; mergepipe uses one value for every tensor")
        return _scalar(value.get("value"), key, source)
    if isinstance(value, list):
        if not value:
            raise _fail(source, key, "empty list; give one value")
        if all(isinstance(v, dict) for v in value):
            return _scalar(value[0], key, source)
        if len(value) == 1:
            return _scalar(value[0], key, source)
        raise _fail(source, key, f"gradient {value!r} (values interpolated across layers) "
                                 "cannot be expressed; give one value")
    raise _fail(source, key, f"unsupported value {value!r}")


def _model_ref(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, key, f"must be a model path string, got {value!r}")
    if "+" in value:
        raise _fail(source, key, f"LoRA reference {value!r} ('model+lora') cannot be expressed; "
                                 "merge the adapter into its model first")
    if "@" in value:
        raise _fail(source, key, f"revision reference {value!r} ('model@revision') cannot be "
                                 "expressed; download that revision to a local folder")
    return value


def _same_model(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)


def _expert_name(path: str, taken: set[str]) -> str:
    stem = PurePosixPath(path.replace("\\", "/").rstrip("/")).name or "expert"
    name = _UNSAFE_NAME_CHARS.sub("-", stem).lstrip("._-")[:120] or "expert"
    candidate, n = name, 1
    while candidate.lower() in taken:
        n += 1
        candidate = f"{name}-{n}"
    taken.add(candidate.lower())
    return candidate


def _dtype(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str):
        raise _fail(source, key, f"must be a dtype name, got {value!r}")
    name = value.removeprefix("torch.")
    if name not in _DTYPES:
        raise _fail(source, key, f"dtype {value!r} is not supported; use bfloat16, float16 "
                                 "or float32")
    return _DTYPES[name]


def _check_tokenizer(data: dict[str, Any], source: str) -> None:
    token_source = data.get("tokenizer_source")
    if token_source not in (None, "base"):
        raise _fail(source, "tokenizer_source", f"{token_source!r} cannot be expressed; "
                                                "mergepipe keeps the base's tokenizer: remove "
                                                "it or use 'base'")
    tokenizer = data.get("tokenizer")
    if tokenizer is None:
        return
    if not isinstance(tokenizer, dict):
        raise _fail(source, "tokenizer", f"must be a mapping, got {tokenizer!r}")
    for key, value in tokenizer.items():
        if key == "source" and value in (None, "base"):
            continue
        if key in ("tokens", "pad_to_multiple_of") and not value:
            continue
        raise _fail(source, f"tokenizer.{key}", "tokenizer changes cannot be expressed; "
                                                "mergepipe keeps the base's tokenizer")


def mergekit_to_params(data: Any, *, source: str = "<mergekit>",
                       output_dir: str = DEFAULT_OUTPUT_DIR) -> dict[str, Any]:
    """Map a parsed mergekit config to a params dict (not yet validated).

    Raises:
        ConfigError: for anything mergepipe cannot reproduce, naming the key.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mergekit config mapping, "
                          f"got {type(data).__name__}")
    for key in data:
        if key in _NOT_EXPRESSIBLE:
            if data[key] in (None, [], {}, ""):
                continue
            raise _fail(source, key, _NOT_EXPRESSIBLE[key])
        if key not in _TOP_KEYS:
            raise _fail(source, key, f"unknown mergekit key; supported: {', '.join(sorted(_TOP_KEYS))}")
    _check_tokenizer(data, source)

    mk_method = data.get("merge_method")
    if mk_method not in METHOD_NAMES:
        raise _fail(source, "merge_method", f"{mk_method!r} has no mergepipe equivalent; "
                                            f"supported: {', '.join(sorted(METHOD_NAMES))}")
    method = METHOD_NAMES[mk_method]

    global_params = data.get("parameters") or {}
    if not isinstance(global_params, dict):
        raise _fail(source, "parameters", f"must be a mapping, got {global_params!r}")
    settings = {k: _scalar(v, f"parameters.{k}", source) for k, v in global_params.items()}
    default_weight = settings.pop("weight", None)

    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise _fail(source, "models", "must be a non-empty list of {model, parameters}")
    entries = []
    for i, entry in enumerate(models):
        key = f"models[{i}]"
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict):
            raise _fail(source, key, f"must be a mapping with model and parameters, got {entry!r}")
        unknown = set(entry) - {"model", "parameters"}
        if unknown:
            raise _fail(source, f"{key}.{sorted(unknown)[0]}", "unknown key; expected model, "
                                                               "parameters")
        path = _model_ref(entry.get("model"), f"{key}.model", source)
        own = entry.get("parameters") or {}
        if not isinstance(own, dict):
            raise _fail(source, f"{key}.parameters", f"must be a mapping, got {own!r}")
        params = {}
        for name, value in own.items():
            if name not in _MODEL_PARAM_KEYS:
                raise _fail(source, f"{key}.parameters.{name}",
                            f"per-model {name!r} cannot be expressed; per-model keys: "
                            f"{', '.join(_MODEL_PARAM_KEYS)}")
            params[name] = _scalar(value, f"{key}.parameters.{name}", source)
        entries.append((key, path, params))

    base = data.get("base_model")
    if base is not None:
        base = _model_ref(base, "base_model", source)
    out: dict[str, Any] = {}
    parameters: dict[str, Any] = {}

    if method == "linear":
        if base is None:
            key, base, first = entries.pop(0)
            if not entries:
                raise _fail(source, "models", "linear needs at least two models")
            parameters["base_weight"] = _weight(first, default_weight, key, source)
        else:
            listed = [e for e in entries if _same_model(e[1], base)]
            entries = [e for e in entries if not _same_model(e[1], base)]
            if listed:
                key, _, base_params = listed[0]
                parameters["base_weight"] = _weight(base_params, default_weight, key, source)
            elif default_weight is not None:
                # mergekit adds the unlisted base as a source; only the global weight applies
                parameters["base_weight"] = default_weight
            else:
                raise _fail(source, "base_model", "mergekit's linear merge also averages the "
                                                  "base model; list it in models with a weight")
    else:
        if base is None:
            raise _fail(source, "base_model", f"required: {mk_method} merges deltas from a "
                                              "base model")
        entries = [e for e in entries if not _same_model(e[1], base)]
        if method == "slerp" and settings.get("t") is None:
            raise _fail(source, "parameters.t", "required by slerp (0 gives the base, 1 the "
                                                "other model)")
        if method == "slerp" and len(entries) != 1:
            raise _fail(source, "models", "slerp takes the base model and exactly one other "
                                          f"model, got {len(entries)} others")
        if not entries:
            raise _fail(source, "models", "lists only the base model; nothing to merge")

    taken: set[str] = set()
    experts = []
    for key, path, params in entries:
        expert: dict[str, Any] = {"name": _expert_name(path, taken), "path": path}
        if method == "slerp":
            extra = set(params) - {"weight"}
            if extra:
                raise _fail(source, f"{key}.parameters.{sorted(extra)[0]}",
                            "slerp takes no per-model parameters")
            expert["weight"] = 1.0
        else:
            expert["weight"] = _weight(params, default_weight, key, source)
            for name in ("density", "gamma"):
                if params.get(name) is not None:
                    expert[name] = params[name]
        experts.append(expert)

    for name, value in settings.items():
        if value is not None:
            parameters[name] = value

    out["base"] = base
    out["experts"] = experts
    out["method"] = method
    out["parameters"] = parameters
    out["seed"] = 0
    out["budget"] = "full"
    dtype_key = "out_dtype" if data.get("out_dtype") is not None else "dtype"
    dtype = data.get(dtype_key)
    out["output"] = {"dir": output_dir,
                     "dtype": None if dtype is None else _dtype(dtype, dtype_key, source)}
    return out


def _weight(params: dict[str, Any], default: Any, key: str, source: str) -> Any:
    weight = params.get("weight", default)
    if weight is None:
        raise _fail(source, f"{key}.parameters.weight", "required (or set parameters.weight "
                                                        "for all models)")
    return weight


def import_mergekit(path: str | os.PathLike[str], *, output_dir: str = DEFAULT_OUTPUT_DIR,
                    validate: bool = True) -> dict[str, Any]:
    """Read a mergekit YAML config and return the equivalent params.yaml dict.

    Model paths are kept as written (mergekit reads them relative to its working
    directory; params.yaml paths are relative to params.yaml's folder).

    Args:
        path: the mergekit config file.
        output_dir: `output.dir` of the result (mergekit takes it on its CLI).
        validate: also check the result as a mergepipe config (method known,
            parameters accepted by the method, ranges).
    Raises:
        ConfigError: unreadable file, or anything mergepipe cannot reproduce.
    """
    source = os.fspath(path)
    params = mergekit_to_params(read_yaml(path), source=source, output_dir=output_dir)
    if validate:
        config_from_dict(params, source=f"{source} (converted to mergepipe params)",
                         root=Path(path).parent)
    return params


_KEY_ORDER = ("base", "experts", "method", "parameters", "seed", "budget", "block_bytes",
              "output", "cache_dir", "nonfinite",
              "name", "path", "weight", "density", "gamma", "dir", "dtype", "shard_bytes")


def _ordered(node: Any) -> Any:
    if isinstance(node, dict):
        rank = {k: i for i, k in enumerate(_KEY_ORDER)}
        keys = sorted(node, key=lambda k: (rank.get(k, len(rank)), str(k)))
        return {k: _ordered(node[k]) for k in keys}
    if isinstance(node, list | tuple):
        return [_ordered(v) for v in node]
    if isinstance(node, os.PathLike):
        return os.fspath(node)
    return node


def dump_params(params: dict[str, Any]) -> str:
    """Deterministic YAML text of a params dict (fixed key order, block style)."""
    return yaml.safe_dump(_ordered(params), sort_keys=False, default_flow_style=False,
                          allow_unicode=True, width=100)


def write_params(params: dict[str, Any], path: str | os.PathLike[str], *,
                 comment: str | None = None) -> None:
    """Write a params dict as YAML, atomically (temp file beside it, then rename).

    Same dict, same bytes. `comment` lines go on top, prefixed with "# ".
    """
    text = dump_params(params)
    if comment:
        text = "".join(f"# {line}\n" for line in comment.splitlines()) + text
    atomic_write_bytes(path, text.encode("utf-8"))
