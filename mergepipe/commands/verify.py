"""`mergepipe verify`: an output against its manifest (output/manifest.py), and with `inputs`
or `replay` against the inputs its plan names (their weights' content hashes and the base's
copied non-weight files, plan `base.files`) and a rebuild from that plan.

A replay that differs says what: the layout (weight file names, which tensors each holds,
their order), the first differing tensors with their file, a header, or a non-weight file.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from mergepipe.checkpoint.safetensors import CheckpointError, open_checkpoint
from mergepipe.errors import IntegrityError
from mergepipe.output.adapter_out import ADAPTER_KIND
from mergepipe.output.manifest import MANIFEST, verify_outputs

SHOWN = 3  # differing tensors a message names


def verify(out_dir: Path, *, deep: bool = False, inputs: bool = False, replay: bool = False,
           root: Path = Path("."), threads: int = 2) -> str:
    """Check `out_dir`; returns the one-line report.

    Raises:
        IntegrityError: the output does not match its manifest, its plan or (replay) a rebuild.
    """
    man = verify_outputs(out_dir, deep=deep)
    checked = [f"{len(man['outputs']['files'])} files" + (" reread" if deep else "")]
    if man.get("kind") == ADAPTER_KIND and (inputs or replay) and "extract" in (man.get("recipe") or {}):
        from mergepipe.commands.extract_lora import check_recorded_inputs as check_extracted
        checked += check_extracted(out_dir, man, root, replay=replay, threads=threads)
    elif man.get("kind") == ADAPTER_KIND and (inputs or replay):  # no plan: the recipe and the adapters' hashes
        from mergepipe.commands.adapter_run import check_recorded_inputs
        checked += check_recorded_inputs(out_dir, man, root, replay=replay)
    elif inputs or replay:
        from mergepipe.commands.pipeline import merge_plan, open_inputs, recorded_card
        from mergepipe.index.store import Store
        plan, where = _recorded_plan(out_dir, man)
        with tempfile.TemporaryDirectory(prefix="mergepipe-verify-") as tmp:
            store = Store(Path(tmp) / "cache")  # fresh cache: rehash every input byte
            # the inputs' weights, and the base's non-weight files the output copied (plan base.files)
            opened = open_inputs(plan, store, root, threads=threads, where=where,
                                 check_stacks=False)  # verify compares with the record, which names the stack
            checked.append(f"{1 + len(plan.experts)} inputs, {len(plan.base.files)} base files")
            if replay:
                replay_dir = Path(tmp) / "replay"
                again = merge_plan(plan, opened, replay_dir, store, threads=threads, progress=False,
                                   card=recorded_card(out_dir, man))  # the card quotes the recipe, no input
                if again["outputs"] != man["outputs"]:
                    raise IntegrityError(f"{out_dir}: replay produced different outputs: "
                                         + replay_difference(out_dir, man["outputs"], replay_dir, again["outputs"]))
                checked.append("replay identical")
    return f"{out_dir}: OK ({', '.join(checked)}; manifest {man['manifest_hash'][:16]})"


def _recorded_plan(out_dir: Path, man: dict):
    """The manifest's plan, checked as a plan file is (plan/load.py), and where to say it is."""
    from mergepipe.plan.load import recorded_plan
    where = f"{out_dir / MANIFEST}: plan"
    return recorded_plan(man, where), where


def _weight_files(outputs: dict) -> list[str]:
    return sorted(n for n, rec in outputs["files"].items() if "tree" in rec)


def _file_tensors(folder: Path, names: list[str]) -> dict[str, list[str]]:
    """Weight file -> its tensor names in file order, from its header."""
    out = {}
    for name in names:
        try:
            out[name] = list(open_checkpoint(folder / name).tensors.names)
        except CheckpointError as e:  # verified before the replay: a file of ours, so a bug
            raise IntegrityError(f"{folder / name}: cannot read its header to compare: {e}") from None
    return out


def _names(names: list[str]) -> str:
    return ", ".join(map(repr, names[:SHOWN])) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def replay_difference(out_dir: Path, recorded: dict, replay_dir: Path, replayed: dict) -> str:
    """What differs between an output's recorded `outputs` and its replay's, in words: the
    weight files, the shard split, a file's tensor order, the first differing tensors (with
    their file), a header, or the non-weight files."""
    files, again = _weight_files(recorded), _weight_files(replayed)
    if files != again:
        return f"layout: weight files [{_names(files)}], the replay's [{_names(again)}]"
    ours, theirs = _file_tensors(out_dir, files), _file_tensors(replay_dir, files)
    file_of = {t: f for f, ts in ours.items() for t in ts}
    replay_file_of = {t: f for f, ts in theirs.items() for t in ts}
    if file_of.keys() != replay_file_of.keys():
        only = sorted(file_of.keys() ^ replay_file_of.keys())
        return f"tensors: {_names(only)} in only one of the output and the replay"
    moved = sorted(t for t in file_of if file_of[t] != replay_file_of[t])
    if moved:
        t = moved[0]
        return (f"shard split: {len(moved)} tensors in other files, first {t!r} in {file_of[t]}, the replay's in "
                f"{replay_file_of[t]}")
    for f in files:
        if ours[f] != theirs[f]:
            i = next(i for i, (a, b) in enumerate(zip(ours[f], theirs[f])) if a != b)
            return f"tensor order of {f}: tensor {i} is {ours[f][i]!r}, the replay's {theirs[f][i]!r}"
    hashes, replay_hashes = recorded["tensors"], replayed["tensors"]
    bad = sorted(t for t in file_of if hashes.get(t) != replay_hashes.get(t))
    if bad:
        return f"tensors {', '.join(f'{t!r} ({file_of[t]})' for t in bad[:SHOWN])} differ ({len(bad)} in all)"
    headers = [f for f in files if recorded["files"][f] != replayed["files"][f]]
    if headers:
        return f"header of {headers[0]} (the same tensors in the same order, other header bytes)"
    others = sorted(n for n in recorded["files"].keys() | replayed["files"].keys()
                    if recorded["files"].get(n) != replayed["files"].get(n))
    if others:
        return f"non-weight files {_names(others)} (the weights are identical)"
    return "the manifests' records of the outputs"
