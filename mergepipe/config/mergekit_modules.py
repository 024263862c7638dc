"""mergekit `modules:` recipes as params.yaml (`modules:`, config/modules.py), and the module
facts they need: which modules mergekit 0.1.5 defines for each architecture, and which tensors
each holds, by tensor-name prefix (docs/design.md, "Modules").

mergekit 0.1.5 merges each module of `modules: {NAME: {models | slices, parameters}}` with the
one top-level merge_method and base_model, each parameter from the first scope that gives it:
the module's model entry, the module's `parameters`, the top-level ones; gradients over the
module's own layers. A module the recipe leaves out is not written at all, and a module's own
`merge_method` is ignored (its OutputModuleDefinition has no such field).

Here each module is converted as mergekit's `models:` form of its own (config/mergekit.py, so
every method's base and weight rules carry over); every module merges onto one base, the models
of all modules become the experts, and each module's parameters and per-model settings become
that module's params.yaml settings. A model a module leaves out has weight 0 there, which only
methods linear in the weights reproduce exactly (`_zero_is_absent`). Other shapes are refused
in one line naming the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mergepipe.config.hf_cache import hub_snapshot, looks_like_hub_id
from mergepipe.config.mergekit import (ModelPaths, _expert_name, _fail, _model_layers, _model_ref, _same_model,
                                       mergekit_to_params)
from mergepipe.config.mergekit_slices import _merged_parameters, method_defaults
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS, get_method
from mergepipe.units import short_repr

DEFAULT = "default"  # mergekit's one module of an architecture without modules


@dataclass(frozen=True, slots=True)
class ModuleFacts:
    """One module: the tensor-name prefixes of its tensors (the longest match wins); its layer
    count, a fixed number or the first of these config.json keys a model has (dotted: in a
    sub-config); whether mergekit evaluates its gradients at the positions `layer_positions`
    gives (False: it repeats fixed tensor names over a fixed layer count, so a gradient there has
    no one value); `broken`: why mergekit 0.1.5 cannot merge it."""

    prefixes: tuple[str, ...]
    layers: int | tuple[str, ...]
    gradients: bool = True
    broken: str | None = None


_TEXT_LAYERS = ("text_config.num_hidden_layers",)
_VISION_LAYERS = ("vision_config.num_hidden_layers",)


def _qwen_vl(text_layers: tuple[str, ...]) -> dict[str, ModuleFacts]:
    # mergekit's text decoder is these tensors, not all of model.: model.visual.* (the names transformers >= 4.52
    # gives the vision tower in memory) would be a text tensor, and is in no module
    return {"text_decoder": ModuleFacts(("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head."),
                                        text_layers),
            "vision_tower": ModuleFacts(("visual.",), ("vision_config.depth",)),
            "multi_modal_projector": ModuleFacts(("visual.merger.",), 2, gradients=False)}


def _prefixed(vision: str, vision_name: str = "vision_tower") -> dict[str, ModuleFacts]:
    return {"text_decoder": ModuleFacts(("language_model.",), _TEXT_LAYERS),
            vision_name: ModuleFacts((vision,), _VISION_LAYERS),
            "multi_modal_projector": ModuleFacts(("multi_modal_projector.",), 0)}


_QWEN3_VL = {"text_decoder": ModuleFacts(("model.language_model.", "lm_head."), _TEXT_LAYERS),
             "vision_tower": ModuleFacts(("model.visual.",), ("vision_config.depth",)),
             "multi_modal_projector": ModuleFacts(("model.visual.merger.", "model.visual.deepstack_merger_list."), 3,
                                                  gradients=False)}

# config.json `architectures[0]` -> its modules, as mergekit 0.1.5 defines them.
ARCHITECTURES: dict[str, dict[str, ModuleFacts]] = {
    "Qwen2VLForConditionalGeneration": _qwen_vl(("num_hidden_layers", "text_config.num_hidden_layers")),
    "Qwen2_5_VLForConditionalGeneration": _qwen_vl(_TEXT_LAYERS),
    "Qwen3VLForConditionalGeneration": _QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": _QWEN3_VL,
    "Gemma3ForConditionalGeneration": _prefixed("vision_tower.vision_model."),
    "Mistral3ForConditionalGeneration": _prefixed("vision_tower."),
    "Llama4ForConditionalGeneration": _prefixed("vision_model.", "vision_model"),
    "T5ForConditionalGeneration": {
        "encoder": ModuleFacts(("encoder.",), ("num_hidden_layers", "num_layers")),
        "decoder": ModuleFacts(("decoder.",), ("num_decoder_layers", "num_layers")),
        "shared": ModuleFacts(("shared.", "lm_head."), 0)},
    "WhisperForConditionalGeneration": {
        "encoder": ModuleFacts(("model.encoder.",), ("encoder_layers",)),
        "decoder": ModuleFacts(("model.decoder.",), ("decoder_layers",), broken=(
            "mergekit 0.1.5 names this module's tensors without a dot after its prefix (model.decoderlayers.0...), "
            "which no checkpoint has, and fails; merge the whole model with models:")),
    },
}

_MODULE_KEYS = ("models", "slices", "parameters")


def _model_config(ref: Any, key: str, source: str, paths: ModelPaths | None) -> tuple[str, dict[str, Any]]:
    """The config.json (its path, its mapping) of the model that `ref` names for mergekit."""
    _model_ref(ref, key, source, paths)  # its shape, LoRA and revision checked, naming the key
    if paths is None:
        raise _fail(source, "modules", "the models' architecture decides the modules: run `mergepipe "
                                       "import-mergekit CONFIG -o params.yaml` where the models are")
    folder = paths.local(ref)
    if folder is None and looks_like_hub_id(ref):
        try:
            folder = hub_snapshot(ref)
        except ConfigError as err:
            raise _fail(source, key, str(err)) from None
    if folder is None:
        raise _fail(source, key, f"{short_repr(ref)} is no model folder; its config.json names the architecture")
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise _fail(source, key, f"{path}: no readable config.json; it names the architecture") from None
    if not isinstance(config, dict):
        raise _fail(source, key, f"{path}: must be a JSON object")
    return str(path), config


def _architecture(data: dict[str, Any], modules: dict[str, Any], source: str, paths: ModelPaths | None) -> str:
    """architectures[0] of the config.json of the base model, else of the first module's first model."""
    ref, key = data.get("base_model"), "base_model"
    if ref is None:
        name, first = next(iter(modules.items()))
        first = first if isinstance(first, dict) else {}
        entries, key = first.get("models"), f"modules.{name}.models[0].model"
        if not entries and isinstance(first.get("slices"), list) and first["slices"] \
                and isinstance(first["slices"][0], dict):
            entries, key = first["slices"][0].get("sources"), f"modules.{name}.slices[0].sources[0].model"
        entry = entries[0] if isinstance(entries, list) and entries else None
        ref = entry.get("model") if isinstance(entry, dict) else entry
    path, config = _model_config(ref, key, source, paths)
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise _fail(source, key, f"{path} names no architecture (architectures[0]); the modules are those of "
                                 "the architecture")
    return archs[0]


