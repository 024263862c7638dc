"""`mergepipe audit OUT`: prove or disprove, on any machine, how a merge was built.

1. The output against its manifest (every file reread).
2. Each input the plan records, found by content hash wherever it is (commands/audit_search.py),
   then rehashed in a fresh store (every byte read).
3. The merge replayed from those inputs into a temporary folder and compared with the
   manifest: every tensor hash, dtype and shape; at the top level also every other file
   (a weight file laid out otherwise, its tensors identical, because the base was re-sharded,
   is reported, not failed).
4. Lineage (output/lineage.py): each linked input checked to be the output of the manifest it
   links to; with `recursive`, that manifest audited the same way, down to inputs that are not merges.

Returns a Report; the caller prints it and exits: any mismatch is an IntegrityError, an input
found nowhere (and no mismatch) a MissingInputError. Nothing outside the temporary folder and
the Store's cache is written.
"""
from __future__ import annotations

import os
import tempfile
from itertools import chain
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.safetensors import INDEX_JSON, Checkpoint, open_checkpoint
from mergepipe.commands.audit_search import Finder, Found
from mergepipe.commands.pipeline import merge_plan, open_inputs, recorded_card
from mergepipe.errors import CheckpointError, ConfigError, IntegrityError, MergepipeError, MissingInputError
from mergepipe.index.records import ModelIndex
from mergepipe.index.store import Store
from mergepipe.output.lineage import is_output_of, output_hash
from mergepipe.output.adapter_out import refuse_adapter_manifest
from mergepipe.output.manifest import MANIFEST, load_manifest, verify_outputs
from mergepipe.plan.load import recorded_plan
from mergepipe.plan.record import PlanInputRecord, PlanRecord
from mergepipe.util.fs import hash_file


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def say(self, depth: int, text: str) -> None:
        self.lines.append("  " * depth + text)

    def mismatch(self, depth: int, text: str) -> None:
        self.mismatches.append(text)
        self.say(depth, "MISMATCH " + text)

    def absent(self, depth: int, text: str) -> None:
        self.missing.append(text)
        self.say(depth, "MISSING " + text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def raise_if_failed(self, out_dir: Path) -> None:
        """IntegrityError on any mismatch, else MissingInputError on any input not found."""
        for problems, error, what in ((self.mismatches, IntegrityError, "mismatch"),
                                      (self.missing, MissingInputError, "missing")):
            if problems:
                more = f" (+{len(problems) - 1} more {what}{'es' if what == 'mismatch' else ''})" \
                    if len(problems) > 1 else ""
                raise error(f"{out_dir}: audit failed: {problems[0]}{more}")


@dataclass
class _Input:
    name: str  # "base" or the expert's name
    label: str  # "base" or "expert NAME"
    ref: PlanInputRecord  # the plan's entry: name, path, content_hash, ...
    found: Found | None = None
    ckpt: Checkpoint | None = None
    index: ModelIndex | None = None  # rehashed in the fresh store, under the plan's layout


@dataclass
class _Audit:
    finder: Finder
    fresh: Store  # empty at the start of the audit: whatever it indexes is rehashed
    tmp: Path
    report: Report
    recursive: bool
    threads: int
    audited: set[str] = field(default_factory=set)  # manifest hashes audited (a merge reached twice)
    used: set[str] = field(default_factory=set)  # real paths of the folders found as inputs

    def merge(self, man: dict, plan: PlanRecord, produced: Checkpoint | None, depth: int, *,
              out_dir: Path | None = None) -> None:
        """Audit the merge `man` (its checked plan `plan`) whose output is `produced` (the output
        folder at the top, else a found input): its inputs, the replay, its lineage."""
        self.audited.add(man["manifest_hash"])
        layout = plan.layout
        inputs = [_Input("base", "base", plan.base)] + [_Input(e.name, f"expert {e.name}", e) for e in plan.experts]
        for item in inputs:
            base = inputs[0]  # located first: an expert that is a LoRA adapter is one of it
            self._locate(item, layout, depth, like=next((i.ckpt for i in inputs if i.ckpt is not None), None),
                         base=None if item is base or base.index is None else (base.ckpt, base.index))
        tokenizer = self._tokenizer(plan, inputs, depth)
        if all(i.index is not None for i in inputs) and tokenizer is not False:
            self._replay(man, plan, inputs, tokenizer, produced, depth, out_dir)
        else:
            self.report.say(depth, "replay: not run (an input is missing or differs)")
        self._lineage(man, inputs, depth)

    def _locate(self, item: _Input, layout: BlockLayout, depth: int, *, like: Checkpoint | None,
                base: tuple[Checkpoint, ModelIndex] | None = None) -> None:
        want, recorded = item.ref.content_hash, item.ref.path
        found = self.finder.find(want, recorded, layout, like=like, base=base)
        if found is None:
            there = self.finder.indexed.get(os.path.realpath(Path(recorded).expanduser()))
            if there is not None:  # the model at the recorded path is another one
                self.report.mismatch(depth, f"{item.label}: {recorded} holds content {there[:16]}, the manifest "
                                            f"records {want[:16]} (changed since the merge), and no copy was found")
            else:
                self.report.absent(depth, f"{item.label} (content {want[:16]}, recorded as {recorded}): not found "
                                          "at that path, in the --search folders or in the Hugging Face cache")
            return
        try:
            fresh_base = None if base is None else self.fresh.model_index(
                base[0].root, block_bytes=layout, threads=self.threads)  # the adapter's base, rehashed too
            ckpt, index = self.fresh.model_index(found.folder, block_bytes=layout, threads=self.threads,
                                                 base=fresh_base)
        except MergepipeError as e:
            self.report.mismatch(depth, f"{item.label}: {found.folder}: rehash failed: {e}")
            return
        if index.content_hash != want:  # changed between the search's (cached) index and the rehash
            self.report.mismatch(depth, f"{item.label}: {found.folder}: rehashed content {index.content_hash[:16]}, "
                                        f"the manifest records {want[:16]}")
            return
        item.found, item.ckpt, item.index = found, ckpt, index
        self.used.add(os.path.realpath(found.folder))
        self.report.say(depth, f"{item.label} {want[:16]}: found {found.folder} ({found.how}); rehashed: matches")

    def _tokenizer(self, plan: PlanRecord, inputs: list[_Input], depth: int) -> Path | None | bool:
        """The folder holding the plan's tokenizer source files (None: the plan has none;
        False: not found)."""
        tok = plan.output.tokenizer_source
        if tok is None:
            return None
        folders = chain([Path(tok.path).expanduser()], (i.found.folder for i in inputs if i.found is not None),
                        self.finder.holding(sorted(tok.files)))
        for folder in folders:
            try:
                if all(hash_file(folder / n) == h for n, h in tok.files.items()):
                    self.report.say(depth, f"tokenizer source: found {folder}; files match")
                    return folder
            except OSError:
                continue
        self.report.absent(depth, f"tokenizer source (recorded as {tok.path}): no folder with its "
                                  f"{len(tok.files)} files found")
        return False

    def _replay(self, man: dict, plan: PlanRecord, inputs: list[_Input], tokenizer: Path | None,
                produced: Checkpoint | None, depth: int, out_dir: Path | None) -> None:
        at = {i.name: str(i.found.folder.resolve()) for i in inputs}
        located = plan.model_copy(update={  # where the inputs were found; only opened, never recorded
            "base": plan.base.model_copy(update={"path": at["base"]}),
            "experts": [e.model_copy(update={"path": at[e.name]}) for e in plan.experts]})
        if tokenizer is not None:
            found_tok = plan.output.tokenizer_source.model_copy(update={"path": str(tokenizer.resolve())})
            located = located.model_copy(update={"output": plan.output.model_copy(
                update={"tokenizer_source": found_tok})})
        replay_dir = self.tmp / f"replay-{man['manifest_hash'][:16]}"
        try:
            opened = open_inputs(located, self.fresh, Path("/"), threads=self.threads,
                                 where=f"manifest {man['manifest_hash'][:16]}: plan", check_stacks=False)
            # the recorded plan, not `located`: the model card and manifest name the inputs as recorded
            again = merge_plan(plan, opened, replay_dir, self.fresh, threads=self.threads,  # the card quotes
                               card=None if out_dir is None else recorded_card(out_dir, man))  # the recipe
        except MergepipeError as e:
            self.report.mismatch(depth, f"replay failed: {e}")
            return
        problems, notes = compare_outputs(man, again, produced, open_checkpoint(replay_dir), files=out_dir is not None)
        for p in problems:
            self.report.mismatch(depth, f"replay: {p}")
        if not problems:
            n = len(man["outputs"]["tensors"])
            what = f"{len(man['outputs']['files'])} files, " if out_dir is not None else ""
            self.report.say(depth, f"replay: identical ({what}{n} tensors)" + "".join(f"; {x}" for x in notes))

    def _lineage(self, man: dict, inputs: list[_Input], depth: int) -> None:
        lineage = man.get("lineage", {})
        experts = lineage.get("experts", {}) if isinstance(lineage, dict) else None
        if not isinstance(lineage, dict) or not isinstance(experts, dict):
            self.report.mismatch(depth, "lineage: malformed (not a mergepipe manifest)")
            return
        by_name = {i.name: i for i in inputs[1:]}
        links = ([(inputs[0], "base", lineage["base"])] if "base" in lineage else []) + [
            (by_name.get(name), name, link) for name, link in sorted(experts.items())]
        for item, name, link in links:
            if item is None or not (isinstance(link, dict) and isinstance(link.get("manifest_hash"), str)
                                    and isinstance(link.get("output_hash"), str)):
                self.report.mismatch(depth, f"lineage: malformed link for {name!r}")
                continue
            linked = link["manifest_hash"]
            head = f"lineage: {item.label} is the output of merge {linked[:16]}"
            if item.ckpt is None:
                self.report.say(depth, f"{head} (not checked: the input was not found)")
                continue
            where = self.finder.manifest(linked, first=item.found.folder)
            if where is None:
                self.report.absent(depth, f"{head}: that manifest was not found (not in {item.found.folder}, nor "
                                          "under the --search folders)")
                continue
            folder, lm = where
            if output_hash(lm) != link["output_hash"] or not is_output_of(lm, item.ckpt, item.index):
                self.report.mismatch(depth, f"{head}: the manifest in {folder} does not record this input's "
                                            "tensors as its outputs")
                continue
            self.report.say(depth, f"{head} (manifest in {folder}): weights match")
            if self.recursive and linked not in self.audited:
                self._nested(lm, folder, item.ckpt, depth + 1)

    def _nested(self, man: dict, folder: Path, produced: Checkpoint, depth: int) -> None:
        try:
            plan = recorded_plan(man, f"{folder / MANIFEST}: plan")
        except MergepipeError as e:
            self.report.mismatch(depth, str(e))
            return
        self.report.say(depth, f"merge {man['manifest_hash'][:16]} ({plan.method}, budget {plan.budget}, "
                               f"plan {plan.plan_hash[:16]}):")
        self.merge(man, plan, produced, depth + 1)


def compare_outputs(want: dict, again: dict, produced: Checkpoint | None, replayed: Checkpoint, *,
                    files: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) of a replay's manifest `again` against the recorded `want`: tensor
    hashes, dtypes and shapes (`produced`, `replayed`: the two checkpoints; None: not readable), and with `files`
    every file; weight files that differ while every tensor is identical are a note (layout)."""
    problems, notes = [], []
    wt, gt = want["outputs"]["tensors"], again["outputs"]["tensors"]
    bad = sorted(n for n in wt.keys() | gt.keys() if wt.get(n) != gt.get(n))
    if bad:
        problems.append(f"{len(bad)} tensor(s) differ (first {bad[0]!r})")
    shaped = [] if produced is None else sorted(n for n in produced.tensors.keys() & replayed.tensors.keys()
                    if (produced.tensors[n].dtype, tuple(produced.tensors[n].shape))
                    != (replayed.tensors[n].dtype, tuple(replayed.tensors[n].shape)))
    if shaped:
        problems.append(f"{len(shaped)} tensor(s) of another dtype or shape (first {shaped[0]!r})")
    if files:
        wf, gf = want["outputs"]["files"], again["outputs"]["files"]
        differ = sorted(n for n in wf.keys() | gf.keys() if wf.get(n) != gf.get(n))
        weights = {n for n, r in (*wf.items(), *gf.items()) if isinstance(r, dict) and "tree" in r} | {INDEX_JSON}
        other = [n for n in differ if n not in weights]
        if other:
            problems.append(f"file(s) differ: {', '.join(other)}")
        if not bad and not shaped and len(other) < len(differ):
            notes.append("weight files laid out otherwise (every tensor identical: the base is sharded otherwise)")
    return problems, notes


def audit(out_dir: str | Path, *, search: list[Path], cache_dir: Path, recursive: bool = False,
          threads: int = 2) -> Report:
    """Audit the merge in `out_dir` (see the module docstring).

    Raises:
        IntegrityError: no manifest, a manifest or plan edited after the merge.
        ConfigError: a plan whose fields are invalid; a --search folder that is not one.
    """
    out_dir = Path(out_dir)
    for d in search:
        if not d.is_dir():
            raise ConfigError(f"--search {d}: not a folder")
    man = load_manifest(out_dir)
    refuse_adapter_manifest(man, out_dir, "audit")
    plan = recorded_plan(man, f"{out_dir / MANIFEST}: plan")
    report = Report()
    report.say(0, f"{out_dir}: merge {man['manifest_hash'][:16]} ({plan.method}, budget {plan.budget}, "
                  f"plan {plan.plan_hash[:16]})")
    try:
        verify_outputs(out_dir, deep=True)
        report.say(1, f"output: OK ({len(man['outputs']['files'])} files reread)")
    except IntegrityError as e:
        report.mismatch(1, f"output: {e}")
    finder = Finder(Store(cache_dir), list(search), exclude=[out_dir], threads=threads)
    with tempfile.TemporaryDirectory(prefix="mergepipe-audit-") as tmp:
        run = _Audit(finder, Store(Path(tmp) / "cache"), Path(tmp), report, recursive, threads)
        try:
            produced = open_checkpoint(out_dir)
        except CheckpointError:  # its weight files are damaged (reported above): tensor hashes still compare
            produced = None
        run.merge(man, plan, produced, 1, out_dir=out_dir)
        if report.missing:  # what was looked at, to name an input whose bytes changed
            for path, h in sorted(finder.indexed.items()):
                if path not in run.used:
                    report.say(1, f"indexed, matching no input: {path} (content {h[:16]})")
    report.say(0, "audit: " + ("FAILED" if report.mismatches or report.missing else "OK")
               + (f" ({len(report.mismatches)} mismatch(es), {len(report.missing)} missing)"
                  if report.mismatches or report.missing else ""))
    return report
