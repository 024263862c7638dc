"""Layer stacking (mergekit `slices` with passthrough: frankenmerges) into a model folder.

`build_stack` writes an ordinary Hugging Face folder whose layers are the slices' layers in
order, renumbered from 0 (`<prefix>.layers.{i}.<rest>`, the layer naming of
config/settings.py); tensors outside the layers come from the first slice's model when they
are embeddings (a name part containing `embed`, `wte` or `wpe`: mergekit's pre-weights) and
from the last slice's otherwise (final norm, head: its post-weights). Bytes are copied file
to file (util/fs.copy_range, O(1) memory), dtypes kept; config.json is the first model's with
the layer count replaced, generation and tokenizer files are the first model's, and
`stack.json` records for every output tensor the model and tensor it came from (the output
of a merge of this folder keeps it, so the manifest hashes it). Built in a temporary folder
beside the target and renamed into place, every time (the sources may have changed since;
stack.json names them by path only, so that the same inputs give the same bytes anywhere) and
published as merges are (output/publish.py: locked, swapped in atomically, never through a
symbolic link); a previous stack there is replaced only while it holds only a stack's files,
each with the bytes the import wrote (their blake3 is in stack-sources.json); any other folder
is never replaced, even with `force` (a re-import needs it to rewrite params.yaml).

The folder goes stale when a source model changes after the import: `stack-sources.json`
(not copied into merges: machine-specific) records each source folder and the stat keys
(size, mtime_ns, ctime_ns, inode, device; links followed) of the files the stack was made
from, taken before they were read. `check_fresh` compares them whenever the folder is about
to be planned or merged and refuses a stale stack naming the changed file and the import
to rerun; run's no-op record keys the source folders too (cli._input_paths). It also compares
the folder's own files with what the import wrote (stat keys, then blake3 where they differ), so
weights or a config saved into the folder later are refused too, never merged as the recipe's.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mergepipe.checkpoint.safetensors import OutTensor, SafetensorsWriter, open_checkpoint
from mergepipe.config.settings import LAYER_RE
from mergepipe.config.slices import PRE_WEIGHT_RE
from mergepipe.errors import CheckpointError, ConfigError, IntegrityError, OutputError
from mergepipe.output.publish import Publisher
from mergepipe.util.fs import hash_file

STACK_FILE = "stack.json"
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _layers(names) -> dict[int, list[tuple[str, str]]]:
    """layer number -> [(tensor name, name with the number replaced by {})]."""
    out: dict[int, list[tuple[str, str]]] = {}
    for name in names:
        m = LAYER_RE.match(name)
        if m:
            out.setdefault(int(m.group(2)), []).append((name, m.group(1) + "{}" + name[m.end(2):]))
    return out


def stack_plan(slices: list[dict], roots: dict[str, Path]) -> tuple[list[tuple[str, str, str]], int]:
    """([(output tensor, model as written, source tensor)], layer count) for `slices`
    ([{model, layer_range: [start, end]}]); `roots` maps each model as written to its folder.

    Raises:
        ConfigError: a layer range outside a model, or layers whose tensors differ between slices.
    """
    ckpts = {m: open_checkpoint(roots[m]) for m in {s["model"] for s in slices}}
    first, last = ckpts[slices[0]["model"]], ckpts[slices[-1]["model"]]
    out: list[tuple[str, str, str]] = []
    for name in first.tensors:
        if not LAYER_RE.match(name) and PRE_WEIGHT_RE.search(name):
            out.append((name, slices[0]["model"], name))
    layer = 0
    template = None
    for i, s in enumerate(slices):
        layers = _layers(ckpts[s["model"]].tensors)
        start, end = s["layer_range"]
        if not 0 <= start < end <= len(layers) or any(k not in layers for k in range(start, end)):
            raise ConfigError(f"slices[{i}].layer_range: [{start}, {end}] is not inside {s['model']!r}'s "
                              f"{len(layers)} layers")
        for k in range(start, end):
            shapes = sorted((pattern, ckpts[s["model"]].tensors[name].shape) for name, pattern in layers[k])
            if template is None:
                template = shapes
            elif [p for p, _ in shapes] != [p for p, _ in template] or shapes != template:
                raise ConfigError(f"slices[{i}]: layer {k} of {s['model']!r} has other tensors or shapes than "
                                  "the first slice's layers; stacked layers must be alike")
            for name, pattern in sorted(layers[k], key=lambda x: x[1]):
                out.append((pattern.format(layer), s["model"], name))
            layer += 1
    for name in last.tensors:
        if not LAYER_RE.match(name) and not PRE_WEIGHT_RE.search(name):
            out.append((name, slices[-1]["model"], name))
    return out, layer


SOURCES_FILE = "stack-sources.json"


def _stat_key(path: Path) -> list[int]:
    st = os.stat(path)  # links followed: an HF-style blob's edit counts
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _source_files(root: Path) -> list[Path]:
    """The files of a source model a stack reads: its weights (and shard index), config.json
    and the generation/tokenizer files."""
    ckpt = open_checkpoint(root)
    files = {h.path for h in ckpt.files} | {root / n for n in ("config.json", "model.safetensors.index.json",
                                                               *COPIED) if (root / n).is_file()}
    return sorted(files)


def source_stats(roots: list[Path]) -> dict[str, dict[str, list[int]]]:
    """{source folder: {file: stat key}} (absolute paths)."""
    return {str(r.absolute()): {str(f.absolute()): _stat_key(f) for f in _source_files(r)} for r in roots}


def check_fresh(folder: str | Path) -> None:
    """Refuse a stacked folder whose source models, or whose own files, changed since it was
    built (see the module docstring); anything without a stack-sources.json (an ordinary model,
    a merge output) passes.

    Raises:
        IntegrityError: naming the changed file and the import to rerun.
    """
    record_path = Path(folder) / SOURCES_FILE
    if not record_path.is_file():
        return
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        sources, rerun = record["sources"], record["rerun"]
        recorded = {r: dict(files) for r, files in sources.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise IntegrityError(f"{record_path}: unreadable record of the stack's sources; rebuild the stacked "
                             "folder with `mergepipe import-mergekit ... --force`") from None
    for root, files in sorted(recorded.items()):
        try:
            now = source_stats([Path(root)])[str(Path(root).absolute())]
        except (OSError, CheckpointError) as e:
            now, why = None, str(e)
        if now != files:
            changed = next((f for f in sorted(set(files) | set(now or {})) if (now or {}).get(f) != files.get(f)), root)
            raise IntegrityError(f"{folder}: stale stacked model: its source {changed} changed (or is gone) since "
                                 f"it was built; rebuild it with `{rerun}`"
                                 + (f" ({why})" if now is None else ""))
    changed = _changed_own_file(Path(folder), record)
    if changed is not None:
        raise IntegrityError(f"{changed}: changed (or is gone) since the import wrote it; a stacked model is "
                             f"merged only as built: move your file elsewhere and rebuild it with `{rerun}`")


def stack_sources(folder: str | Path) -> list[Path]:
    """The source model folders a stacked folder records (none for any other folder)."""
    try:
        return [Path(r) for r in sorted(json.loads((Path(folder) / SOURCES_FILE).read_text())["sources"])]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def stacked_sources(models) -> tuple[tuple[Path, Path], ...]:
    """(source model, stacked input) for every source each of `models` records: a stacked input's
    models are inputs too, which an output may not overlap (output/safety.WriteInputs)."""
    return tuple((src, Path(m)) for m in models for src in stack_sources(m))


def _written_files(record: dict) -> dict[str, str]:
    """{file name: blake3} of what the import wrote into the folder (a record from before the
    config and copied files were hashed holds the weights' only)."""
    files = record.get("files")
    if files is None:
        files = {} if record.get("weights") is None else {"model.safetensors": record["weights"]}
    if not isinstance(files, dict):
        raise TypeError("files")
    return files


def _changed_own_file(folder: Path, record: dict) -> Path | None:
    """The first file the import wrote into `folder` whose bytes are not those it wrote (missing
    too); a file whose stat key is the recorded one is not reread. None when all are as written.

    Raises:
        IntegrityError: a record whose `files` or `stats` is not a mapping.
    """
    try:
        files, stats = _written_files(record), dict(record.get("stats") or {})
    except (TypeError, ValueError):
        raise IntegrityError(f"{folder / SOURCES_FILE}: unreadable record of the stack's files; rebuild the "
                             "stacked folder with `mergepipe import-mergekit ... --force`") from None
    for name, digest in sorted(files.items()):
        path = folder / name
        try:
            if path.is_symlink() or (stats.get(name) != _stat_key(path) and hash_file(path) != digest):
                return path
        except OSError:
            return path
    return None


def _check_replaceable_stack(target: Path) -> None:
    """A previous stack is replaced (even by a re-import's --force, which params.yaml needs) only
    while it holds only a stack's files, each with the bytes the import wrote (where it recorded their hash)."""
    allowed = {"model.safetensors", "config.json", STACK_FILE, SOURCES_FILE, *COPIED}
    extra = sorted(p.name for p in target.iterdir() if p.name not in allowed or not p.is_file() or p.is_symlink())
    if extra:
        raise OutputError(f"{target}: the stacked folder holds {extra[0]!r}, which the import did not write; "
                          "move it out or remove the folder to rebuild the stack")
    try:
        record = json.loads((target / SOURCES_FILE).read_text(encoding="utf-8"))
        files = _written_files(record)
    except (OSError, ValueError, AttributeError, TypeError):
        return  # no record of what was written: the names above are all a stack's
    for name, digest in sorted(files.items()):  # a fine-tune or an edit saved there, in place too
        path = target / name
        if path.is_file() and hash_file(path) != digest:
            raise OutputError(f"{path}: changed since the import wrote it (a fine-tune or an edit saved there?); "
                              "move it out or remove the folder to rebuild the stack")


def _check_replaceable(target: Path) -> None:
    """build_stack's refusals of what is at `target`, before anything is written."""
    if target.is_symlink():  # replacing it would write where it points, or delete it
        raise OutputError(f"{target}: is a symbolic link; a stacked folder is never written through one: "
                          "remove the link or choose another -o")
    if target.exists() and not (target / STACK_FILE).is_file():  # the user's: --force is for params.yaml
        raise OutputError(f"{target}: exists and is not a stacked model the import wrote; it is never replaced: "
                          "move it away or choose another -o")
    if (target / STACK_FILE).is_file():
        _check_replaceable_stack(target)


def _layer_types(slices: list[dict], roots: dict[str, Path], nested: str | None) -> list:
    """config.json's `layer_types` of the stack: each output layer's entry in its source model's.

    Raises:
        CheckpointError: a source model whose config.json has no entry for a stacked layer.
    """
    out = []
    for s in slices:
        path = roots[s["model"]] / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
            types = (config[nested] if nested else config)["layer_types"]
            out += [types[k] for k in range(*s["layer_range"])]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            raise CheckpointError(f"{path}: no layer_types entry for layers {list(s['layer_range'])}; the stack's "
                                  "config.json lists one per layer") from None
    return out


def build_stack(slices: list[dict], roots: dict[str, Path], target: Path, *,
                rerun: str = "mergepipe import-mergekit CONFIG -o PARAMS --force") -> Path:
    """Write the stacked model folder `target` (see the module docstring); returns it.

    Raises:
        ConfigError: bad layer ranges, a slice of `target` itself; CheckpointError: a model folder that cannot be read;
        OutputError: `target` exists and is not a previous stack holding only what the import wrote.
    """
    for i, s in enumerate(slices):  # replacing it would change the input of the next import
        if os.path.realpath(roots[s["model"]]) == os.path.realpath(target):
            raise ConfigError(f"slices[{i}].sources[0].model: {s['model']!r} is the stacked folder this import "
                              "builds; stack its source models instead")
    try:  # before anything is read: a source edited during the build reads as changed later
        stats = source_stats(sorted({roots[s["model"]] for s in slices}))
    except OSError as e:
        raise CheckpointError(f"{e.filename}: cannot stat a source model file: {e.strerror}") from None
    mapping, n_layers = stack_plan(slices, roots)
    record = {"slices": [{"model": s["model"], "layer_range": list(s["layer_range"])} for s in slices],
              "layers": n_layers, "sources": {o: [m, src] for o, m, src in mapping}}
    _check_replaceable(target)
    first_root = roots[slices[0]["model"]]
    config = _stacked_config(slices, roots, n_layers)
    # published like a merge (output/publish.py): a lock against a concurrent import of the
    # same config, an atomic swap of the previous stack, never through a symbolic link
    publisher = Publisher(target, force=True)  # (a previous stack as written: checked above)
    with publisher as tmp:
        _write_weights(tmp / "model.safetensors", slices, roots, mapping)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in COPIED:
            if (first_root / name).is_file():
                shutil.copyfile(first_root / name, tmp / name)
        (tmp / STACK_FILE).write_text(json.dumps(record, sort_keys=True, indent=1) + "\n")
        # the files' own stat keys survive the folder's rename: check_fresh rehashes only what changed
        written = sorted(p.name for p in tmp.iterdir())
        sources = {"sources": stats, "rerun": rerun, "files": {n: hash_file(tmp / n) for n in written},
                   "stats": {n: _stat_key(tmp / n) for n in written}}
        (tmp / SOURCES_FILE).write_text(json.dumps(sources, sort_keys=True, indent=1) + "\n")
        publisher.commit()
    return target


def _stacked_config(slices: list[dict], roots: dict[str, Path], n_layers: int) -> dict:
    """The first slice's model config with every layer count (and `layer_types`) of the stack."""
    first_root = roots[slices[0]["model"]]
    try:
        config = json.loads((first_root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{first_root / 'config.json'}: cannot read the model config: {e}") from None
    node = config.get("text_config") if isinstance(config.get("text_config"), dict) and \
        not any(k in config for k in LAYER_KEYS) else config
    keys = [k for k in LAYER_KEYS if k in node]
    if not keys:
        raise CheckpointError(f"{first_root / 'config.json'}: no layer count ({', '.join(LAYER_KEYS)})")
    for k in keys:
        node[k] = n_layers
    if isinstance(node.get("layer_types"), list):  # one entry per output layer: its source layer's
        node["layer_types"] = _layer_types(slices, roots, "text_config" if node is not config else None)
    return config


def _write_weights(path: Path, slices: list[dict], roots: dict[str, Path], mapping) -> None:
    """Every output tensor's bytes copied from its source tensor, in the stack's order."""
    ckpts = {m: open_checkpoint(roots[m]) for m in {s["model"] for s in slices}}
    infos = [(o, ckpts[m].tensors[src]) for o, m, src in mapping]
    writer = SafetensorsWriter(path, [OutTensor(o, t.dtype, t.shape) for o, t in infos], metadata={"format": "pt"})
    fds: dict[Path, int] = {}
    try:
        for o, t in infos:
            if t.file not in fds:
                fds[t.file] = os.open(t.file, os.O_RDONLY)
            if t.end > t.begin:
                writer.copy_rows(o, 0, fds[t.file], t.begin, t.end - t.begin)
        writer.close()
    finally:
        writer.abort()
        for fd in fds.values():
            os.close(fd)


def slice_views(config: str, params_file: Path) -> tuple[dict[str, list[dict]], dict[str, Path]] | None:
    """The stacked views a mergekit config whose slices merge needs (config/mergekit_slices.py):
    ({position: its slices}, {model as written: folder}); None for any other config.

    Raises:
        ConfigError: a slice mergekit refuses or that is not built, naming the key.
    """
    from mergepipe.config.mergekit import ModelPaths, merges_slices, resolve_model_ref
    from mergepipe.config.mergekit_slices import sliced_recipe
    from mergepipe.config.mergekit_ignored import without_ignored
    from mergepipe.config.params import read_yaml
    data, _ = without_ignored(read_yaml(config), config)  # the import warns of what it drops
    paths = ModelPaths(Path.cwd(), params_file.parent)
    if not isinstance(data, dict) or data.get("models") or data.get("merge_method") == "passthrough" \
            or not merges_slices(data.get("slices"), paths):
        return None
    views = sliced_recipe(data, config, paths).views
    folders = {s["model"]: resolve_model_ref(s["model"], f"slices[{i}].sources.model", config)
               for v in views.values() for i, s in enumerate(v)}
    return views, folders


def build_views(views: dict[str, list[dict]], roots: dict[str, Path], target: Path, *, rerun: str) -> Path:
    """Every position's stacked view, `target/<position>` (build_stack: each published whole,
    a previous view replaced, any other folder never); returns `target`. Every view's layers and
    folder are checked before the first is built, so a refusal writes nothing.

    Raises:
        OutputError: `target` is a symbolic link or not a folder; as build_stack.
    """
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise OutputError(f"{target}: exists and is not a folder of stacked views; remove it or choose another -o")
    for name, slices in views.items():
        stack_plan(slices, roots)  # a layer range outside its model, from the headers
        _check_replaceable(target / name)
    target.mkdir(exist_ok=True)
    for name, slices in views.items():
        build_stack(slices, roots, target / name, rerun=rerun)
    return target
