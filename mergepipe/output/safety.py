"""May mergepipe write here? The one owner of the output-safety rules (docs/design.md, "Output safety").

These are the data-loss guarantees: every command, the config checks and the Snakemake rules
ask these functions, and no other module answers them. One function per question:

- `check_output_path`: a path never replaced, even with --force (empty, /, home, the working
  folder or one above it).
- `overlaps`, `refuse_overlap`: a folder published at the output would replace or contain an
  input (a model, a stacked input's source model, the tokenizer source, the cache, the
  command's own input files).
- `refuse_inside`: a file or folder written into an input (an -o record, part files).
- `inside_output`: a file (a signature, a provenance statement) that would lie in an output
  folder without being one of its recorded files.
- `replaceable`, `check_replace`: an existing folder replaced without --force only when it is
  empty or a complete mergepipe output (a valid manifest whose recorded files hold).
- `check_file_target`: an -o file replaced only when the command wrote it (or with --force),
  never when it is the command's input or a folder.
- `check_output_folder`: all of the output folder's questions, in the order a merge asks them.

Must not write, lock or delete anything (output/publish.py does, after asking). Imports
nothing above util at module level, so the config layer may ask `overlaps` at load time.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import OutputError

CARD_TITLE = "# Merged with mergepipe ("  # the model card's title line (output/model_card.py)
_OUTPUT_FILE = re.compile(r"[^/]+\.(safetensors|json|txt|model)|README\.md|mergekit_config\.yml")


def _protected(target: Path) -> str | None:
    """Why replacing `target` would destroy more than an output (even with --force), or None."""
    real = Path(os.path.realpath(target))
    if real == Path(real.anchor):
        return "is the root folder"
    try:
        home = Path(os.path.realpath(Path.home()))
    except (RuntimeError, KeyError):
        home = None
    if home is not None and real == home:
        return "is your home folder"
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd:
        return "is the current folder"
    if real in cwd.parents:
        return "contains the current folder"
    return None


def check_output_path(target: str | Path, *, what: str = "output") -> Path:
    """Refuse output paths that must never be replaced (even with --force): empty, ".",
    /, home, the working folder or a folder above it; returns the absolute path.

    Raises:
        OutputError: naming the path and why.
    """
    if str(target).strip() == "":
        raise OutputError(f"{what} path is empty (an unset shell variable?); give the folder to write")
    path = Path(target).absolute()
    why = _protected(path)
    if why is not None:
        raise OutputError(f"{target}: {what} path {why} ({os.path.realpath(path)}); refusing to replace it, "
                          "even with --force; give a new folder")
    return path


def overlaps(a: Path | str, b: Path | str) -> bool:
    """Whether folder or file `a` is `b`, holds it or lies inside it (links resolved): a folder
    published over `a` would replace or contain `b`."""
    a, b = Path(a).resolve(), Path(b).resolve()
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def writes_into(path: Path | str, folder: Path | str) -> bool:
    """Whether `path` is `folder` or lies inside it (links resolved): writing it changes `folder`."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def inside_output(path: Path | str, out_dir: Path | str) -> bool:
    """Whether `path` lies strictly inside the output folder `out_dir` (links resolved): a file
    written there that its manifest does not record makes it a folder mergepipe did not write."""
    real, out = Path(path).resolve(), Path(out_dir).resolve()
    return real != out and real.is_relative_to(out)


@dataclass(frozen=True, slots=True)
class WriteInputs:
    """What an output may not overlap: the input models, each stacked input's recorded source
    models (source, stacked input; commands/stack.stacked_sources), the tokenizer source, the
    cache folder, and the command's own input files (params.yaml, plan file, parts folder,
    calibration text). `sources` has no default: a caller that forgets it does not run."""

    models: tuple[Path, ...]
    sources: tuple[tuple[Path, Path], ...]
    tokenizer: Path | None = None
    cache: Path | None = None
    command: tuple[Path, ...] = ()


