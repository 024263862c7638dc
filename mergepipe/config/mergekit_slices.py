"""mergekit `slices:` that merge (a slice with several sources, slice-level settings, or part
of the layers) as params.yaml: stacked views and per-slice settings (docs/design.md,
"Slices that merge").

mergekit 0.1.5 merges slice i's sources (each `layer_range` of one model, all of one length
n_i) with the global merge_method, its base `slices[i].base_model` else the global one, and
each parameter from the first scope that gives it: the source's `parameters`, the slice's,
the global ones; gradients at t = j / (n_i - 1) for its j-th layer (1 when n_i = 1). Output
layers are the slices' in order, renumbered from 0; embeddings are merged from slice 0's
sources with slice 0's settings, the other tensors outside the layers from the last slice's.

Here each slice is converted as mergekit's `models:` form of its own (config/mergekit.py, so
every method's base and weight rules carry over), which gives the slice's base and its other
models in order. Position k (the base, or the k-th other model) of every slice is one merge
input: a stacked view (commands/stack.py) whose output layers are, slice by slice, the layers
of the model at that position, its embeddings those of slice 0's and its head those of the
last slice's, exactly the tensors mergekit hands the method for each output tensor. The
params file merges these views with `slices:` (config/slices.py) carrying each slice's
parameters and per-position weights. Every slice must therefore merge the same number of
models; other shapes are refused in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergepipe.config.mergekit import (ModelPaths, _expert_name, _fail, _model_ref, _same_model, _setting,
                                       _with_fallback, mergekit_to_params)
from mergepipe.units import short_repr

BASE = "base"  # the base position's folder under the views folder (never an expert's name)
_SLICE_KEYS = {"sources", "base_model", "parameters", "residual_weight"}  # residual_weight: unused by 0.1.5
# mergekit methods whose input contract ignores base_model (they merge a slice's sources alone)
_BASE_IGNORED = {"linear", "karcher"}


@dataclass(frozen=True, slots=True)
class SlicedRecipe:
    """`views`: position name -> that position's source per slice, [{model (as mergekit names
    it), layer_range}] (commands/stack.py builds each); `slices`: each slice's params dict of
    the models form (config/mergekit.py); `names`: the expert name of each non-base position."""

    views: dict[str, list[dict[str, Any]]]
    slices: list[dict[str, Any]]
    names: list[str]
    lengths: list[int]


def _layer_range(value: Any, key: str, source: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and 0 <= value[0] < value[1]):
        raise _fail(source, key, f"must be [start, end], 0 <= start < end, got {short_repr(value)}")
    return value[0], value[1]


def _merged_parameters(own: Any, default: Any, key: str, source: str) -> dict[str, Any]:
    """A slice's parameters over the global ones (mergekit's precedence, as one setting each)."""
    for name, value in (("parameters", default), (f"{key}.parameters", own)):
        if value is not None and not isinstance(value, dict):
            raise _fail(source, name, f"must be a mapping, got {short_repr(value)}")
    own, default = own or {}, default or {}
    return {k: _with_fallback(_setting(own[k], f"{key}.parameters.{k}", source) if k in own else None,
                              _setting(default[k], f"parameters.{k}", source) if k in default else None)
            for k in sorted({*own, *default}, key=str)}


def _slice_params(data: dict, i: int, sl: Any, source: str, paths: ModelPaths | None
                  ) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, int]]], int]:
    """Slice i as a params dict of the models form, its sources by written path (mergekit
    name, layer_range), and its layer count."""
    key = f"slices[{i}]"
    if not isinstance(sl, dict) or not isinstance(sl.get("sources"), list) or not sl["sources"]:
        raise _fail(source, key, "must be a mapping with a non-empty sources list")
    extra = sorted(set(sl) - _SLICE_KEYS, key=str)
    if extra:
        raise _fail(source, f"{key}.{extra[0]}", f"unknown slice key; expected {', '.join(sorted(_SLICE_KEYS))}")
    models, by_path = [], {}
    for j, src in enumerate(sl["sources"]):
        skey = f"{key}.sources[{j}]"
        if not isinstance(src, dict) or set(src) - {"model", "layer_range", "parameters"} or "model" not in src:
            raise _fail(source, skey, "must be a mapping of model, layer_range and parameters")
        lr = _layer_range(src.get("layer_range"), f"{skey}.layer_range", source)
        if isinstance(src["model"], str) and "+" in src["model"]:
            raise _fail(source, f"{skey}.model", "a LoRA reference ('model+lora') in slices is not built; merge the "
                                                 "adapter into its model first")
        path = _model_ref(src["model"], f"{skey}.model", source, paths)
        if any(_same_model(path, p) for p in by_path):
            raise _fail(source, f"{skey}.model", f"{short_repr(src['model'])} is twice in this slice (mergekit "
                                                 "refuses duplicate merge inputs)")
        by_path[path] = (src["model"], lr)
        models.append({"model": src["model"], **({"parameters": src["parameters"]} if src.get("parameters") else {})})
    lengths = {lr[1] - lr[0] for _, lr in by_path.values()}
    if len(lengths) != 1:
        raise _fail(source, f"{key}.sources", f"layer ranges of lengths {sorted(lengths)}; all inputs to a slice "
                                              "must contain the same number of layers (as mergekit requires)")
    base = sl.get("base_model") if sl.get("base_model") is not None else data.get("base_model")
    method = data.get("merge_method")
    if base is not None and not any(_same_model(_model_ref(base, f"{key}.base_model", source, paths), p)
                                    for p in by_path):
        if method not in _BASE_IGNORED:
            raise _fail(source, f"{key}.sources", f"the base model {short_repr(base)} is not among them; mergekit "
                                                  "merges a slice's sources only and refuses a slice without its base")
        base = None
    sub = {"merge_method": method, "models": models,
           "parameters": _merged_parameters(sl.get("parameters"), data.get("parameters"), key, source),
           **({"base_model": base} if base is not None else {}),
           **{k: data[k] for k in ("dtype", "out_dtype") if data.get(k) is not None}}
    return mergekit_to_params(sub, source=f"{source}: {key}", paths=paths, models_key="sources"), by_path, \
        lengths.pop()


def _position_name(models: list[str], taken: set[str]) -> str:
    """An expert's name: its model's, or its models' joined when slices differ there."""
    distinct = list(dict.fromkeys(models))
    return _expert_name("+".join(m.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] for m in distinct)
                        if len(distinct) > 1 else distinct[0], taken)


