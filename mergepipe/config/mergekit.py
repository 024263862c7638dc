"""Convert a mergekit YAML config into a mergepipe params dict, and write one.

Owns the mapping from mergekit's config language to params.yaml. Only what
mergepipe can reproduce exactly is converted; everything else (LoRA or revision
references, unsupported methods) is a ConfigError
that names the mergekit key, never a silent approximation. Reads the mergekit
file and writes params files; opens no model (a Hugging Face id is looked up
in the local cache, config/hf_cache.py).

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
  model accepts or rejects them. A parameter mergekit's method never reads, and a
  filter condition in no tensor name, are dropped first, each with a warning
  (config/mergekit_ignored.py: mergekit ignores them).
- Gradients and filters (`t: [0, 0.5, 1]`, `weight: [{filter: mlp, value: 0.3}]`)
  become params.yaml's per-tensor settings (config/settings.py), same grammar;
  a model's filtered setting with no catch-all falls back to the global one,
  which is appended as its last condition.
- `tokenizer_source: base` keeps the base's tokenizer; a model copies that
  model's tokenizer files (`output.tokenizer_source`); both with `output.align_vocabulary`,
  every model's embeddings rebuilt in that vocabulary where it differs; `union` and `tokenizer: {source,
  tokens, pad_to_multiple_of}` (source union by default, as mergekit's) become
  `output.tokenizer_source: union`, `output.tokens` (models named as params.yaml names
  them) and `output.pad_to_multiple_of` (checkpoint/vocab.py rebuilds the embeddings).
- `modules:` (config/mergekit_modules.py): each module converted as a `models:` form of its own,
  written as params.yaml's `modules:` (that module's tensors, by tensor-name prefix).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from mergepipe.config.hf_cache import hub_snapshot, looks_like_hub_id
from mergepipe.config.mergekit_chat import chat_template_text
from mergepipe.config.mergekit_ignored import without_ignored
from mergepipe.config.messages import did_you_mean
from mergepipe.config.models import MAX_MERGEKIT_CONFIG_CHARS
from mergepipe.config.params import config_from_dict, parse_yaml, read_yaml
from mergepipe.config.yaml_io import read_yaml_text
from mergepipe.errors import ConfigError
from mergepipe.methods import get_method
from mergepipe.methods.registry import mergekit_names
from mergepipe.units import clip, short_repr
from mergepipe.util.fs import atomic_write_bytes

# What import needs of each method (its mergekit names, what an absent base_model means,
# whether its models take weights, per-model keys that are method parameters here) is on the
# method's registration (methods/registry.py `Mergekit`). MODEL_KEYS: the per-model
# parameters kept per expert.
MODEL_KEYS = ("weight", "density", "gamma")

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
_TOP_KEYS = {"models", "slices", "modules", "base_model", "merge_method", "parameters", "dtype", "out_dtype",
             "tokenizer_source", "tokenizer", "chat_template"}
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def _fail(source: str, key: str, message: str) -> ConfigError:
    """The one-line error naming the mergekit key; values in `message` are quoted with
    short_repr, and the key (which holds the user's own key names) is clipped likewise."""
    return ConfigError(f"{source}: {clip(str(key))}: {message}")


# a number written as a string ("1e-5"), which mergekit reads by the parameter's numeric type
_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _leaf(value: Any, key: str, source: str) -> Any:
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        text = value.strip()
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise _fail(source, key, f"unsupported value {short_repr(value)}; expected a number, boolean or string")


def _setting(value: Any, key: str, source: str) -> Any:
    """A mergekit `ParameterSetting` as params.yaml writes it: a scalar when it is one value
    for every tensor (a scalar, a one-element list, an unfiltered first condition with a
    scalar value), else the per-tensor setting in mergekit's own grammar (gradient list or
    list of {filter, value}), checked here so that errors name the mergekit key."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return _leaf(value, key, source)
    if not value:
        raise _fail(source, key, "empty list; give a value")
    if not any(isinstance(v, dict) for v in value):
        leaves = [_leaf(v, key, source) for v in value]
        return leaves[0] if len(leaves) == 1 else leaves
    conditions = []
    for cond in value:
        if not isinstance(cond, dict):
            raise _fail(source, key, f"mixes conditions and plain values: {short_repr(value)}")
        unknown = set(cond) - {"filter", "value"}
        if unknown:
            raise _fail(source, key, f"unexpected keys {short_repr(sorted(unknown, key=str))} in a conditional "
                                     "parameter; expected {filter, value}")
        if "value" not in cond:
            raise _fail(source, key, f"condition {short_repr(cond)} has no value")
        inner = cond["value"]
        if isinstance(inner, list):
            inner = [_leaf(v, key, source) for v in inner]
            inner = inner[0] if len(inner) == 1 else inner
        else:
            inner = _leaf(inner, key, source)
        flt = cond.get("filter")
        if flt is not None and not isinstance(flt, str):
            raise _fail(source, key, f"filter must be a string, got {short_repr(flt)}")
        conditions.append({"value": inner} if flt in (None, "*") else {"filter": flt, "value": inner})
    if "filter" not in conditions[0]:
        return conditions[0]["value"]  # the first condition matches every tensor
    return conditions


def _catch_all(setting: Any) -> bool:
    """Whether `setting` gives a value for every tensor."""
    return not isinstance(setting, list) or not setting or not isinstance(setting[0], dict) or \
        any("filter" not in c for c in setting)


def _with_fallback(own: Any, default: Any) -> Any:
    """A model's setting, else the global one where none of its conditions matches
    (mergekit's precedence, as one setting: the global one's conditions appended)."""
    if own is None:
        return default
    if default is None or _catch_all(own):
        return own
    tail = default if isinstance(default, list) and default and isinstance(default[0], dict) \
        else [{"value": default}]
    return [*own, *tail]


@dataclass(frozen=True, slots=True)
class ModelPaths:
    """Where the model paths of a mergekit config are looked up and how params.yaml writes them.

    mergekit reads a relative model path against its working directory (`cwd`) only; the
    written params file reads its paths against its own folder (`params_dir`). A local model
    is rewritten relative to `params_dir` (lexically, as config/paths.py reads it back), so
    the params file names the same folder wherever -o puts it, and a project moved as a whole
    (params file and models) keeps working; absolute and `~` paths stay as written."""

    cwd: Path
    params_dir: Path

    def local(self, ref: str) -> Path | None:
        """The folder `ref` names for mergekit, if it is one."""
        folder = self.cwd / ref
        return folder if folder.is_dir() else None

    def written(self, ref: str) -> str:
        """`ref` (relative to `cwd`) as the params file names it."""
        if os.path.isabs(ref) or ref.startswith("~"):
            return ref
        rel = Path(os.path.relpath(self.cwd / ref, self.params_dir)).as_posix()
        return ref if rel == Path(os.path.normpath(ref)).as_posix() else rel

    def mergekit_ref(self, params_ref: str) -> str:
        """A path relative to `params_dir` as mergekit would name it (relative to `cwd`)."""
        return os.path.relpath(self.params_dir / params_ref, self.cwd)


def _model_ref(value: Any, key: str, source: str, paths: ModelPaths | None = None) -> str:
    """A model reference as a params.yaml path: a local folder (relative to mergekit's working
    directory) rewritten for the params file, else (like mergekit) a Hugging Face id, taken
    from the local cache (its snapshot folder) or refused naming the id. `paths` None: kept as
    written (no lookup)."""
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, key, f"must be a model path string, got {short_repr(value)}")
    if "+" in value:
        raise _fail(source, key, f"LoRA reference {short_repr(value)} ('model+lora') cannot be expressed here; "
                                 "an adapter is taken as a models[i].model BASE+ADAPTER on the base model")
    if "@" in value:
        raise _fail(source, key, f"revision reference {short_repr(value)} ('model@revision') cannot be "
                                 "expressed; download that revision to a local folder")
    if paths is None:
        return value
    if paths.local(value) is not None or not looks_like_hub_id(value):
        return paths.written(value)  # a missing folder too: the plan names it where params.yaml points
    try:
        return str(hub_snapshot(value))
    except ConfigError as err:
        raise _fail(source, key, str(err)) from None


def resolve_model_ref(value: Any, key: str, source: str) -> Path:
    """The folder a mergekit model reference names: relative to the working directory, as
    mergekit reads it, or a Hugging Face id's cached snapshot; or the one-line error naming
    `key` (LoRA, revision, an id not in the cache)."""
    cwd = Path.cwd()
    return cwd / _model_ref(value, key, source, ModelPaths(cwd, cwd))


def _check_adapter_model(adapters: dict[str, str], key: str, base: str, source: str) -> None:
    """mergepipe applies an adapter to the merge's base (checkpoint/lora.py); mergekit's
    `model+lora` on another model would be another expert than the one it builds."""
    if not _same_model(adapters[key], base):
        raise _fail(source, f"{key}.model", f"the LoRA adapter is on {short_repr(adapters[key])}, not on the base "
                                            f"model {short_repr(base)}; mergepipe applies adapters to the base: "
                                            "merge that adapter into its model first")


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
        raise _fail(source, key, f"must be a dtype name, got {short_repr(value)}")
    name = value.removeprefix("torch.")
    if name not in _DTYPES:
        raise _fail(source, key, f"dtype {short_repr(value)} is not supported; use bfloat16, float16 "
                                 "or float32")
    return _DTYPES[name]


def _check_tokenizer(data: dict[str, Any], source: str) -> None:
    """The tokenizer keys' shape (mergekit's TokenizerConfig); their models are mapped later."""
    tokenizer = data.get("tokenizer")
    if tokenizer is None:
        return
    if data.get("tokenizer_source") is not None:
        raise _fail(source, "tokenizer", "give tokenizer_source or tokenizer, not both (mergekit refuses both)")
    if not isinstance(tokenizer, dict):
        raise _fail(source, "tokenizer", f"must be a mapping, got {short_repr(tokenizer)}")
    for key in tokenizer:
        if key not in ("source", "tokens", "pad_to_multiple_of"):
            raise _fail(source, f"tokenizer.{key}", "unknown key; supported: source, tokens, pad_to_multiple_of")
    if not isinstance(tokenizer.get("tokens") or {}, dict):
        raise _fail(source, "tokenizer.tokens", f"must be a mapping of token to source, got "
                                                f"{short_repr(tokenizer['tokens'])}")


def _token_model(value: Any, key: str, source: str, paths: ModelPaths | None, names: dict[str, str]) -> str:
    """A model reference of `tokens:` as params.yaml names the model: 'base' or an expert's name."""
    path = _model_ref(value, key, source, paths)
    for written, name in names.items():
        if _same_model(path, written):
            return name
    raise _fail(source, key, f"{short_repr(value)} is not a model of this merge; name the base model or one of "
                             "the models")