def refuse_overlap(out_dir: Path, inputs: WriteInputs) -> None:
    """Refuse (even with --force) an output folder that is, holds or lies inside an input:
    publishing replaces the whole folder, and gc prunes inside the cache.

    Raises:
        OutputError: naming the first input it overlaps.
    """
    def refuse(what: str, fix: str = "choose another output dir") -> None:
        raise OutputError(f"{out_dir}: output folder overlaps {what}; {fix}")
    for root in inputs.models:
        if overlaps(out_dir, root):
            refuse(f"input model {root}")
    for src, stacked in inputs.sources:
        if overlaps(out_dir, src):
            refuse(f"{src}, a source model of the stacked input {stacked}")
    if inputs.tokenizer is not None and overlaps(out_dir, inputs.tokenizer):
        refuse(f"the tokenizer source {inputs.tokenizer}")
    if inputs.cache is not None and overlaps(out_dir, inputs.cache):
        refuse(f"the cache folder {inputs.cache}", "choose another output dir (or another --cache-dir)")
    for p in inputs.command:
        if overlaps(out_dir, p):
            raise OutputError(f"{out_dir}: output folder holds {p}, an input of this command; publishing would "
                              "delete it, even with --force; choose another output dir")


def refuse_inside(path: Path, inputs: Iterable[Path], *, what: str = "-o") -> None:
    """Refuse (even with --force) a file or folder written at or inside an input: an -o record
    over a model's weights, part files added to a model folder (a second *.safetensors there is
    no longer that checkpoint).

    Raises:
        OutputError: naming the first input `path` is or lies in.
    """
    out = Path(path).resolve()
    for src in inputs:
        if writes_into(out, src):
            where = "inside " if out != Path(src).resolve() else ""
            raise OutputError(f"{path}: {what} is {where}an input of this command ({src}); "
                              "refusing to write there, even with --force; write it elsewhere")


def parts_inputs(inputs: WriteInputs) -> list[Path]:
    """The folders part files may not be added to: the models, the stacked inputs' source
    models and the tokenizer source (the cache and the command's files may hold the parts)."""
    tokenizer = [] if inputs.tokenizer is None else [inputs.tokenizer]
    return [*inputs.models, *(src for src, _ in inputs.sources), *tokenizer]


def check_file_target(path: Path, *, what: str, inputs: Iterable[str | Path] = (), force: bool = False,
                      ours: Callable[[Path], bool] | None = None) -> None:
    """An -o file may replace only what this command wrote before (`ours`; None: nothing is),
    or anything with `force`; never a protected path, the command's own input, or a folder.

    Raises:
        OutputError: naming the file and what to do instead.
    """
    check_output_path(path, what="-o")
    for src in inputs:
        if Path(src).exists() and path.exists() and path.resolve() == Path(src).resolve():
            raise OutputError(f"{path}: -o is the command's own input {src}; write the {what} elsewhere")
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir():
        raise OutputError(f"{path}: -o is a folder; give a file name for the {what}")
    if force:
        return
    if ours is None or not ours(path):
        kind = "" if ours is None else f" and is not a mergepipe {what}"
        raise OutputError(f"{path}: exists{kind}; refusing to overwrite it (choose another name, or pass --force)")


def json_record_with(key: str) -> Callable[[Path], bool]:
    """`ours` for check_file_target: a JSON object holding `key` (a record mergepipe wrote)."""
    def ours(path: Path) -> bool:
        try:
            return key in json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError, RecursionError):
            return False
    return ours


def _our_card(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16).decode("utf-8", "replace")  # after front matter naming every model
    except OSError:
        return False
    return any(line.startswith(CARD_TITLE) for line in head.splitlines())


def _manifest_removed(target: Path, entries: list[str]) -> bool:
    """A mergepipe output whose weights and manifest a build tool deleted before rerunning the
    job (Snakemake removes a job's declared outputs first): our model card is there, and
    nothing but files of the kinds an output holds (weights, JSON, tokenizer files, card)."""
    if not ("README.md" in entries and _our_card(target / "README.md")):
        return False
    return all(_OUTPUT_FILE.fullmatch(n) and (target / n).is_file() and not (target / n).is_symlink()
               for n in entries)


