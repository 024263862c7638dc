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
parameters and per-position weights. A slice merging fewer models than another fills its
missing positions with its own base's layers at weight 0: an expert equal to the base with weight
0 adds exactly nothing in the additive methods (`_ZERO_NEUTRAL`), so the slice merges only its own
sources, as in mergekit; for other methods such slices are refused in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.config.mergekit import (ModelPaths, _expert_name, _fail, _model_ref, _same_model, _setting,
                                       _with_fallback, mergekit_to_params, resolve_model_ref)
from mergepipe.config.settings import LAYER_RE, parse_setting
from mergepipe.config.slices import PRE_WEIGHT_RE
from mergepipe.methods import get_method
from mergepipe.units import short_repr

BASE = "base"  # the base position's folder under the views folder (never an expert's name)
_SLICE_KEYS = {"sources", "base_model", "parameters", "residual_weight"}  # residual_weight: unused by 0.1.5
# per-input settings: mergekit matches their filters against the source's tensor name
_PER_INPUT = ("weight", "density", "gamma")
# mergekit methods whose input contract ignores base_model (they merge a slice's sources alone)
_BASE_IGNORED = {"linear", "karcher"}
# mergekit methods where an expert equal to the base at weight 0 changes no bit of the merge
# (every term it adds is 0 * 0 or 0 * x, and no count or norm of the experts is taken)
_ZERO_NEUTRAL = {"linear", "task_arithmetic", "ties"}


@dataclass(frozen=True, slots=True)
class SlicedRecipe:
    """`views`: position name -> that position's source per slice, [{model (as mergekit names
    it), layer_range}] (commands/stack.py builds each); `slices`: each slice's params dict of
    the models form (config/mergekit.py), whose experts are the first positions (the later ones
    are that slice's base, at weight 0); `names`: the expert name of each non-base position."""

    views: dict[str, list[dict[str, Any]]]
    slices: list[dict[str, Any]]
    names: list[str]
    lengths: list[int]
    # mergekit 0.1.5 merges the head and final norm from the last slice's first
    # len(slices[0].sources) sources only: the positions left out there (weight 0 on those tensors)
    head_dropped: tuple[str, ...] = ()


def _layer_range(value: Any, key: str, source: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and 0 <= value[0] < value[1]):
        raise _fail(source, key, f"must be [start, end], 0 <= start < end, got {short_repr(value)}")
    return value[0], value[1]


def method_defaults(method: str) -> dict[str, Any]:
    """The method's parameter defaults by params.yaml name (None defaults left out: they mean unset)."""
    fields = get_method(method).params.model_fields
    return {f.alias or k: f.get_default(call_default_factory=True) for k, f in fields.items()
            if not f.is_required() and f.get_default(call_default_factory=True) is not None}


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
    most = max(counts)
    if data.get("merge_method") not in _ZERO_NEUTRAL:
        for i, n in enumerate(counts):
            if n != counts[0]:
                raise _fail(source, f"slices[{i}].sources", f"merges {n} model(s) besides its base, slices[0] "
                                                            f"{counts[0]}; slices merging different numbers of "
                                                            f"models are built for {', '.join(sorted(_ZERO_NEUTRAL))}"
                                                            f", not {data.get('merge_method')}")
    positions: list[list[dict[str, Any]]] = [[] for _ in range(most + 1)]
    filled: list[tuple[int, int]] = []  # (position, slice)
    for i, (params, by_path, _) in enumerate(converted):
        models = [params["base"], *(e["path"] for e in params["experts"])]
        for k, path in enumerate(models + [params["base"]] * (most + 1 - len(models))):
            model, lr = next(v for p, v in by_path.items() if _same_model(p, path))
            positions[k].append({"model": model, "layer_range": list(lr)})
            if k >= len(models):
                filled.append((k, i))
    taken = {BASE}
    names = [_position_name([s["model"] for i, s in enumerate(pos) if (k, i) not in filled], taken)
             for k, pos in enumerate(positions[1:], start=1)]
    last, (_, last_sources, _) = converted[-1][0], converted[-1]
    kept = list(last_sources)[:len(slices[0]["sources"])]  # sources in their written order
    last_models = [last["base"], *(e["path"] for e in last["experts"])]
    dropped = [k for k, path in enumerate(last_models) if not any(_same_model(path, p) for p in kept)]
    if 0 in dropped:
        raise _fail(source, f"slices[{len(slices) - 1}].sources", "mergekit 0.1.5 merges the head from this "
                                                                 f"slice's first {len(kept)} source(s), which leave "
                                                                 "out its base; list the base first")
    return SlicedRecipe({BASE: positions[0], **dict(zip(names, positions[1:]))}, [p for p, _, _ in converted],
                        names, [n for _, _, n in converted], tuple(names[k - 1] for k in dropped))


