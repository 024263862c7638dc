"""mergekit `modules:` recipes as params.yaml (`modules:`, config/modules.py), and the module
facts they need: which modules mergekit 0.1.5 defines for each architecture, and which tensors
each holds, by tensor-name prefix (docs/design.md, "Modules").

mergekit 0.1.5 merges each module of `modules: {NAME: {models | slices, parameters}}` with the
one top-level merge_method and base_model, each parameter from the first scope that gives it:
the module's model entry, the module's `parameters`, the top-level ones; gradients over the
module's own layers. A module the recipe leaves out is not written at all, and a module's own
`merge_method` is ignored (its OutputModuleDefinition has no such field).

Here each module is converted as mergekit's `models:` form of its own (config/mergekit.py, so
every method's base and weight rules carry over); every module must then merge the same models,
which become the experts, and each module's parameters and per-model settings become that
module's params.yaml settings. Other shapes are refused in one line naming the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mergepipe.config.hf_cache import hub_snapshot, looks_like_hub_id
from mergepipe.config.mergekit import ModelPaths, _fail, _model_ref, mergekit_to_params
from mergepipe.config.mergekit_slices import _merged_parameters
from mergepipe.errors import ConfigError
from mergepipe.methods import get_method
from mergepipe.units import short_repr

DEFAULT = "default"  # mergekit's one module of an architecture without modules


@dataclass(frozen=True, slots=True)
class ModuleFacts:
    """One module: the tensor-name prefixes of its tensors (the longest match wins), and
    whether mergekit evaluates its gradients at the positions `layer_positions` gives (False:
    it repeats fixed tensor names over a fixed layer count, so a gradient there has no one
    value); `broken`: why mergekit 0.1.5 cannot merge it."""

    prefixes: tuple[str, ...]
    gradients: bool = True
    broken: str | None = None


_TEXT = ModuleFacts(("model.", "lm_head."))
_QWEN_VL = {"text_decoder": _TEXT, "vision_tower": ModuleFacts(("visual.",)),
            "multi_modal_projector": ModuleFacts(("visual.merger.",), gradients=False)}
_QWEN3_VL = {"text_decoder": ModuleFacts(("model.language_model.", "lm_head.")),
             "vision_tower": ModuleFacts(("model.visual.",)),
             "multi_modal_projector": ModuleFacts(("model.visual.merger.", "model.visual.deepstack_merger_list."),
                                                  gradients=False)}
_SEQ2SEQ = {"encoder": ModuleFacts(("encoder.",)), "decoder": ModuleFacts(("decoder.",)),
            "shared": ModuleFacts(("shared.", "lm_head."))}


def _prefixed(vision: str) -> dict[str, ModuleFacts]:
    return {"text_decoder": ModuleFacts(("language_model.",)), "vision_tower": ModuleFacts((vision,)),
            "multi_modal_projector": ModuleFacts(("multi_modal_projector.",))}


# config.json `architectures[0]` -> its modules, as mergekit 0.1.5 defines them.
ARCHITECTURES: dict[str, dict[str, ModuleFacts]] = {
    "Qwen2VLForConditionalGeneration": _QWEN_VL,
    "Qwen2_5_VLForConditionalGeneration": _QWEN_VL,
    "Qwen3VLForConditionalGeneration": _QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": _QWEN3_VL,
    "Gemma3ForConditionalGeneration": _prefixed("vision_tower.vision_model."),
    "Mistral3ForConditionalGeneration": _prefixed("vision_tower."),
    "Llama4ForConditionalGeneration": _prefixed("vision_model."),
    "T5ForConditionalGeneration": _SEQ2SEQ,
    "WhisperForConditionalGeneration": {
        "encoder": ModuleFacts(("model.encoder.",)),
        "decoder": ModuleFacts(("model.decoder.",), broken=(
            "mergekit 0.1.5 names this module's tensors without a dot after its prefix (model.decoderlayers.0...), "
            "which no checkpoint has, and fails; merge the whole model with models:")),
    },
}

_MODULE_KEYS = ("models", "slices", "parameters")


def _architecture(data: dict[str, Any], modules: dict[str, Any], source: str, paths: ModelPaths | None) -> str:
    """architectures[0] of the config.json of the base model, else of the first module's first model."""
    ref, key = data.get("base_model"), "base_model"
    if ref is None:
        name, first = next(iter(modules.items()))
        entries = first.get("models") if isinstance(first, dict) else None
        entry = entries[0] if isinstance(entries, list) and entries else None
        ref = entry.get("model") if isinstance(entry, dict) else entry
        key = f"modules.{name}.models[0].model"
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
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        arch = config["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise _fail(source, key, f"{folder / 'config.json'} names no architecture (architectures[0]); "
                                 "the modules are those of the architecture") from None
    if not isinstance(arch, str):
        raise _fail(source, key, f"{folder / 'config.json'}: architectures[0] must be a string, got "
                                 f"{short_repr(arch)}")
    return arch


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


