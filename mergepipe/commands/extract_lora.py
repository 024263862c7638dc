"""`mergepipe extract-lora EXPERT --base BASE (--rank R | --energy F) -o OUT`: a PEFT LoRA adapter
of BASE from a dense fine-tune, one tensor at a time (docs/design.md, "LoRA extraction").

Checks everything the headers tell (names, shapes, the rank against every target, the output
folder) before reading a weight; then reads each tensor of both models once, factors the changed
targets (`threads` tensors in flight, each factorization on one intra-op thread, results taken in
name order, so the bytes do not depend on `threads`), and publishes the folder atomically.
"""
from __future__ import annotations

import math
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mergepipe.checkpoint.lora import is_adapter
from mergepipe.checkpoint.lora_extract import Extracted, Item, RankRule, extract, one_thread, plan_extraction
from mergepipe.checkpoint.safetensors import Checkpoint, CheckpointReader, open_checkpoint
from mergepipe.commands.adapter_run import base_table_hash
from mergepipe.errors import ConfigError, IntegrityError, OutputError
from mergepipe.output.adapter_out import ADAPTER_KIND
from mergepipe.output.extracted_adapter import EXTRACT_FORMAT, AdapterWriter, write_extract_manifest
from mergepipe.output.manifest import MANIFEST, load_manifest, refuse_other_replay, verify_outputs
from mergepipe.output.publish import Publisher
from mergepipe.output.safety import WriteInputs, check_output_path, refuse_overlap, replaceable
from mergepipe.util.canonical import canonical_blake3


@dataclass(frozen=True, slots=True)
class ExtractRun:
    manifest: dict
    factored: int
    whole: int
    unchanged: int


def rank_rule(rank: int | None, energy: float | None) -> RankRule:
    """Raises: ConfigError: neither or both, a rank below 1, an energy outside (0, 1]."""
    if (rank is None) == (energy is None):
        raise ConfigError("give one of --rank R and --energy F")
    if rank is not None and rank < 1:
        raise ConfigError(f"--rank {rank}: must be at least 1")
    if energy is not None and not (math.isfinite(energy) and 0 < energy <= 1):
        raise ConfigError(f"--energy {energy}: must be in (0, 1], the fraction of ||delta||^2 to keep")
    return RankRule(rank, energy)


def _open_input(path: Path, what: str) -> Checkpoint:
    if is_adapter(path):
        raise ConfigError(f"{path}: {what} is a LoRA adapter folder (adapter_config.json); extract-lora reads a "
                          "dense model folder")
    return open_checkpoint(path)


def _check_out(out: Path, inputs: tuple[Path, ...]) -> Path:
    """The output folder (output/safety.py's rules): never an input, inside one or holding one; an
    existing folder only if it is empty or an adapter mergepipe wrote with nothing else there (a
    merged model is not replaced by an adapter). There is no --force: nothing else is replaced."""
    from mergepipe.commands.stack import stacked_sources
    out = check_output_path(out, what="-o")
    refuse_overlap(out, WriteInputs(models=inputs, sources=stacked_sources(inputs)))
    if not (out.exists() or out.is_symlink()):
        return out
    why = replaceable(out)
    if why is None and any(out.iterdir()) and not ((out / MANIFEST).is_file()
                                                   and load_manifest(out).get("kind") == ADAPTER_KIND):
        why = "is a mergepipe output but not an adapter"
    if why is not None:
        raise OutputError(f"{out}: output folder {why}; refusing to replace it (choose a new folder)")
    return out


def _in_order(items: list[Item], work: Callable[[Item], Extracted], threads: int) -> Iterator[Extracted]:
    """work(item) for each item, at most `threads` at once, results in the items' order."""
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="extract")
    try:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= max(1, threads):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _input_record(path: str, ckpt: Checkpoint, hashes: dict[str, str]) -> dict:
    return {"path": path, "tensor_table": base_table_hash(ckpt), "tensors_blake3": canonical_blake3(hashes)}