def _token_rules(tokens: dict, source: str, paths: ModelPaths | None, names: dict[str, str]) -> dict[str, Any]:
    """mergekit's `tokenizer.tokens` as params.yaml's `output.tokens` (config/vocabulary.py)."""
    out: dict[str, Any] = {}
    for token, spec in tokens.items():
        key = f"tokenizer.tokens.{token}"
        if not isinstance(spec, dict) or set(spec) - {"source", "force"}:
            raise _fail(source, key, f"must be {{source, force}}, got {short_repr(spec)}")
        src = spec.get("source")
        if isinstance(src, dict) and src.get("kind") == "model_token":
            src = {**src, "model": _token_model(src.get("model"), f"{key}.source.model", source, paths, names)}
        elif not isinstance(src, dict):
            src = _token_model(src, f"{key}.source", source, paths, names)
        out[str(token)] = {"source": src, **({"force": spec["force"]} if "force" in spec else {})}
    return out


def _tokenizer_output(data: dict[str, Any], source: str, paths: ModelPaths | None, base: str | None,
                      experts: list[dict[str, Any]]) -> dict[str, Any]:
    """params.yaml's output.tokenizer_source / tokens / pad_to_multiple_of for mergekit's
    `tokenizer_source` or `tokenizer: {source (default union), tokens, pad_to_multiple_of}`."""
    tokenizer = data.get("tokenizer")
    token_source = data.get("tokenizer_source") if tokenizer is None else tokenizer.get("source", "union")
    key = "tokenizer_source" if tokenizer is None else "tokenizer.source"
    out: dict[str, Any] = {}
    if token_source == "union":
        out["tokenizer_source"] = "union"
    elif token_source not in (None, "base"):
        token_path = _model_ref(token_source, key, source, paths)
        if base is None or not _same_model(token_path, base):
            out["tokenizer_source"] = token_path
    if tokenizer is not None:
        names = {**({} if base is None else {base: "base"}),
                 **{e.get("path", e.get("adapter")): e["name"] for e in experts}}
        if tokenizer.get("tokens"):
            out["tokens"] = _token_rules(tokenizer["tokens"], source, paths, names)
        if tokenizer.get("pad_to_multiple_of") is not None:
            out["pad_to_multiple_of"] = tokenizer["pad_to_multiple_of"]
    if token_source not in (None, "union") and "tokens" not in out and "pad_to_multiple_of" not in out:
        out["align_vocabulary"] = True  # mergekit rebuilds every model's embeddings in that vocabulary
    return out


