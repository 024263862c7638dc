# Config validation, derived paths and input functions shared by the rules.
import json
import os
import re
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

import mergepipe
from mergepipe.commands.made_from import params_hash
from mergepipe.errors import MergepipeError
from mergepipe.checkpoint.blocks import parse_block_bytes
from mergepipe.units import parse_bytes

INDEX_JSON = "model.safetensors.index.json"

# A rule's stderr goes through `tee` to its log, so the CLI sees no terminal: where Snakemake's
# own stdout is one, ask it for progress bars on the terminal itself (mergepipe/util/progress.py:
# on /dev/tty, the log gets each step's end line only). MERGEPIPE_PROGRESS=0 turns them off.
if sys.stdout.isatty():
    os.environ.setdefault("MERGEPIPE_PROGRESS", "1")

# Workflow settings, not part of the merge (so not in params.yaml or its schema):
#   merge_parts:  split the merge into this many jobs plus a gather (same bytes)
#   demo_dir:     the `demo` rule generates the demo family in this folder
#   demo_experts: its size: demo_dir/base and demo_dir/expert_0 .. expert_<demo_experts - 1>
WORKFLOW_DEFAULTS = {"merge_parts": 1, "demo_dir": "models/demo", "demo_experts": 3}
WF = {key: config.pop(key, default) for key, default in WORKFLOW_DEFAULTS.items()}

# The CLI reads the params file itself, so a `--config key=value` override of a merge
# key would be ignored by it: refuse it instead of building something else.
PARAMS = str(workflow.overwrite_configfiles[-1]) if workflow.overwrite_configfiles else "params.yaml"
with open(PARAMS) as _f:
    if config != yaml.safe_load(_f):
        raise WorkflowError(
            f"the merge is described by {PARAMS} alone: edit it instead of overriding its keys with "
            f"--config (only {', '.join(WORKFLOW_DEFAULTS)} may be set that way)")


def _validate_config() -> None:
    """The schema check (which also fills top-level defaults); the CLI checks the rest, with
    one-line errors, in `plan`. A schema error prints the whole schema (thousands of lines):
    on one, mergepipe's own checker names the key in one line instead."""
    try:
        validate(config, "../schemas/params.schema.yaml")
    except WorkflowError as schema_error:
        from mergepipe.config.params import load_config

        try:
            load_config(PARAMS)
        except MergepipeError as e:
            raise WorkflowError(str(e)) from None
        lines = str(schema_error).splitlines()  # a schema stricter than the CLI: its own summary
        summary = [line.strip() for line in lines if line.startswith(("ValidationError:", "On instance"))]
        raise WorkflowError(f"{PARAMS}: {'; '.join(summary or lines[:1])}") from None


_validate_config()
# What `mergepipe plan` records as the plan's made_from: a param of the plan rule, so the plan
# reruns whenever the file's bytes differ from those it was last made from, whatever the mtimes
# (an edit while the plan job ran leaves a plan newer than the edit).
PARAMS_HASH = params_hash(PARAMS)
with open(Path(workflow.basedir) / "schemas" / "params.schema.yaml") as _f:
    _output_schema = yaml.safe_load(_f)["$defs"]["OutputConfig"]["properties"]
OUTPUT = {key: spec.get("default") for key, spec in _output_schema.items()} | config.get("output", {})


def rel(path) -> str:
    """A path as the rules use it: relative to the working directory when inside it."""
    r = os.path.relpath(path)
    return str(path) if r.startswith("..") else r


ROOT = rel(Path(PARAMS).absolute().parent)  # paths in params.yaml are relative to its folder


def from_root(path: str) -> str:
    return rel(Path(ROOT) / path)


BASE = from_root(config["base"])


