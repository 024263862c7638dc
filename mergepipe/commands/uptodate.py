"""`mergepipe run`'s no-op check without planning, indexing or importing torch.

A make-style record, kept in the output's run record (output/run_record.py: beside the
output folder, outside the manifest hash) when `run` publishes: a key over what the plan is
a function of that is not a file's bytes (the params.yaml's bytes and absolute path, the
command-line overrides, the working folder and the mergepipe version), and the stat keys
(size, mtime_ns, ctime_ns, inode, device) of each input folder (the models, the tokenizer
source) and of every entry directly in it, and of each input file (the calibration text),
taken before the inputs were read. The next `run` with the same key, whose input folders and
entries have the same stat keys and whose output files have the stat keys recorded at
publication, has nothing to do. This trusts stat keys exactly as the index's stat cache and
the up-to-date check after planning already do (as git and DVC do). Any difference, a
missing or damaged record, or a checkpoint file outside its model folder's top level, is not
an error: `run` takes the full path (index, plan, compare with the manifest), which decides.

Only the standard library, yaml, blake3 and output/run_record.py are imported here: this
check must stay a fraction of the interpreter's start-up.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from blake3 import blake3

from mergepipe.output import run_record

RECORD = "up_to_date"  # the key of this record in the run record
RECORD_FORMAT = 2  # 2: the tokenizer source and calibration text are inputs too (records of 1 lacked them)
MANIFEST = run_record.MANIFEST
_stat_key = run_record.stat_key


def config_key(config_path: str | os.PathLike[str], overrides: dict) -> str:
    """blake3 over the record format, the params file's absolute path and bytes, the overrides
    (as given on the command line), the working folder and the mergepipe version."""
    from mergepipe import __version__
    path = os.path.abspath(config_path)
    with open(path, "rb") as f:
        data = f.read()
    doc = [RECORD_FORMAT, __version__, path, blake3(data).hexdigest(), os.getcwd(),
           sorted((k, str(v)) for k, v in overrides.items() if v is not None)]
    return blake3(json.dumps(doc).encode()).hexdigest()


def folder_stats(folders: list[str | os.PathLike[str]]) -> dict[str, list[int]]:
    """Stat keys of each folder and of every entry directly in it (not following links);
    an input that is a file (the calibration text) is keyed with its link target's."""
    out: dict[str, list[int]] = {}
    for folder in map(os.path.abspath, folders):
        out[folder] = _stat_key(folder)
        if not os.path.isdir(folder):
            out[folder + "\0target"] = _stat_key(os.path.realpath(folder))
            continue
        with os.scandir(folder) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                out[entry.path] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
                if entry.is_symlink():  # a linked shard: its target's bytes matter too
                    out[entry.path + "\0target"] = _stat_key(os.path.realpath(entry.path))
    return out


def snapshot(config_path: str | os.PathLike[str], overrides: dict, folders: list) -> dict | None:
    """The record to keep if this run publishes; taken before any input is read.
    None when it cannot be taken (then no record is kept)."""
    try:
        folders = [os.path.abspath(f) for f in folders]
        return {"config": config_key(config_path, overrides), "folders": folders, "inputs": folder_stats(folders)}
    except OSError:
        return None


def finish(record: dict | None, input_files: list[str | os.PathLike[str]], out_dir: str | os.PathLike[str],
           plan_hash: str) -> dict | None:
    """Complete a snapshot once the inputs are open: None (keep no record) if a checkpoint
    file is not among the snapshot's entries (a shard in a subfolder)."""
    if record is None:
        return None
    entries = record["inputs"]
    if any(os.path.abspath(p) not in entries for p in input_files):
        return None
    return {**record, "out_dir": os.path.abspath(out_dir), "plan_hash": plan_hash}


def _out_dir(config_path: str | os.PathLike[str], output: str | None) -> Path | None:
    if output is not None:
        return Path(os.path.normpath(Path(output).absolute()))
    from mergepipe.config.yaml_io import read_yaml  # yaml only
    data = read_yaml(config_path)
    out = data.get("output") if isinstance(data, dict) else None
    if isinstance(out, dict) and "dir" in out:
        written = out["dir"]
    elif isinstance(data, dict) and (out is None or isinstance(out, dict)):
        from mergepipe.config.fields import DEFAULT_OUTPUT_DIR
        written = DEFAULT_OUTPUT_DIR
    else:
        return None
    if not isinstance(written, str) or not written.strip():
        return None
    root = Path(os.path.abspath(Path(config_path).parent))
    return Path(os.path.normpath(root / Path(written).expanduser()))


def fast_up_to_date(config_path: str | os.PathLike[str], overrides: dict,
                    output: str | None) -> tuple[Path, str] | None:
    """(output folder, plan hash) if `run` has nothing to do by the output's run record;
    None when that cannot be told this way (the full check decides)."""
    try:
        out_dir = _out_dir(config_path, output)
        if out_dir is None:
            return None
        info = run_record.read(out_dir) or {}
        rec = info.get(RECORD)
        stats = info.get("stat")
        if not isinstance(rec, dict) or not isinstance(stats, dict) or MANIFEST not in stats:
            return None
        if rec.get("out_dir") != str(out_dir) or rec.get("config") != config_key(config_path, overrides):
            return None
        folders, inputs = rec.get("folders"), rec.get("inputs")
        if not isinstance(folders, list) or not folders or folder_stats(folders) != inputs:
            return None
        if {p.name for p in out_dir.iterdir()} != set(stats):
            return None
        if any(_stat_key(str(out_dir / name)) != key for name, key in stats.items()):
            return None
        plan_hash = rec.get("plan_hash")
        return (out_dir, plan_hash) if isinstance(plan_hash, str) else None
    except Exception:  # noqa: BLE001 -- any surprise (damaged record, unreadable config): the full check decides
        return None


def record_output_stats(out_dir: str | os.PathLike[str], stats: dict[str, list[int]]) -> None:
    """After a rehash proved an output's files, keep `stats` (their stat keys, taken before the
    rehash) as the ones recorded at publication, if the files still have them (a record is
    made where there was none: a folder DVC restored). Best effort, like `refresh`; the
    make-style record is dropped, since it vouched for the old keys."""
    out_dir = Path(out_dir)
    if any(_stat_key(str(out_dir / n)) != k for n, k in stats.items()):
        return  # changed during the rehash: the next run rehashes again
    run_record.update(out_dir, lambda info: {**{k: v for k, v in info.items() if k != RECORD}, "stat": stats})


def refresh(out_dir: str | os.PathLike[str], record: dict | None) -> None:
    """Keep `record` in the run record of an output that the full check found up to date,
    when its files still have the stat keys recorded at publication (else the next run
    rehashes them anyway). Best effort (output/run_record.py `update`)."""
    if record is None:
        return

    def change(info: dict) -> dict | None:
        stats = info.get("stat")
        if not isinstance(stats, dict) or any(_stat_key(str(Path(out_dir) / n)) != k for n, k in stats.items()):
            return None
        return {**info, RECORD: record}
    run_record.update(out_dir, change)