def extract_lora(expert_path: str | Path, base_path: str | Path, out: str | Path, *, rule: RankRule,
                 keep: list[str], embed_lora: bool, threads: int = 2,
                 log: Callable[[str], None] = lambda _: None) -> ExtractRun:
    """Extract, publish and verify; `log` gets one line per factored module and per whole tensor.

    Raises:
        ConfigError: an adapter given as a model, a rank that does not fit, a pattern matching
        nothing, an expert with no changed target.
        CheckpointError: missing or malformed inputs, pickle-only folders, names, shapes or dtypes
        that differ, NaN or Inf.
        OutputError: the output folder cannot be replaced.
    """
    expert_path, base_path = Path(expert_path), Path(base_path)
    expert, base = _open_input(expert_path, "EXPERT"), _open_input(base_path, "--base")
    out = _check_out(Path(out), (expert_path, base_path))
    items = plan_extraction(expert, base, rule=rule, keep=keep, embed_lora=embed_lora)
    targets = sum(1 for i in items if i.target is not None)
    hashes: tuple[dict[str, str], dict[str, str]] = ({}, {})
    counts = {"factored": 0, "whole": 0, "unchanged": 0}
    publisher = Publisher(out)
    with publisher as tmp:
        writer = AdapterWriter(tmp)
        try:
            with CheckpointReader(expert, random_access=False) as er, \
                    CheckpointReader(base, random_access=False) as br, one_thread():
                seen = 0
                for x in _in_order(items, lambda item: extract(item, er, br, rule), threads):
                    hashes[0][x.item.name], hashes[1][x.item.name] = x.expert_blake3, x.base_blake3
                    seen += x.item.target is not None
                    if x.changed:
                        writer.add(x)
                    kind = "unchanged" if not x.changed else "whole" if x.whole is not None else "factored"
                    counts[kind] += 1
                    if kind == "factored":
                        log(f"[{seen}/{targets}] {x.item.module}: rank {x.a.shape[0]} of {x.full_rank}, "
                            f"retained energy {x.energy:.6f}")
                    elif kind == "whole":
                        log(f"{x.item.name}: kept whole")
            if not writer.ranks:
                raise ConfigError(f"{expert_path}: no LoRA target (2-D weight) differs from the base's; nothing to "
                                  "extract")
            recipe = {"extract": {"format": EXTRACT_FORMAT, "rank_rule": rule.recipe(), "embed_lora": embed_lora,
                                  "modules_to_save": sorted(set(keep))}}
            report = {"format": EXTRACT_FORMAT, "rank_rule": rule.recipe(), "embed_lora": embed_lora,
                      "modules_to_save": sorted(set(keep)), "unchanged_tensors": counts["unchanged"]}
            outputs = writer.finish(report)
        finally:
            writer.close()
        inputs = {"expert": _input_record(str(expert_path), expert, hashes[0]),
                  "base": _input_record(str(base_path), base, hashes[1])}
        write_extract_manifest(tmp, recipe, inputs, outputs)  # last: a folder with a manifest is finished
        publisher.commit()
    return ExtractRun(verify_outputs(out), counts["factored"], counts["whole"], counts["unchanged"])


def is_extracted(man: dict) -> bool:
    """A manifest of extract-lora's (an adapter whose recipe says how it was extracted)."""
    return man.get("kind") == ADAPTER_KIND and isinstance(man.get("recipe"), dict) and "extract" in man["recipe"]


def check_recorded_inputs(out_dir: Path, man: dict, root: Path, *, replay: bool, threads: int = 2) -> list[str]:
    """`verify --inputs/--replay` of an extracted adapter: each input's tensor table and every
    tensor's bytes rehashed against the record, and with `replay` the extraction run again into a
    temporary folder and its outputs compared.

    Raises:
        IntegrityError: an input that is not the recorded bytes, or a replay that differs.
    """
    where = out_dir / MANIFEST
    try:
        recorded = {k: man["inputs"][k] for k in ("expert", "base")}
        recipe = man["recipe"]["extract"]
        paths = {k: _resolve(v["path"], root) for k, v in recorded.items()}
        rule = RankRule(**recipe["rank_rule"])
    except (KeyError, TypeError):
        raise IntegrityError(f"{where}: inputs or recipe malformed; not a mergepipe extract-lora manifest") from None
    for k, path in paths.items():
        ckpt = _open_input(path, k)
        if base_table_hash(ckpt) != recorded[k]["tensor_table"] or _tensors_blake3(ckpt) != recorded[k][
                "tensors_blake3"]:
            raise IntegrityError(f"{path}: the {k}'s tensors are not the recorded ones (edited or another model)")
    checked = ["expert and base tensors rehashed"]
    if replay:
        with tempfile.TemporaryDirectory(prefix="mergepipe-verify-") as tmp:
            again = extract_lora(paths["expert"], paths["base"], Path(tmp) / "replay", rule=rule,
                                 keep=list(recipe["modules_to_save"]), embed_lora=bool(recipe["embed_lora"]),
                                 threads=threads).manifest
        refuse_other_replay(out_dir, man, again)
        checked.append("replay identical")
    return checked


def _tensors_blake3(ckpt: Checkpoint) -> str:
    from blake3 import blake3
    hashes = {}
    with CheckpointReader(ckpt, random_access=False) as reader:
        for name in sorted(ckpt.tensors.names):
            t = ckpt.tensors[name]
            hashes[name] = blake3(reader.read_range(t, t.begin, t.end)).hexdigest()
    return canonical_blake3(hashes)


def _resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p