# Long: to be split by concern (models, base, parameters, output): issue 23 item 2.
def mergekit_to_params(data: Any, *, source: str = "<mergekit>", output_dir: str | None = None,
                       paths: ModelPaths | None = None, stack_dir: str | None = None,
                       recipe: str | None = None, models_key: str = "models") -> dict[str, Any]:
    """Map a parsed mergekit config to a params dict (not yet validated).

    `output_dir`: `output.dir` (default: named after `source`, `recipe_output_dir`).
    `stack_dir`: the folder (as params.yaml names it) where the CLI builds the stacked model
    of a passthrough `slices` config (`stacking_slices`), which is then merged as one model.
    `paths`: where model paths are looked up and how they are written (`ModelPaths`); given,
    a reference that is no local folder and looks like `org/name` is resolved from the Hugging
    Face cache (config/hf_cache.py), as mergekit downloads what is not a local folder.
    `recipe`: the mergekit YAML's text, kept as `output.mergekit_config` for the output.
    `models_key`: what errors call the models list (a slice's `sources`, config/mergekit_slices.py).

    Raises:
        ConfigError: for anything mergepipe cannot reproduce, naming the key.
    """
    _check_top_level(data, source, paths)
    converted, data = _modules_or_slices(data, source, output_dir, paths, stack_dir, recipe)
    if converted is not None:
        return converted
    mk_method, method, facts = _method(data, source)
    settings, default_weight = _global_settings(data, source)
    entries, adapters, shared = _model_entries(data, source, paths, models_key, facts.shared_model_keys)
    for name, (_, value) in shared.items():
        settings.setdefault(name, value)
    base = data.get("base_model")
    if base is not None:
        base = _model_ref(base, "base_model", source, paths)
    if base is None and facts.no_base is not None and entries and entries[0][0] in adapters:
        raise _fail(source, f"{entries[0][0]}.model", "a LoRA reference ('model+lora') cannot play the base "
                                                      "model; name base_model")
    parameters: dict[str, Any] = {}
    base, entries = _place_base(base, entries, parameters, settings, default_weight,
                                mk_method=mk_method, method=method, no_base=facts.no_base, source=source,
                                models_key=models_key)
    if facts.unweighted and default_weight is None:
        default_weight = 1.0
    experts = _experts(entries, adapters, base, method, default_weight, source)
    parameters.update({name: value for name, value in settings.items() if value is not None})
    dtype_key = "out_dtype" if data.get("out_dtype") is not None else "dtype"
    dtype = data.get(dtype_key)
    out: dict[str, Any] = {"base": base, "experts": experts, "method": method, "parameters": parameters,
                           "seed": 0, "budget": "full"}
    out["output"] = {"dir": recipe_output_dir(source) if output_dir is None else output_dir,
                     "dtype": None if dtype is None else _dtype(dtype, dtype_key, source)}
    out["output"].update(_tokenizer_output(data, source, paths, base, experts))
    if recipe is not None:
        out["output"]["mergekit_config"] = recipe
    return out