def _legacy_record(path: Path) -> bool:
    """An earlier version's run record inside its output (run.json: timings and host, or a
    restore), which a republication drops."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and bool({"host", "restored_from"} & set(rec)) and not path.is_symlink()


def _edited(target: Path, files: dict) -> str | None:
    """The first recorded file other than weights (model card, config, tokenizer files: recorded
    by blake3) whose bytes are no longer the manifest's: a user's edit, which a rebuild would
    lose. Weight files (recorded by hash tree) are mergepipe's alone: damaged ones are rebuilt."""
    from mergepipe.util.fs import hash_file
    for name, rec in sorted(files.items()):
        path = target / name
        if isinstance(rec, dict) and isinstance(rec.get("blake3"), str) and path.is_file() \
                and not path.is_symlink() and hash_file(path) != rec["blake3"]:
            return name
    return None


def _not_ours(target: Path) -> str | None:
    """None if `target` may be replaced: an empty folder, or a complete mergepipe output
    (a manifest whose hash holds, and no file it does not record). Else the reason."""
    try:
        entries = sorted(p.name for p in target.iterdir())
    except OSError as e:
        return f"cannot be listed ({e.strerror})"
    if not entries:
        return None
    from mergepipe.errors import IntegrityError
    from mergepipe.output.manifest import MANIFEST, load_manifest, replaced_weight_file
    from mergepipe.output.run_record import LEGACY_NAME
    if MANIFEST not in entries:
        if _manifest_removed(target, entries):
            return None
        return f"is a folder that mergepipe did not write (no {MANIFEST}; holds {entries[0]!r}" + (
            f" and {len(entries) - 1} more" if len(entries) > 1 else "") + ")"
    try:
        man = load_manifest(target)
        files = man["outputs"]["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (IntegrityError, KeyError, TypeError):
        return f"holds a {MANIFEST} that is not a valid mergepipe manifest"
    foreign = [n for n in entries if n not in files and n != MANIFEST
               and not (n == LEGACY_NAME and _legacy_record(target / n))]
    if foreign:
        return f"holds {foreign[0]!r}, which the mergepipe output there does not record"
    replaced = replaced_weight_file(target, man)
    if replaced is not None:
        return (f"holds {replaced!r}, which is not the weight file mergepipe published there (another file or "
                "size, and not the manifest's bytes: a user's weights?)")
    edited = _edited(target, files)
    if edited is not None:
        return (f"holds {edited!r}, edited since mergepipe published it (a rebuild would replace the edit; "
                "copy it elsewhere first)")
    return None


def replaceable(target: Path) -> str | None:
    """None if publishing at `target` may replace it without --force (an empty folder or a
    complete mergepipe output); else why not."""
    if target.is_symlink():
        return "is a symbolic link"
    if not target.is_dir():
        return "is not a folder"
    return _not_ours(target)


def check_replace(target: Path, *, force: bool) -> None:
    """Refuse publishing at `target` when it is a symbolic link or a file (even with --force),
    or (without --force) a folder that `replaceable` refuses; a missing target passes.

    Raises:
        OutputError: naming the target and why.
    """
    if target.is_symlink():
        where = os.readlink(target)
        state = "a dangling symbolic link" if not target.exists() else "a symbolic link"
        raise OutputError(f"{target}: output path is {state} (to {where}); give the real folder instead")
    if target.exists() and not target.is_dir():
        raise OutputError(f"{target}: output path exists and is not a folder")
    if target.is_dir() and not force:
        why = _not_ours(target)
        if why is not None:
            raise OutputError(f"{target}: output folder {why}; refusing to replace it (choose a new folder, "
                              "or pass --force to replace it)")


def check_output_folder(out_dir: Path, inputs: WriteInputs, *, force: bool) -> None:
    """Every question about publishing a merge at `out_dir`, before any weight is read: a
    protected path, a run-record path holding another file, an overlap with an input, and
    (without --force) a folder mergepipe did not write.

    Raises:
        OutputError: the first refusal.
    """
    from mergepipe.output import run_record
    check_output_path(out_dir)
    run_record.check_writable(out_dir)
    refuse_overlap(out_dir, inputs)
    check_replace(out_dir, force=force)