def _module_data(data: dict[str, Any], name: str, module: Any, source: str) -> dict[str, Any]:
    """Module `name` as a mergekit `models:` config of its own (its parameters over the top-level ones)."""
    key = f"modules.{name}"
    if not isinstance(module, dict):
        raise _fail(source, key, f"must be a mapping of {', '.join(_MODULE_KEYS)}, got {short_repr(module)}")
    if "merge_method" in module:
        raise _fail(source, f"{key}.merge_method", "mergekit 0.1.5 merges every module with the top-level "
                                                   "merge_method (it ignores this key): remove it")
    extra = sorted(set(module) - set(_MODULE_KEYS), key=str)
    if extra:
        raise _fail(source, f"{key}.{extra[0]}", f"unknown module key; expected {', '.join(_MODULE_KEYS)}")
    if module.get("slices"):
        raise _fail(source, f"{key}.slices", "slices inside a module are not built; give the module's models")
    if not module.get("models"):
        raise _fail(source, f"{key}.models", "required: the models this module merges")
    return {**{k: v for k, v in data.items() if k not in ("modules", "parameters")}, "models": module["models"],
            "parameters": _merged_parameters(module.get("parameters"), data.get("parameters"), key, source)}


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


def _defaults(method: str) -> dict[str, Any]:
    """The method's parameter defaults by params.yaml name (None defaults left out: they mean unset)."""
    fields = get_method(method).params.model_fields
    return {f.alias or k: f.get_default(call_default_factory=True) for k, f in fields.items()
            if not f.is_required() and f.get_default(call_default_factory=True) is not None}


def _modules_section(converted: dict[str, dict[str, Any]], facts: dict[str, ModuleFacts],
                     name_of: dict[str, str]) -> dict[str, Any]:
    """params.yaml's `modules:`. The top-level settings are the first module's, and a module's
    settings win over them only where given, so every module gives in full each parameter and
    expert knob that the top level does: its own value, else the method's default."""
    first = next(iter(converted.values()))
    defaults = _defaults(first["method"])
    top_keys = set(first["parameters"])
    top_knobs = {k for e in first["experts"] for k in ("density", "gamma") if k in e} | \
        {k for k in ("density", "gamma") if k in first["parameters"]}
    out = {}
    for name, params in converted.items():
        parameters = {**{k: defaults[k] for k in top_keys - set(params["parameters"]) if k in defaults},
                      **params["parameters"]}
        knobs = {k: parameters.get(k, defaults.get(k)) for k in top_knobs | ({"density", "gamma"} & set(parameters))}
        experts = {name_of[e["path"]]: {**{k: v for k, v in knobs.items() if v is not None},
                                        **{k: e[k] for k in ("weight", "density", "gamma") if k in e}}
                   for e in params["experts"]}
        out[name] = {"prefixes": list(facts[name].prefixes), "parameters": parameters, "experts": experts}
    return out


def modules_params(data: dict[str, Any], source: str, paths: ModelPaths | None, *, output_dir: str,
                   recipe: str | None) -> dict[str, Any]:
    """The params dict of a `modules:` recipe (see the module docstring): the first module's
    settings on top, every module's under `modules:`; `output_dir` and `recipe` as in
    mergekit_to_params.

    Raises:
        ConfigError: an architecture mergepipe knows no modules of, a module it lacks or that is
            left out, modules merging different models, a key mergekit ignores, naming the key.
    """
    modules = data["modules"]
    if not isinstance(modules, dict) or not all(isinstance(k, str) for k in modules):
        raise _fail(source, "modules", f"must be a mapping of module name to {{models, parameters}}, got "
                                       f"{short_repr(modules)}")
    for key in ("models", "slices"):
        if data.get(key):
            raise _fail(source, key, "give one of models, slices or modules (mergekit refuses several)")
    facts = _module_facts(data, modules, source, paths)
    converted = {name: mergekit_to_params(_module_data(data, name, m, source), source=f"{source}: modules.{name}",
                                          output_dir=output_dir, paths=paths, recipe=recipe)
                 for name, m in modules.items()}
    first = next(iter(converted.values()))
    if facts is None:
        return first
    paths_of = {e["path"]: e["name"] for e in first["experts"]}
    for name, params in converted.items():
        if params["base"] != first["base"] or {e["path"] for e in params["experts"]} != set(paths_of):
            theirs = sorted(e["path"] for e in params["experts"])
            raise _fail(source, f"modules.{name}.models",
                        f"merges {short_repr(theirs)} on {short_repr(params['base'])}, the first module "
                        f"{short_repr(sorted(paths_of))} on {short_repr(first['base'])}; modules merging different "
                        "models are not built")
        _check_gradients(name, facts[name], params, source)
    return {**first, "modules": _modules_section(converted, facts, paths_of)}