def _check_top_level(data: Any, source: str, paths: ModelPaths | None) -> None:
    """A mapping of mergekit's keys; its tokenizer and chat template ones refused before converting."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mergekit config mapping, "
                          f"got {type(data).__name__}")
    for key in data:
        if key not in _TOP_KEYS:
            raise _fail(source, key, f"unknown mergekit key{did_you_mean(key, _TOP_KEYS)}; "
                                     f"supported: {', '.join(sorted(_TOP_KEYS))}")
    _check_tokenizer(data, source)
    chat_template_text(data, source, Path.cwd() if paths is None else paths.cwd)


def _modules_or_slices(data: dict, source: str, output_dir: str | None, paths: ModelPaths | None,
                       stack_dir: str | None, recipe: str | None) -> tuple[dict[str, Any] | None, dict]:
    """(the params, data) where `modules:` or `slices:` convert the whole recipe; else (None, the
    recipe with its slices as a `models:` list, or unchanged)."""
    own_dir = recipe_output_dir(source) if output_dir is None else output_dir
    if data.get("modules") not in (None, {}):  # each module converted as a models: form (config/mergekit_modules.py)
        from mergepipe.config.mergekit_modules import modules_params
        return modules_params(data, source, paths, recipe=recipe, output_dir=own_dir), data
    if data.get("slices") in (None, []):
        return None, data
    if data.get("models"):
        raise _fail(source, "slices", "give either slices or models, not both")
    if stacking_slices(data, source) is not None:
        if stack_dir is None:
            raise _fail(source, "slices", "stacking layers builds a model folder first; "
                                          "run `mergepipe import-mergekit CONFIG -o params.yaml`")
        stack_ref = stack_dir if paths is None else paths.mergekit_ref(stack_dir)
        from mergepipe.config.mergekit_slices import stacked_slice_parameters
        per_slice = stacked_slice_parameters(data, source)
        data = {**data, "models": [{"model": stack_ref}]}  # passthrough of the stacked folder
        if per_slice is None:
            return None, data
        # its layers scaled slice by slice (the top level: slice 0's)
        params = mergekit_to_params({**data, "slices": None, "parameters": per_slice[0]["parameters"]},
                                    source=source, output_dir=output_dir, paths=paths, recipe=recipe)
        return {**params, "slices": per_slice}, data
    if merges_slices(data["slices"], paths):
        if stack_dir is None:
            raise _fail(source, "slices", "slices that merge build stacked views first; "
                                          "run `mergepipe import-mergekit CONFIG -o params.yaml`")
        from mergepipe.config.mergekit_slices import sliced_params
        return sliced_params(data, source, paths, stack_dir, output_dir=own_dir, recipe=recipe), data
    return None, {**data, "models": _slices_as_models(data["slices"], source, paths)}


def _method(data: dict, source: str):
    """(mergekit's method name, ours, its Mergekit facts)."""
    mk_method = data.get("merge_method")
    names = mergekit_names()
    if not isinstance(mk_method, str) or mk_method not in names:
        raise _fail(source, "merge_method", f"{short_repr(mk_method)} has no mergepipe equivalent"
                                            f"{did_you_mean(mk_method, names)}; "
                                            f"supported: {', '.join(sorted(names))}")
    method = names[mk_method]
    return mk_method, method, get_method(method).mergekit


def _global_settings(data: dict, source: str) -> tuple[dict[str, Any], Any]:
    """The top-level `parameters` as settings, and their `weight` (the models' default) apart."""
    global_params = data.get("parameters") or {}
    if not isinstance(global_params, dict):
        raise _fail(source, "parameters", f"must be a mapping, got {short_repr(global_params)}")
    settings = {k: _setting(v, f"parameters.{k}", source) for k, v in global_params.items()}
    return settings, settings.pop("weight", None)


def _model_entries(data: dict, source: str, paths: ModelPaths | None, models_key: str, shared_keys
                   ) -> tuple[list[tuple[str, str, dict]], dict[str, str], dict[str, tuple[str, Any]]]:
    """([(key, path, per-model settings)], {key: the model its LoRA adapter applies to},
    {shared key: (where, value)}: per-model keys that are one method parameter here)."""
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise _fail(source, models_key, "must be a non-empty list of {model, parameters}")
    entries = []
    adapters: dict[str, str] = {}  # models[i] -> the model its LoRA adapter (entry path) applies to
    shared: dict[str, tuple[str, Any]] = {}
    for i, entry in enumerate(models):
        key = f"{models_key}[{i}]"
        entry = _model_entry(entry, key, source)
        model = entry.get("model")
        if isinstance(model, str) and "+" in model:  # mergekit's `model+lora`: an adapter on that model
            model, adapter = model.split("+", 1)
            adapters[key] = _model_ref(model, f"{key}.model", source, paths)
            path = _model_ref(adapter, f"{key}.model", source, paths)
        else:
            path = _model_ref(model, f"{key}.model", source, paths)
        entries.append((key, path, _model_settings(entry, key, source, shared_keys, shared)))
    return entries, adapters, shared


def _model_entry(entry: Any, key: str, source: str) -> dict:
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict):
        raise _fail(source, key, f"must be a mapping with model and parameters, got {short_repr(entry)}")
    unknown = set(entry) - {"model", "parameters"}
    if unknown:
        first = sorted(unknown, key=str)[0]
        raise _fail(source, f"{key}.{first}", f"unknown key{did_you_mean(first, ('model', 'parameters'))}; "
                                              "expected model, parameters")
    return entry