def _expert_folder(i: int, e: dict) -> str:
    """An expert's folder: `path:`, or `adapter:` as `mergepipe plan` resolves it (config/paths.py):
    a folder beside params.yaml, else a Hugging Face id's snapshot in the local cache; an id
    that is neither is refused in one line here (its index job would have no inputs to wait for)."""
    if e.get("path"):
        return from_root(e["path"])
    from mergepipe.config.hf_cache import hub_snapshot, looks_like_hub_id
    from mergepipe.config.paths import adapter_folder

    _, folder = adapter_folder(Path(ROOT).absolute(), Path(e["adapter"]))
    if not folder.exists() and looks_like_hub_id(e["adapter"]):
        try:
            hub_snapshot(e["adapter"])  # raises, naming the id and the cache folder
        except MergepipeError as err:
            raise WorkflowError(f"{PARAMS}: experts[{i}].adapter: {err}") from None
    return rel(folder)


# an expert is a model folder (path:) or a LoRA adapter folder (adapter:, or a Hub id in the local cache)
EXPERT_FOLDERS = [_expert_folder(i, e) for i, e in enumerate(config["experts"])]
EXPERTS = {e["name"]: f for e, f in zip(config["experts"], EXPERT_FOLDERS)}
ADAPTERS = sorted(f for e, f in zip(config["experts"], EXPERT_FOLDERS) if e.get("adapter"))
# output.adapter: the merge is written as one LoRA adapter by `mergepipe run` (no index, no plan)
ADAPTER_OUT = bool(OUTPUT.get("adapter"))
BLOCK_BYTES = parse_block_bytes(config["block_bytes"])
CACHE = from_root(config["cache_dir"])
OUT = from_root(OUTPUT["dir"])
PLAN = "plans/plan.json"
VERIFIED = "logs/verify.txt"
PARTS = int(WF["merge_parts"])
PARTS_DIR = f"{CACHE}/parts"
DEMO_DIR = rel(WF["demo_dir"])

# What the rules run is the installed mergepipe release: each rule takes its version as a
# param, so upgrading reruns the steps (plan hashes, and so the store of merges, cover it).
# Parsing this file imports nothing heavy (no torch), so a no-op call stays fast.
VERSION = mergepipe.__version__