def sliced_recipe(data: dict[str, Any], source: str, paths: ModelPaths | None = None) -> SlicedRecipe:
    """The views and per-slice params of a config whose slices merge (see the module docstring).

    Raises:
        ConfigError: a slice mergekit refuses, or slices merging different numbers of models,
            naming the key.
    """
    slices = data.get("slices")
    if data.get("merge_method") == "passthrough":
        raise _fail(source, "slices", "passthrough stacks slices of one source each; a slice here merges several")
    for key in ("tokenizer", "tokenizer_source"):
        if data.get(key) not in (None, "base"):
            raise _fail(source, key, "a tokenizer other than the base's is not built with slices that merge")
    converted = [_slice_params(data, i, sl, source, paths) for i, sl in enumerate(slices)]
    counts = [len(p["experts"]) for p, _, _ in converted]
    for i, n in enumerate(counts):
        if n != counts[0]:
            raise _fail(source, f"slices[{i}].sources", f"merges {n} model(s) besides its base, slices[0] "
                                                        f"{counts[0]}; slices merging different numbers of models "
                                                        "are not built")
    positions: list[list[dict[str, Any]]] = [[] for _ in range(counts[0] + 1)]
    for params, by_path, _ in converted:
        for k, path in enumerate([params["base"], *(e["path"] for e in params["experts"])]):
            model, lr = next(v for p, v in by_path.items() if _same_model(p, path))
            positions[k].append({"model": model, "layer_range": list(lr)})
    taken = {BASE}
    names = [_position_name([s["model"] for s in pos], taken) for pos in positions[1:]]
    return SlicedRecipe({BASE: positions[0], **dict(zip(names, positions[1:]))}, [p for p, _, _ in converted],
                        names, [n for _, _, n in converted])


def sliced_params(data: dict[str, Any], source: str, paths: ModelPaths | None, views_dir: str, *,
                  output_dir: str, recipe: str | None) -> dict[str, Any]:
    """The params dict merging the views in `views_dir` (as params.yaml names it): slice 0's
    settings on top, every slice's under `slices:`; `output_dir` and `recipe` as in
    mergekit_to_params."""
    sliced = sliced_recipe(data, source, paths)
    first = sliced.slices[0]
    experts = [{**e, "name": name, "path": f"{views_dir}/{name}"} for name, e in zip(sliced.names, first["experts"])]
    out_slices, start = [], 0
    for params, n in zip(sliced.slices, sliced.lengths):
        # each knob given in full: the top-level experts' values are slice 0's, never another slice's
        knobs = {k: params["parameters"][k] for k in ("density", "gamma") if k in params["parameters"]}
        out_slices.append({"layers": [start, start + n], "parameters": params["parameters"],
                           "experts": {name: {**knobs, **{k: e[k] for k in ("weight", "density", "gamma") if k in e}}
                                       for name, e in zip(sliced.names, params["experts"])}})
        start += n
    output = {**first["output"], "dir": output_dir, **({} if recipe is None else {"mergekit_config": recipe})}
    return {**first, "base": f"{views_dir}/{BASE}", "experts": experts, "output": output, "slices": out_slices}