def _model_settings(entry: dict, key: str, source: str, shared_keys, shared: dict[str, tuple[str, Any]]
                    ) -> dict[str, Any]:
    """A model's own settings; a shared key's value goes to `shared` (one value for all models)."""
    own = entry.get("parameters") or {}
    if not isinstance(own, dict):
        raise _fail(source, f"{key}.parameters", f"must be a mapping, got {short_repr(own)}")
    params = {}
    for name, value in own.items():
        where = f"{key}.parameters.{name}"
        if name in shared_keys:
            value = _setting(value, where, source)
            if name in shared and shared[name][1] != value:
                raise _fail(source, where, f"{short_repr(value)} differs from {shared[name][0]}'s "
                                           f"{short_repr(shared[name][1])}; "
                                           f"mergepipe takes one {name} for all models")
            shared.setdefault(name, (where, value))
            continue
        if name not in MODEL_KEYS:
            raise _fail(source, where, f"per-model {short_repr(name)} cannot be expressed"
                                       f"{did_you_mean(name, (*MODEL_KEYS, *shared_keys))}; per-model keys: "
                                       f"{', '.join((*MODEL_KEYS, *shared_keys))}")
        params[name] = _setting(value, where, source)
    return params


def _place_base(base: str | None, entries: list, parameters: dict[str, Any], settings: dict[str, Any],
                default_weight, *, mk_method: str, method: str, no_base: str | None, source: str,
                models_key: str) -> tuple[str, list]:
    """(the base, the experts' entries): mergekit's rule for a recipe without base_model (its
    method's `no_base`), linear's listed or unlisted base, or the delta methods' required base.
    Sets `parameters["base_weight"]` where the base is weighted."""
    if base is None and no_base in ("first", "member"):
        key, base, first = entries.pop(0)
        if no_base == "first" and not entries and method == "linear":  # one model: itself at weight 0 (adds 0)
            entries = [(key, base, {"weight": 0.0})]
        if not entries:
            raise _fail(source, models_key, f"{mk_method} without base_model needs at least two models")
        if no_base == "first":
            parameters["base_weight"] = _weight(first, default_weight, key, source)
        return base, entries
    if base is None and no_base == "self":
        if len(entries) != 1:
            raise _fail(source, models_key, f"{mk_method} takes exactly one model, got {len(entries)}")
        return entries[0][1], entries
    if method == "linear":
        return base, _linear_base(base, entries, parameters, default_weight, source)
    if base is None:
        raise _fail(source, "base_model", f"required: {mk_method} merges deltas from a "
                                          "base model")
    if no_base != "self":
        entries = [e for e in entries if not _same_model(e[1], base)]
    if method == "slerp" and settings.get("t") is None:
        raise _fail(source, "parameters.t", "required by slerp (0 gives the base, 1 the "
                                            "other model)")
    if method == "slerp" and len(entries) != 1:
        raise _fail(source, models_key, "slerp takes the base model and exactly one other "
                                        f"model, got {len(entries)} others")
    if not entries:
        raise _fail(source, models_key, "lists only the base model; nothing to merge")
    return base, entries