def _module_layers(model: Any, facts: ModuleFacts | None, key: str, source: str,
                   paths: ModelPaths | None) -> int | None:
    """The layer count of a module of `model` (None: its config.json gives none)."""
    if facts is None:
        return _model_layers(model, paths) if paths is not None else None
    if isinstance(facts.layers, int):
        return facts.layers
    config = _model_config(model, key, source, paths)[1]
    for dotted in facts.layers:
        node: Any = config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, int) and not isinstance(node, bool):
            return node
    return None


def _slices_as_models(name: str, module: dict[str, Any], facts: ModuleFacts | None, source: str,
                      paths: ModelPaths | None) -> tuple[list[dict[str, Any]], Any]:
    """A module's `slices` that are its models form in disguise (one slice whose sources each
    cover every layer of the module): its models, and the slice's parameters."""
    key = f"modules.{name}.slices"
    slices = module["slices"]
    if module.get("models"):
        raise _fail(source, f"modules.{name}", "give models or slices, not both (mergekit refuses both)")
    if not isinstance(slices, list) or len(slices) != 1 or not isinstance(slices[0], dict) \
            or not isinstance(slices[0].get("sources"), list) or not slices[0]["sources"]:
        raise _fail(source, key, "several slices in a module are not built; give one slice over every layer of "
                                 "the module (a mapping with a non-empty sources list), or its models")
    extra = sorted(set(slices[0]) - {"sources", "parameters"}, key=str)
    if extra:
        raise _fail(source, f"{key}[0].{extra[0]}", "not built inside a module; expected sources, parameters")
    models = []
    for j, src in enumerate(slices[0]["sources"]):
        skey = f"{key}[0].sources[{j}]"
        if not isinstance(src, dict) or set(src) - {"model", "layer_range", "parameters"} or "model" not in src:
            raise _fail(source, skey, "must be a mapping of model, layer_range and parameters")
        lr = src.get("layer_range")
        if not (isinstance(lr, list | tuple) and len(lr) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in lr)):
            raise _fail(source, f"{skey}.layer_range", f"must be [start, end], got {short_repr(lr)}")
        n = _module_layers(src["model"], facts, f"{skey}.model", source, paths)
        if n is None:
            raise _fail(source, f"{skey}.layer_range", f"cannot check that {list(lr)} is every layer of {name}: "
                                                       f"{short_repr(src['model'])}'s config.json gives no count")
        if list(lr) != [0, n]:
            raise _fail(source, f"{skey}.layer_range", f"{list(lr)} is not every layer of {name} (it has {n}); "
                                                       "slices of part of a module are not built")
        models.append({"model": src["model"], **({"parameters": src["parameters"]} if src.get("parameters") else {})})
    return models, slices[0].get("parameters")