def _renames(slices: list[dict[str, Any]], source: str) -> tuple[list[list[tuple[str, str]]], set[str]]:
    """For one position's slices ([{model, layer_range}]): per slice, the (output name, source
    name) of every layer tensor; and every output name of the view."""
    pairs: list[list[tuple[str, str]]] = []
    names: set[str] = set()
    start = 0
    for i, sl in enumerate(slices):
        folder = resolve_model_ref(sl["model"], f"slices[{i}].sources.model", source)
        first, end = sl["layer_range"]
        own = []
        for name in open_checkpoint(folder).tensors:
            m = LAYER_RE.match(name)
            if m is None:
                names.add(name)
            elif first <= int(m.group(2)) < end:
                own.append((m.group(1) + str(start + int(m.group(2)) - first) + name[m.end(2):], name))
        pairs.append(own)
        names.update(out for out, _ in own)
        start += end - first
    return pairs, names


def _first_match(conditions, tensor: str) -> int | None:
    return next((i for i, (flt, _) in enumerate(conditions) if flt is None or flt == "*" or flt in tensor), None)


def _source_numbered(value: Any, pairs: list[tuple[str, str]], names: set[str], key: str, source: str) -> Any:
    """A per-input setting whose filters, evaluated on the output names of a slice (as params.yaml
    does), pick for every tensor the condition mergekit picks on the source's name: each tensor
    where the two differ gets a condition of its own full name first; a condition that then
    matches no output name is dropped (it applied nowhere).

    Raises:
        ConfigError: a tensor whose source name no condition matches while its output name does,
            or an output name inside another (its condition would reach that one too).
    """
    if not isinstance(value, list | dict) or not any(isinstance(c, dict) for c in
                                                      (value if isinstance(value, list) else [value])):
        return value
    conditions = parse_setting(value).conditions
    own = []
    for out, src in sorted(pairs):
        want, have = _first_match(conditions, src), _first_match(conditions, out)
        if want == have:
            continue
        if want is None:
            raise _fail(source, key, f"no filter matches source tensor {src!r} but one matches its output name "
                                     f"{out!r}; mergekit matches the source's name: add a catch-all {{value: ...}}")
        if any(out in n for n in names if n != out):
            raise _fail(source, key, f"the filters pick another condition for {src!r} than for its output name "
                                     f"{out!r}, which is inside another tensor's name; write filters without "
                                     "layer numbers")
        own.append({"filter": out, "value": _written(conditions[want][1])})
    if not own:
        return value
    kept = [{**({} if flt is None else {"filter": flt}), "value": _written(v)} for flt, v in conditions
            if flt is None or flt == "*" or any(flt in n for n in names)]
    return own + kept


