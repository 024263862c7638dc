"""What a mergekit 0.1.5 recipe says that mergekit never reads, dropped before import converts it.

mergekit accepts two things that have no effect on its merge:
- a parameter its method does not read (`normalize` given to nuslerp; a per-model `t`): its
  method reads only the parameters of its spec (methods' registrations, `Mergekit.shared` and
  `Mergekit.per_input`), the shared ones from a slice's, a module's and the global scope, the
  per-input ones from a model's own scope too;
- a condition whose filter is in no tensor name it is evaluated on (`{filter: absent, value: 9}`):
  mergekit takes the first condition whose filter is in the name, so one in no name is never
  taken, and a scope none of whose conditions matches gives no value (the next scope does).
Dropping either leaves mergekit's merge as it is, so the import drops them, each with one
warning line, and converts the rest; a hand-written params.yaml keeps the typo guard (a filter
in no tensor name is refused, config/tensor_params.py).

Names a filter is matched against, as mergekit matches them: a model's own (per-input) settings
on that model's tensor names (in a slice, those of its layer range and the tensors outside the
layers); a shared setting on the output's names (slices: layers renumbered in order); a
per-input setting of a slice or the global scope on the names of the sources it reaches. A
model whose folder cannot be read leaves its filters as written (the conversion or the merge
names the folder). Reads headers only.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mergepipe.checkpoint.safetensors import open_checkpoint
from mergepipe.config.hf_cache import hub_snapshot, looks_like_hub_id
from mergepipe.config.settings import LAYER_RE
from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.methods import get_method
from mergepipe.methods.registry import mergekit_names

Names = frozenset[str] | None  # None: not known (a model that cannot be read); filters kept


class _Models:
    """Tensor names of the models a recipe names, read against mergekit's working directory."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self._names = cwd, {}

    def names(self, ref: Any) -> Names:
        if not isinstance(ref, str) or "@" in ref:
            return None
        ref = ref.split("+", 1)[0]  # a LoRA on a model has the model's tensor names
        if ref not in self._names:
            self._names[ref] = self._read(ref)
        return self._names[ref]

    def _read(self, ref: str) -> Names:
        folder = self.cwd / ref
        try:
            if not folder.is_dir() and looks_like_hub_id(ref):
                folder = hub_snapshot(ref)
            return frozenset(open_checkpoint(folder).tensors.names)
        except (ConfigError, CheckpointError, OSError):
            return None


def _union(sets: list[Names]) -> Names:
    return None if any(s is None for s in sets) else frozenset().union(*sets)


def _in_range(names: Names, layer_range: Any, start: int | None = None) -> Names:
    """The names of a slice's source (`layer_range`), its layers renumbered from `start` (None:
    the source's own numbers)."""
    if names is None or not (isinstance(layer_range, list | tuple) and len(layer_range) == 2
                             and all(isinstance(v, int) for v in layer_range)):
        return names
    out = set()
    for name in names:
        m = LAYER_RE.match(name)
        if m is None:
            out.add(name)
        elif layer_range[0] <= int(m.group(2)) < layer_range[1]:
            layer = int(m.group(2)) if start is None else start + int(m.group(2)) - layer_range[0]
            out.add(m.group(1) + str(layer) + name[m.end(2):])
    return frozenset(out)


class _Dropper:
    """Drops, in place, the ignored parameters and conditions of one recipe's scopes."""

    def __init__(self, mk_method: str, source: str) -> None:
        facts = get_method(mergekit_names()[mk_method]).mergekit
        self.method, self.source = mk_method, source
        self.shared, self.per_input = set(facts.shared), set(facts.per_input)
        self.warnings: list[str] = []

    def scope(self, params: Any, key: str, *, own: bool, output: Names, inputs: Names, what: str) -> None:
        """`params` (a scope's `parameters` mapping, at `key`): `own` a model's own scope (only
        per-input parameters are read there); shared settings matched on `output`, per-input ones
        on `inputs`, `what` naming them in the warnings."""
        if not isinstance(params, dict):
            return  # not a mapping: the conversion names it
        for name in list(params):
            where = f"{key}.{name}"
            if name not in self.per_input and (own or name not in self.shared):
                del params[name]
                how = "reads it from the slice and global parameters, never a model's" if name in self.shared \
                    else "does not read it"
                self._warn(f"{where}: mergekit 0.1.5's {self.method} {how}; mergekit ignores it, dropped")
                continue
            shared = name not in self.per_input
            kept = self._conditions(params[name], where, output if shared else inputs, "the output" if shared else what)
            if kept is None:
                del params[name]  # no condition left: this scope gives no value, as in mergekit
            else:
                params[name] = kept

    def _conditions(self, setting: Any, where: str, names: Names, what: str) -> Any:
        """`setting` without its conditions whose filter is in none of `names`; None if none is left."""
        conditions = [setting] if isinstance(setting, dict) else setting
        if names is None or not isinstance(conditions, list) or not any(isinstance(c, dict) for c in conditions):
            return setting
        kept = []
        for cond in conditions:
            flt = cond.get("filter") if isinstance(cond, dict) else None
            if isinstance(flt, str) and flt != "*" and not any(flt in n for n in names):
                self._warn(f"{where}: filter {flt!r} matches no tensor of {what}; mergekit ignores it, dropped")
                continue
            kept.append(cond)
        if len(kept) == len(conditions):
            return setting
        return kept or None

    def _warn(self, line: str) -> None:
        self.warnings.append(f"warning: {self.source}: {line}")