def _linear_base(base: str, entries: list, parameters: dict[str, Any], default_weight, source: str) -> list:
    """mergekit's linear merge averages the base too: its listed weight, or the global one."""
    listed = [e for e in entries if _same_model(e[1], base)]
    entries = [e for e in entries if not _same_model(e[1], base)]
    if listed:
        key, _, base_params = listed[0]
        parameters["base_weight"] = _weight(base_params, default_weight, key, source)
        if not entries:  # the base alone: itself at weight 0 is the expert (adds 0)
            entries = [(key, base, {"weight": 0.0})]
    elif default_weight is not None:
        # mergekit adds the unlisted base as a source; only the global weight applies
        parameters["base_weight"] = default_weight
    else:
        raise _fail(source, "base_model", "mergekit's linear merge also averages the "
                                          "base model; list it in models with a weight")
    return entries


def _experts(entries: list, adapters: dict[str, str], base: str, method: str, default_weight,
             source: str) -> list[dict[str, Any]]:
    """The params' expert entries, named after their folders (never "base": the plan's name for it)."""
    taken: set[str] = {"base"}  # config/checks.py check_unique_names
    experts = []
    for key, path, params in entries:
        expert: dict[str, Any] = {"name": _expert_name(path, taken), "path": path}
        if key in adapters:
            _check_adapter_model(adapters, key, base, source)
            expert = {"name": expert["name"], "adapter": path}
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
    return experts