def _demo_family() -> list[str]:
    """The folders the demo rule makes in DEMO_DIR: base, expert_0 .. expert_<demo_experts - 1>."""
    n = WF["demo_experts"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise WorkflowError(f"--config demo_experts={n!r}: expected a whole number >= 1")
    return ["base", *(f"expert_{k}" for k in range(n))]


DEMO_FAMILY = _demo_family()


def in_demo_dir(path: str) -> bool:
    return Path(path).parts[: len(Path(DEMO_DIR).parts)] == Path(DEMO_DIR).parts


def _weight_files(path: Path) -> list[Path]:
    """A model's weight files, as `mergepipe index` finds them (names from the index json)."""
    if path.is_file():
        return [path]
    index = path / INDEX_JSON
    if index.is_file():
        try:
            return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []  # malformed: the index step says why
    return sorted(path.glob("*.safetensors"))


# What an adapter output folder holds besides its manifest (output/adapter_out.py): every file
# declared, so that Snakemake's deleting them before a rerun leaves the folder empty, which the
# publisher may replace
ADAPTER_FILES = ["adapter_model.safetensors", "adapter_config.json", "adapter_report.json"]


def _output_weights() -> list[str]:
    """The files the merge writes besides its manifest: an adapter's, or the weight files (the
    base's own unless output.shard_bytes is set)."""
    if ADAPTER_OUT:
        return list(ADAPTER_FILES)
    shard_bytes = OUTPUT["shard_bytes"]
    if shard_bytes is None:
        files = _weight_files(Path(BASE))
        return [p.name for p in files] if len(files) > 1 else ["model.safetensors"]
    from mergepipe.engine.merge import output_layout  # needs the headers (and torch): only here
    from mergepipe.checkpoint.safetensors import open_checkpoint

    try:
        base = open_checkpoint(BASE)
    except MergepipeError as e:
        raise WorkflowError(f"output.shard_bytes is set, so the base must exist to name the output shards: {e} "
                            f"(the demo family: run `snakemake demo` first)")
    return list(output_layout(base, dtype=OUTPUT["dtype"], shard_bytes=parse_bytes(shard_bytes)))


OUT_WEIGHTS = [f"{OUT}/{name}" for name in _output_weights()]
OUT_MANIFEST = f"{OUT}/manifest.json"


def _check_out() -> None:
    """Snakemake deletes a job's existing output files before it runs (and after it fails), so
    an output.dir holding a user's model.safetensors lost it before `mergepipe merge` could
    refuse the folder: refuse here what mergepipe would not replace without --force."""
    if not os.path.lexists(OUT):
        return
    from mergepipe.output.safety import replaceable

    why = replaceable(Path(OUT))
    if why is not None:
        raise WorkflowError(f"{PARAMS}: output.dir {OUT!r} {why}; Snakemake would delete its "
                            f"{', '.join(Path(p).name for p in [*OUT_WEIGHTS, OUT_MANIFEST])} before the merge, "
                            "so the workflow refuses it: choose a new folder")


_check_out()

DEMO_MARKER = ".mergepipe-demo"  # mergepipe.commands.demo.DEMO_MARKER (that module imports torch)


def _check_demo_dir() -> None:
    """DVC's demo stage's output is the whole demo_dir (dvc.yaml) and the demo rule deletes
    and rewrites its base/ and expert_*/: a model the user put there went with them (or into
    DVC's record of the demo). Refuse a demo_dir holding anything `mergepipe demo` does not write."""
    if not os.path.isdir(DEMO_DIR) or os.path.islink(DEMO_DIR):
        return  # missing (generated), or a file or link: the demo step says why
    names = sorted(os.listdir(DEMO_DIR))
    foreign = [n for n in names if n not in (DEMO_MARKER, ".snakemake_timestamp")  # Snakemake's, of directory()
               and not re.fullmatch(r"base|expert_\d+", n)]
    if names and DEMO_MARKER not in names:
        foreign = names
    if foreign:
        raise WorkflowError(f"{DEMO_DIR}: holds {foreign[0]!r}, which `mergepipe demo` did not write; the demo "
                            "rule regenerates what is in that folder and DVC's demo stage records all of it, so "
                            "the workflow refuses it: move your models out of it (see dvc.yaml's demo stage)")


_check_demo_dir()


def _check_demo_paths() -> None:
    """A model path under DEMO_DIR must be a folder the demo rule makes: any other (a typo,
    `expert_3` for `expert_2`) is refused, not generated and merged."""
    models = {"base": BASE, **{f"experts[{i}].{'path' if e.get('path') else 'adapter'}": EXPERT_FOLDERS[i]
                               for i, e in enumerate(config["experts"])}}
    for key, path in models.items():
        if in_demo_dir(path) and Path(path).parts[len(Path(DEMO_DIR).parts):] not in [(m,) for m in DEMO_FAMILY]:
            raise WorkflowError(f"{PARAMS}: {key} {path!r} is in demo_dir {DEMO_DIR!r}, where the demo rule makes only "
                                f"{', '.join(DEMO_FAMILY)}: fix the path (or set --config demo_experts=N for a "
                                "larger demo family)")


_check_demo_paths()


def model_files(path: str) -> list[str]:
    """The files `mergepipe index` reads for a model: its weight files and index json.

    Never a missing file: Snakemake treats an existing output whose producer lacks an input
    as a source file, so a mistyped or deleted model path gave "Nothing to be done" and kept
    the old merge. A missing model or one without weights has no inputs: its index job runs
    and the CLI says why in one line."""
    if in_demo_dir(path):
        checkpoints.demo.get()  # generated by the demo rule; waits for it
    if path in ADAPTERS:  # an adapter's two files (a pickled adapter_model.bin is never read)
        return sorted(rel(p) for p in (Path(path) / "adapter_model.safetensors", Path(path) / "adapter_config.json")
                      if p.is_file())
    files = _weight_files(Path(path))
    if (Path(path) / INDEX_JSON).is_file():
        files.append(Path(path) / INDEX_JSON)
    return sorted(rel(p) for p in files)


wildcard_constraints:
    expert=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    part=r"[0-9]+",