def _written(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _on_source_names(sliced: SlicedRecipe, out_slices: list[dict[str, Any]], source: str) -> None:
    """Every slice's per-input settings (the experts' weight, density, gamma; linear's
    base_weight, the base's weight) made to pick what mergekit picks on the source's names."""
    for position, views in sliced.views.items():
        pairs, names = _renames(views, source)
        for i, sl in enumerate(out_slices):
            if position == BASE:
                if "base_weight" in sl["parameters"]:
                    sl["parameters"]["base_weight"] = _source_numbered(
                        sl["parameters"]["base_weight"], pairs[i], names, f"slices[{i}].base_model.weight", source)
                continue
            settings = sl["experts"][position]
            for k in _PER_INPUT:
                if k in settings:
                    settings[k] = _source_numbered(settings[k], pairs[i], names,
                                                   f"slices[{i}].sources ({position}).{k}", source)


def stacked_slice_parameters(data: dict[str, Any], source: str) -> list[dict[str, Any]] | None:
    """params.yaml's `slices:` for a passthrough stack whose slices or sources carry parameters
    (`scale`): each slice's parameters, its source's over the slice's over the global ones, as
    mergekit reads them (`scale` is per input: its filters pick what they pick on the source's
    tensor names); None when none carries any.

    Raises:
        ConfigError: a parameters entry that is not a mapping, or a setting mergekit refuses.
    """
    slices = data["slices"]
    if not any(sl.get("parameters") or sl["sources"][0].get("parameters") for sl in slices):
        return None
    views = [{"model": sl["sources"][0]["model"], "layer_range": list(sl["sources"][0]["layer_range"])}
             for sl in slices]
    pairs, names = _renames(views, source)
    out, start = [], 0
    for i, sl in enumerate(slices):
        key = f"slices[{i}].sources[0]"
        merged = _merged_parameters(sl.get("parameters"), data.get("parameters"), f"slices[{i}]", source)
        own = _merged_parameters(sl["sources"][0].get("parameters"), None, key, source)
        parameters = {k: _source_numbered(_with_fallback(own.get(k), merged.get(k)), pairs[i], names,
                                          f"{key}.parameters.{k}", source)
                      for k in sorted({*own, *merged}, key=str)}
        parameters.setdefault("scale", 1.0)  # unset, mergekit copies the tensor (never another slice's scale)
        n = views[i]["layer_range"][1] - views[i]["layer_range"][0]
        out.append({"layers": [start, start + n], "parameters": parameters})
        start += n
    return out


def sliced_params(data: dict[str, Any], source: str, paths: ModelPaths | None, views_dir: str, *,
                  output_dir: str, recipe: str | None) -> dict[str, Any]:
    """The params dict merging the views in `views_dir` (as params.yaml names it): slice 0's
    settings on top, every slice's under `slices:`; `output_dir` and `recipe` as in
    mergekit_to_params."""
    sliced = sliced_recipe(data, source, paths)
    first = sliced.slices[0]
    firsts = [*first["experts"], *[{"weight": 0.0}] * (len(sliced.names) - len(first["experts"]))]
    experts = [{**e, "name": name, "path": f"{views_dir}/{name}"} for name, e in zip(sliced.names, firsts)]
    out_slices, start = [], 0
    # the top-level settings are slice 0's, and a slice's win over them only where given, so each
    # slice gives in full every parameter slice 0 does: its own value, else the method's default
    defaults, top_keys = method_defaults(first["method"]), set(first["parameters"])
    for i, (params, n) in enumerate(zip(sliced.slices, sliced.lengths)):
        params = {**params, "parameters": {**{k: defaults[k] for k in top_keys - set(params["parameters"])
                                               if k in defaults}, **params["parameters"]}}
        # each knob given in full: the top-level experts' values are slice 0's, never another slice's
        knobs = {k: params["parameters"][k] for k in ("density", "gamma") if k in params["parameters"]}
        own = [*params["experts"], *[{"weight": 0.0}] * (len(sliced.names) - len(params["experts"]))]
        settings = {name: {**knobs, **{k: e[k] for k in ("weight", "density", "gamma") if k in e}}
                    for name, e in zip(sliced.names, own)}
        for name, top in zip(sliced.names, firsts):  # slice 0's own knob is no other slice's fallback
            settings[name].update({k: defaults[k] for k in ("density", "gamma")
                                   if k in top and k not in settings[name] and k in defaults})
        out_slices.append({"layers": [start, start + n], "parameters": dict(params["parameters"]),
                           "experts": settings})
        start += n
    _on_source_names(sliced, out_slices, source)
    if sliced.head_dropped:
        post = sorted(n for n in _renames(sliced.views[BASE], source)[1]
                      if not LAYER_RE.match(n) and not PRE_WEIGHT_RE.search(n))
        for name in sliced.head_dropped:
            settings = out_slices[-1]["experts"][name]
            weight = settings.get("weight", 1.0)
            weight = [weight] if isinstance(weight, dict) else weight
            settings["weight"] = [*({"filter": n, "value": 0.0} for n in post),
                                  *(weight if isinstance(weight, list) and weight and isinstance(weight[0], dict)
                                    else [{"value": weight}])]
    # the top-level settings (where a slice gives none) are slice 0's, as its tensors read them
    experts = [{**e, **{k: out_slices[0]["experts"][e["name"]][k] for k in _PER_INPUT if k in e}} for e in experts]
    parameters = {**first["parameters"], **{k: v for k, v in out_slices[0]["parameters"].items() if k == "base_weight"}}
    output = {**first["output"], "dir": output_dir, **({} if recipe is None else {"mergekit_config": recipe})}
    return {**first, "base": f"{views_dir}/{BASE}", "experts": experts, "parameters": parameters, "output": output,
            "slices": out_slices}