def _layer_count(folder: Path) -> int | None:
    """The number of layers config.json declares (text_config's for a multimodal model)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for node in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(node, dict):
            for key in ("num_hidden_layers", "n_layer", "num_layers"):
                if isinstance(node.get(key), int):
                    return node[key]
    return None


def _model_layers(model: str, paths: ModelPaths) -> int | None:
    """The layer count of a model as mergekit names it (None: no readable config.json)."""
    local = paths.local(model)
    if local is None and looks_like_hub_id(model):
        try:
            local = hub_snapshot(model)
        except ConfigError:
            pass  # named by the models check
    return _layer_count(local) if local is not None else None


def merges_slices(slices: Any, paths: ModelPaths | None) -> bool:
    """Whether `slices` merge part of the layers or several slices, or carry slice-level settings
    (config/mergekit_slices.py), rather than being the `models:` form in disguise (one slice
    whose sources all cover every layer, `_slices_as_models`, which also names what is malformed)."""
    if not isinstance(slices, list) or not slices or not all(isinstance(s, dict) for s in slices):
        return False
    if len(slices) > 1:
        return True
    if any(v not in (None, {}, []) for k, v in slices[0].items() if k != "sources"):
        return True
    sources = slices[0].get("sources")
    if not isinstance(sources, list) or not all(isinstance(s, dict) and isinstance(s.get("model"), str)
                                                and isinstance(s.get("layer_range"), list | tuple)
                                                and len(s["layer_range"]) == 2 for s in sources):
        return False
    if any(s["layer_range"][0] != 0 for s in sources):
        return True
    return paths is not None and any(_model_layers(s["model"], paths) not in (None, s["layer_range"][1])
                                     for s in sources)


def stacking_slices(data: Any, source: str) -> list[dict[str, Any]] | None:
    """The slices of a passthrough config that stacks layers (several slices, or one that
    is part of its model), each {model, layer_range}; None for any other config.

    Raises:
        ConfigError: a stacking slice with several sources, settings or a bad layer_range.
    """
    if not isinstance(data, dict):  # empty file, a list: mergekit_to_params names the problem
        return None
    slices = data.get("slices")
    if data.get("merge_method") != "passthrough" or not isinstance(slices, list) or not slices:
        return None
    if len(slices) == 1 and isinstance(slices[0], dict) and isinstance(slices[0].get("sources"), list) and \
            all(isinstance(s, dict) and (s.get("layer_range") or [None])[0] == 0 for s in slices[0]["sources"]) and \
            len(slices[0]["sources"]) == 1:
        return None  # one whole model: the models: form (checked by _slices_as_models)
    out = []
    for i, sl in enumerate(slices):
        key = f"slices[{i}]"
        if not isinstance(sl, dict) or not isinstance(sl.get("sources"), list) or len(sl["sources"]) != 1:
            raise _fail(source, key, "a stacked slice takes exactly one source (merging inside stacked "
                                     "slices is not built)")
        extra = sorted((k for k, v in sl.items() if k not in ("sources", "parameters") and v not in (None, {}, [])),
                       key=str)
        src = sl["sources"][0]
        if extra or not isinstance(src, dict) or set(src) - {"model", "layer_range", "parameters"}:
            raise _fail(source, key, "stacked slices take only parameters and sources: "
                                     "[{model, layer_range, parameters}]")
        lr = src.get("layer_range")
        if not (isinstance(lr, list | tuple) and len(lr) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in lr)
                and 0 <= lr[0] < lr[1]):
            raise _fail(source, f"{key}.sources[0].layer_range",
                        f"must be [start, end], start < end, got {short_repr(lr)}")
        out.append({"model": _model_ref(src.get("model"), f"{key}.sources[0].model", source),
                    "layer_range": [lr[0], lr[1]]})
    return out


def _slices_as_models(slices: Any, source: str, paths: ModelPaths | None) -> list[dict[str, Any]]:
    """`slices` that are the `models:` form in disguise: one slice whose sources all cover
    every layer ([0, n], n the model's layer count, checked where the model folder is
    readable; not checked when converting without `paths`). Stacking several slices (a
    frankenmerge) or partial ranges is refused."""
    if not isinstance(slices, list):
        raise _fail(source, "slices", f"must be a list of {{sources}}, got {short_repr(slices)}")
    if len(slices) != 1:
        raise _fail(source, "slices", f"{len(slices)} slices stack layers (a frankenmerge); not built: "
                                      "mergepipe merges whole models (one slice over every layer)")
    out_slice = slices[0]
    if not isinstance(out_slice, dict) or not isinstance(out_slice.get("sources"), list) or not out_slice["sources"]:
        raise _fail(source, "slices[0]", "must be a mapping with a non-empty sources list")
    extra = sorted((k for k, v in out_slice.items() if k != "sources" and v not in (None, {}, [])), key=str)
    if extra:
        raise _fail(source, f"slices[0].{extra[0]}", "slice-level settings cannot be expressed; put them "
                                                    "under the top-level parameters")
    models = []
    for i, src in enumerate(out_slice["sources"]):
        key = f"slices[0].sources[{i}]"
        if not isinstance(src, dict) or set(src) - {"model", "layer_range", "parameters"}:
            raise _fail(source, key, "must be a mapping of model, layer_range and parameters")
        lr = src.get("layer_range")
        if not (isinstance(lr, list | tuple) and len(lr) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in lr)):
            raise _fail(source, f"{key}.layer_range", f"must be [start, end], got {short_repr(lr)}")
        if lr[0] != 0:
            raise _fail(source, f"{key}.layer_range", f"{list(lr)} is part of the model; not built: "
                                                      "mergepipe merges whole models ([0, n])")
        model = src.get("model")
        if paths is not None and isinstance(model, str):
            n = _model_layers(model, paths)
            if n is None:
                raise _fail(source, f"{key}.layer_range", f"cannot check that {list(lr)} is every layer of "
                                                          f"{short_repr(model)}: no readable config.json there")
            if lr[1] != n:
                raise _fail(source, f"{key}.layer_range", f"{list(lr)} is not every layer of {short_repr(model)} "
                                                          f"(it has {n}); not built: mergepipe merges whole models")
        models.append({"model": model, **({"parameters": src["parameters"]} if src.get("parameters") else {})})
    ends = {tuple(s.get("layer_range")) for s in out_slice["sources"]}
    if len(ends) != 1:
        raise _fail(source, "slices[0].sources", f"layer ranges differ ({sorted(ends)}); not built")
    return models


def _weight(params: dict[str, Any], default: Any, key: str, source: str) -> Any:
    weight = _with_fallback(params.get("weight"), default)
    if weight is None:
        raise _fail(source, f"{key}.parameters.weight", "required (or set parameters.weight "
                                                        "for all models)")
    return weight


def recipe_output_dir(params_file: str | os.PathLike[str]) -> str:
    """`output.dir` of an imported recipe: `merged-<stem>` (beside the params file, which names
    it relative to its own folder), the stem being the file name without `.yaml`/`.yml`. Two
    params files of one folder have different names, so two imported recipes never publish
    into one folder, nor into the demo's `merged/` (`check_output_unshared` covers the
    `x.yaml`/`x.yml` pair)."""
    name = Path(params_file).name
    for suffix in (".yaml", ".yml"):
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            name = name[:-len(suffix)]
            break
    return f"merged-{name}"


def check_output_unshared(params_file: str | os.PathLike[str], output_dir: str) -> None:
    """Refuse an `output.dir` that the params file's `.yaml`/`.yml` twin beside it also names.

    Raises:
        ConfigError: naming both files and the folder.
    """
    params_file = Path(params_file)
    name = params_file.name
    stem = name[:-len(params_file.suffix)] if params_file.suffix.lower() in (".yaml", ".yml") else name
    for twin in (params_file.with_name(stem + ".yaml"), params_file.with_name(stem + ".yml")):
        if twin.name == name or not twin.is_file():
            continue
        try:
            other = (read_yaml(twin) or {}).get("output", {}).get("dir")
        except (ConfigError, AttributeError):
            continue  # not a params file (the mergekit recipe itself, say): it publishes nothing
        if isinstance(other, str) and os.path.normpath(other) == os.path.normpath(output_dir):
            raise ConfigError(f"{params_file}: output.dir {output_dir!r} is also {twin.name}'s (beside it); two "
                              "recipes would publish into one folder: give the params file another name")


def import_mergekit(path: str | os.PathLike[str], *, params_path: str | os.PathLike[str] | None = None,
                    output_dir: str | None = None, validate: bool = True,
                    stack_dir: str | None = None, warnings: list[str] | None = None) -> dict[str, Any]:
    """Read a mergekit YAML config and return the equivalent params.yaml dict.

    Model paths are looked up as mergekit does (relative to the working directory) and
    written relative to the params file's folder (`ModelPaths`), a Hugging Face id as its
    cached snapshot folder. The YAML's text is kept as `output.mergekit_config`.

    Args:
        path: the mergekit config file.
        params_path: where the params file will be written (default: in the working directory,
            named after `path`); its folder is what the written paths are relative to.
        output_dir: `output.dir` of the result (default: `recipe_output_dir(params_path)`).
        validate: also check the result as a mergepipe config (method known,
            parameters accepted by the method, ranges).
        stack_dir: the stacked model folder of a layer-stacking config, relative to the
            params file's folder.
        warnings: gets one line for each parameter or filter condition mergekit never reads,
            which the conversion drops (config/mergekit_ignored.py).
    Raises:
        ConfigError: unreadable file, or anything mergepipe cannot reproduce.
    """
    source = os.fspath(path)
    cwd = Path.cwd()
    params_file = Path(os.path.abspath(params_path)) if params_path is not None else cwd / Path(path).name
    if params_path is not None and output_dir is None:
        check_output_unshared(params_file, recipe_output_dir(params_file))
    text = read_yaml_text(path)
    if len(text) > MAX_MERGEKIT_CONFIG_CHARS:
        raise ConfigError(f"{source}: over {MAX_MERGEKIT_CONFIG_CHARS >> 10} KiB of text; the output keeps the "
                          "recipe (output.mergekit_config), and a mergekit config is a few KiB")
    data, ignored = without_ignored(parse_yaml(text, source=source), source, cwd)
    params = mergekit_to_params(data, source=source,
                                output_dir=recipe_output_dir(params_file) if output_dir is None else output_dir,
                                paths=ModelPaths(cwd, params_file.parent), stack_dir=stack_dir, recipe=text)
    template = chat_template_text(data, source, cwd, ignored)
    if template is not None:  # the text the output's chat_template.jinja holds (output/chat_template.py)
        params["output"]["chat_template"] = template
    if validate:
        check_imported(params, source=source, params_path=params_file)
    if warnings is not None:
        warnings.extend(ignored)
    return params


def check_imported(params: dict[str, Any], *, source: str, params_path: str | os.PathLike[str]) -> None:
    """Validate an imported params dict as the params file at `params_path` will read it.

    Raises:
        ConfigError: naming `source` and the key.
    """
    config_from_dict(params, source=f"{source} (converted to mergepipe params)",
                     root=Path(os.path.abspath(params_path)).parent)


_KEY_ORDER = ("layers", "prefixes", "base", "experts", "method", "parameters", "seed", "budget", "block_bytes",
              "output", "cache_dir", "nonfinite", "slices", "modules",
              "name", "path", "weight", "density", "gamma", "dir", "dtype", "shard_bytes",
              "tokenizer_source", "chat_template", "mergekit_config")


def _ordered(node: Any, *, keep: bool = False) -> Any:
    """`keep`: the dict's own order (output.tokens: new tokens are added in their order)."""
    if isinstance(node, dict):
        rank = {k: i for i, k in enumerate(_KEY_ORDER)}
        keys = list(node) if keep else sorted(node, key=lambda k: (rank.get(k, len(rank)), str(k)))
        return {k: _ordered(node[k], keep=k == "tokens") for k in keys}
    if isinstance(node, list | tuple):
        return [_ordered(v) for v in node]
    if isinstance(node, os.PathLike):
        return os.fspath(node)
    return node


class _ParamsDumper(yaml.SafeDumper):
    """Multi-line strings (the kept mergekit recipe) as literal blocks, where YAML can write
    them so (else quoted); every other value as safe_dump writes it."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_ParamsDumper.add_representer(str, _represent_str)


def dump_params(params: dict[str, Any]) -> str:
    """Deterministic YAML text of a params dict (fixed key order, block style)."""
    return yaml.dump(_ordered(params), Dumper=_ParamsDumper, sort_keys=False, default_flow_style=False,
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