def _module_facts(data: dict[str, Any], modules: dict[str, Any], source: str,
                  paths: ModelPaths | None) -> dict[str, ModuleFacts] | None:
    """The architecture's modules, every one listed in the recipe; None: the one-module form
    (`default` of an architecture without modules, the `models:` form)."""
    arch = _architecture(data, modules, source, paths)
    facts = ARCHITECTURES.get(arch)
    if facts is None:
        if set(modules) == {DEFAULT}:
            return None
        name = next(n for n in modules if n != DEFAULT)
        raise _fail(source, f"modules.{name}", f"architecture {short_repr(arch)} has no modules mergepipe knows "
                                               f"(mergekit 0.1.5 defines modules for {', '.join(sorted(ARCHITECTURES))}"
                                               f"); a one-module model's only module is {DEFAULT}")
    for name in modules:
        if name not in facts:
            raise _fail(source, f"modules.{name}", f"architecture {arch} has no such module; its modules: "
                                                   f"{', '.join(facts)}")
        if facts[name].broken:
            raise _fail(source, f"modules.{name}", facts[name].broken)
    missing = [n for n in facts if n not in modules]
    if missing:
        raise _fail(source, "modules", f"leaves out {', '.join(missing)} of {arch}; mergekit 0.1.5 writes no tensor "
                                       "of a module left out (the output would not load): list every module")
    return facts


def _module_data(data: dict[str, Any], name: str, module: Any, facts: ModuleFacts | None, source: str,
                 paths: ModelPaths | None) -> dict[str, Any]:
    """Module `name` as a mergekit `models:` config of its own: parameters from its slice's (when
    given as one slice), then its own, then the top-level ones."""
    key = f"modules.{name}"
    if not isinstance(module, dict):
        raise _fail(source, key, f"must be a mapping of {', '.join(_MODULE_KEYS)}, got {short_repr(module)}")
    if "merge_method" in module:
        raise _fail(source, f"{key}.merge_method", "mergekit 0.1.5 merges every module with the top-level "
                                                   "merge_method (it ignores this key): remove it")
    extra = sorted(set(module) - set(_MODULE_KEYS), key=str)
    if extra:
        raise _fail(source, f"{key}.{extra[0]}", f"unknown module key; expected {', '.join(_MODULE_KEYS)}")
    parameters = module.get("parameters")
    if module.get("slices"):
        models, slice_parameters = _slices_as_models(name, module, facts, source, paths)
        parameters = _merged_parameters(slice_parameters, parameters, f"{key}.slices[0]", source)
    elif module.get("models"):
        models = module["models"]
    else:
        raise _fail(source, f"{key}.models", "required: the models (or one slice) this module merges")
    return {**{k: v for k, v in data.items() if k not in ("modules", "parameters")}, "models": models,
            "parameters": _merged_parameters(parameters, data.get("parameters"), key, source)}