def without_ignored(data: Any, source: str, cwd: Path | None = None) -> tuple[Any, list[str]]:
    """`data` (a parsed mergekit recipe) without the parameters and conditions mergekit never
    reads, and one warning line for each dropped; `data` itself is not changed. A recipe of an
    unknown method or shape is returned as it is (the conversion names what is wrong)."""
    if not isinstance(data, dict) or not isinstance(data.get("merge_method"), str) \
            or data["merge_method"] not in mergekit_names():
        return data, []
    data = copy.deepcopy(data)
    dropper = _Dropper(data["merge_method"], source)
    models = _Models(Path.cwd() if cwd is None else cwd)
    if isinstance(data.get("modules"), dict) and data["modules"]:
        _modules(data, dropper, models)
    elif isinstance(data.get("slices"), list) and data["slices"]:
        _slices(data, dropper, models)
    else:
        _models(data, "models", "", data.get("parameters"), dropper, models)
    return data, dropper.warnings


def _entries(data: dict, key: str) -> list[tuple[int, dict]]:
    entries = data.get(key)
    return [(i, e) for i, e in enumerate(entries) if isinstance(e, dict)] if isinstance(entries, list) else []


def _models(data: dict, key: str, prefix: str, top: Any, dropper: _Dropper, models: _Models) -> None:
    """The `models:` form (at `prefix`): every setting matched on the models' names (one
    architecture: the output's names are the inputs')."""
    listed = [e.get("model") if isinstance(e, dict) else e for e in data.get(key) or []]
    everything = _union([models.names(m) for m in [data.get("base_model"), *listed] if m is not None])
    dropper.scope(top, f"{prefix}parameters", own=False, output=everything, inputs=everything,
                  what="the models")
    for i, entry in _entries(data, key):
        names = models.names(entry.get("model"))
        dropper.scope(entry.get("parameters"), f"{prefix}{key}[{i}].parameters", own=True, output=names,
                      inputs=names, what=str(entry.get("model")))


def _slices(data: dict, dropper: _Dropper, models: _Models, prefix: str = "",
            top: Callable[[Names, Names], None] | None = None) -> None:
    """`slices:`: a source's settings on its layer range's names, a shared setting on the
    output's names (the slices' layers in order), a per-input one on its sources' names."""
    slices = _entries(data, "slices")
    sources = {i: _entries(sl, "sources") for i, sl in slices}
    own: dict[tuple[int, int], Names] = {}
    output: list[Names] = []
    start = 0
    for i, _ in slices:
        length = 0
        for j, src in sources[i]:
            names, lr = models.names(src.get("model")), src.get("layer_range")
            own[i, j] = _in_range(names, lr)
            output.append(_in_range(names, lr, start))
            if isinstance(lr, list | tuple) and len(lr) == 2 and all(isinstance(v, int) for v in lr):
                length = lr[1] - lr[0]
        start += length
    out_names = _union(output)
    every_input = _union(list(own.values()))
    if top is None:
        dropper.scope(data.get("parameters"), "parameters", own=False, output=out_names, inputs=every_input,
                      what="the slices' sources")
    else:
        top(out_names, every_input)
    for i, sl in slices:
        key = f"{prefix}slices[{i}]"
        dropper.scope(sl.get("parameters"), f"{key}.parameters", own=False, output=out_names,
                      inputs=_union([own[i, j] for j, _ in sources[i]]), what=f"{key}'s sources")
        for j, src in sources[i]:
            dropper.scope(src.get("parameters"), f"{key}.sources[{j}].parameters", own=True, output=own[i, j],
                          inputs=own[i, j], what=f"{src.get('model')} (layers {src.get('layer_range')})")


def _modules(data: dict, dropper: _Dropper, models: _Models) -> None:
    """`modules:`: each module's models or slices as above, its parameters between theirs and
    the global ones (matched on every model's names: a module is a part of one architecture)."""
    modules = {m: d for m, d in data["modules"].items() if isinstance(d, dict)}
    refs = [data.get("base_model")]
    for module in modules.values():
        refs += [e.get("model") if isinstance(e, dict) else e for e in module.get("models") or []]
        refs += [s.get("model") for _, sl in _entries(module, "slices") for _, s in _entries(sl, "sources")]
    everything = _union([models.names(m) for m in refs if m is not None])
    dropper.scope(data.get("parameters"), "parameters", own=False, output=everything, inputs=everything,
                  what="the models")
    for name, module in modules.items():
        prefix = f"modules.{name}."
        if isinstance(module.get("slices"), list) and module["slices"]:
            def top(output: Names, inputs: Names, module=module, prefix=prefix) -> None:
                dropper.scope(module.get("parameters"), f"{prefix}parameters", own=False, output=output,
                              inputs=inputs, what=f"{prefix[:-1]}'s sources")
            _slices(module, dropper, models, prefix, top)
        else:
            _models({**module, "base_model": data.get("base_model")}, "models", prefix, module.get("parameters"),
                    dropper, models)