def _has_gradient(value: Any) -> bool:
    """Whether a converted setting (config/mergekit.py `_setting`) varies over the layers."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return False
    if not any(isinstance(c, dict) for c in value):
        return len(value) > 1
    return any(isinstance(c.get("value"), list) for c in value if isinstance(c, dict))


def _check_gradients(name: str, facts: ModuleFacts, params: dict[str, Any], source: str) -> None:
    if facts.gradients:
        return
    given = {f"parameters.{k}": v for k, v in params["parameters"].items()}
    given.update({f"{e['name']}.{k}": e[k] for e in params["experts"] for k in ("weight", "density", "gamma")
                  if k in e})
    for key, value in given.items():
        if _has_gradient(value):
            raise _fail(source, f"modules.{name}", f"{key} is a gradient; mergekit 0.1.5 evaluates this module's "
                                                   "tensors at layer positions of its own (it repeats them over a "
                                                   "fixed layer count), so it has no one value: give one")


def _ref(expert: dict[str, Any]) -> str:
    return expert["path"] if "path" in expert else expert["adapter"]


def _zero_is_absent(method: str, parameters: dict[str, Any], experts: list[dict[str, Any]]) -> str | None:
    """None where a model left out of a module merges there as it would with weight 0 (the
    method's output is W0 + sum_k c_k delta_k with c_k = 0 for a zero weight and the others
    unchanged, by its own `delta_coefficients` at the module's parameters); else why not."""
    coefficients = get_method(method).delta_coefficients
    linear = sorted(n for n, m in METHODS.items() if m.delta_coefficients and m.max_experts != 1)
    if coefficients is None:
        return f"only methods linear in the weights ({', '.join(linear)}) can leave a model out of one module"
    scalars = {k: v for k, v in parameters.items() if not isinstance(v, list | dict)}
    weights = {e["name"]: e["weight"] if isinstance(e.get("weight"), int | float) else 1.0 for e in experts}
    try:
        without = coefficients(scalars, weights)
        with_zero = coefficients(scalars, {**weights, "\0absent": 0.0})
    except ValueError as err:
        return str(err)
    if with_zero.pop("\0absent") != 0 or with_zero != without:
        return f"{method} at these parameters is not the same with a weight-0 model as without it"
    return None


def _modules_section(converted: dict[str, dict[str, Any]], facts: dict[str, ModuleFacts],
                     names: dict[str, str]) -> dict[str, Any]:
    """params.yaml's `modules:`. The top-level settings are the first module's, and a module's
    settings win over them only where given, so every module gives in full each parameter and
    expert knob that the top level does: its own value, else the method's default; a model a
    module leaves out has weight 0 there."""
    first = next(iter(converted.values()))
    defaults = method_defaults(first["method"])
    top_keys = set(first["parameters"])
    top_knobs = {k for e in first["experts"] for k in ("density", "gamma") if k in e} | \
        {k for k in ("density", "gamma") if k in first["parameters"]}
    out = {}
    for name, params in converted.items():
        parameters = {**{k: defaults[k] for k in top_keys - set(params["parameters"]) if k in defaults},
                      **params["parameters"]}
        knobs = {k: parameters.get(k, defaults.get(k)) for k in top_knobs | ({"density", "gamma"} & set(parameters))}
        experts = {names[_ref(e)]: {**{k: v for k, v in knobs.items() if v is not None},
                                    **{k: e[k] for k in ("weight", "density", "gamma") if k in e}}
                   for e in params["experts"]}
        experts.update({n: {"weight": 0.0} for n in names.values() if n not in experts})
        out[name] = {"prefixes": list(facts[name].prefixes), "parameters": parameters,
                     "experts": dict(sorted(experts.items()))}
    return out


def _all_experts(converted: dict[str, dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The experts of every module, in order of first appearance, named anew (the first module's
    keep their names); a module leaving one out is checked by `_zero_is_absent`.

    Raises:
        ConfigError: modules on different bases, or leaving a model out where that is not weight 0.
    """
    first = next(iter(converted.values()))
    experts = [dict(e) for e in first["experts"]]
    taken = {"base", *(e["name"].lower() for e in experts)}  # "base": the plan's name for the base
    for params in converted.values():
        for e in params["experts"]:
            if all(_ref(e) != _ref(x) for x in experts):
                experts.append({**{k: v for k, v in e.items() if k in ("path", "adapter")},
                                "name": _expert_name(_ref(e), taken), "weight": 0.0})
    for name, params in converted.items():
        if params["base"] != first["base"]:
            raise _fail(source, f"modules.{name}.models", f"merges on {short_repr(params['base'])}, the first module "
                                                          f"on {short_repr(first['base'])}; every module merges onto "
                                                          "one base")
        left_out = [_ref(x) for x in experts if all(_ref(e) != _ref(x) for e in params["experts"])]
        why = _zero_is_absent(params["method"], params["parameters"], params["experts"]) if left_out else None
        if why is not None:
            raise _fail(source, f"modules.{name}.models", f"leaves out {short_repr(left_out)}, which other modules "
                                                          f"merge: {why}")
    return experts


def _model_refs(sub: dict[str, Any]) -> list[Any]:
    return [m.get("model") if isinstance(m, dict) else m for m in sub["models"]]


def _convert_module(name: str, sub: dict[str, Any], subs: dict[str, dict[str, Any]], source: str,
                    paths: ModelPaths | None, *, output_dir: str, recipe: str | None) -> dict[str, Any]:
    """A module's models form as a params dict. A module that lists only the base model (mergekit
    merges the base alone there) is converted with another module's model at weight 0, which is
    then taken out again: it is left out there, as `_all_experts` checks."""
    filler = None
    if sub.get("base_model") is not None:
        base = _model_ref(sub["base_model"], "base_model", source, paths)
        key = f"modules.{name}.models"
        if all(isinstance(r, str) and _same_model(_model_ref(r, key, source, paths), base) for r in _model_refs(sub)):
            others = [r for other in subs.values() for r in _model_refs(other) if isinstance(r, str) and "+" not in r
                      and not _same_model(_model_ref(r, "modules", source, paths), base)]
            filler = others[0] if others else None  # none: every module lists only the base, refused below
    if filler is not None:
        sub = {**sub, "models": [*sub["models"], {"model": filler, "parameters": {"weight": 0.0}}]}
    params = mergekit_to_params(sub, source=f"{source}: modules.{name}", output_dir=output_dir, paths=paths,
                                recipe=recipe)
    if filler is not None:
        written = _model_ref(filler, "modules", source, paths)
        params = {**params, "experts": [e for e in params["experts"] if not _same_model(_ref(e), written)]}
    return params


def modules_params(data: dict[str, Any], source: str, paths: ModelPaths | None, *, output_dir: str,
                   recipe: str | None) -> dict[str, Any]:
    """The params dict of a `modules:` recipe (see the module docstring): the first module's
    settings on top, every module's under `modules:`; `output_dir` and `recipe` as in
    mergekit_to_params.

    Raises:
        ConfigError: an architecture mergepipe knows no modules of, a module it lacks or that is
            left out, modules on different bases or leaving a model out where weight 0 is not
            the same, a key mergekit ignores, naming the key.
    """
    modules = data["modules"]
    if not isinstance(modules, dict) or not all(isinstance(k, str) for k in modules):
        raise _fail(source, "modules", f"must be a mapping of module name to {{models, parameters}}, got "
                                       f"{short_repr(modules)}")
    for key in ("models", "slices"):
        if data.get(key):
            raise _fail(source, key, "give one of models, slices or modules (mergekit refuses several)")
    for key in ("tokenizer", "tokenizer_source"):
        if data.get(key) not in (None, "base"):
            raise _fail(source, key, "a vocabulary other than the base's (union, a model's, tokens, padding) is "
                                     "not built with modules: remove it or merge without modules")
    if data.get("tokenizer_source") == "base":  # the base's vocabulary, every model's the same (not rebuilt)
        data = {k: v for k, v in data.items() if k != "tokenizer_source"}
    facts = _module_facts(data, modules, source, paths)
    subs = {name: _module_data(data, name, m, facts and facts[name], source, paths) for name, m in modules.items()}
    converted = {name: _convert_module(name, sub, subs, source, paths, output_dir=output_dir, recipe=recipe)
                 for name, sub in subs.items()}
    first = next(iter(converted.values()))
    if facts is None:
        return first
    experts = _all_experts(converted, source)
    for name, params in converted.items():
        _check_gradients(name, facts[name], params, source)
    section = _modules_section(converted, facts, {_ref(e): e["name"] for e in experts})
    return {**first, "experts": experts, "modules": section}
