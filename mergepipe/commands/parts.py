"""Split merges: N independent part jobs and a gather that publishes the same bytes.

`mergepipe merge PLAN --part I/N -o PARTS_DIR` merges the I-th of N contiguous,
byte-balanced groups of the base's tensors (base order) into
`PARTS_DIR/part-I-of-N.safetensors`, with a JSON sidecar holding the plan hash,
each tensor's output hash and the part's read counters. `mergepipe gather`
copies the parts' tensors into the output layout with the engine's own writer
and hands the result to `pipeline.merge_plan`, which writes the aux files and
the manifest exactly as a one-job merge does, saves it in the store and
publishes it. Every tensor is merged by the same engine code on the same
blocks either way, and reads are counted per tensor, so output files, tensor
hashes, byte counts and manifest are byte-identical to `mergepipe merge`.

A part job whose plan is already in the store merges nothing (its sidecar says
`from_store`); the gather then restores the stored merge by hardlinks.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

from mergepipe.engine.layout import one_file_record, plan_layout
from mergepipe.engine.merge import Inputs, Realized, record_outputs, run_merge
from mergepipe.errors import ConfigError, IntegrityError, OutputError
from mergepipe.output.safety import WriteInputs, parts_inputs, refuse_inside
from mergepipe.commands.stack import stacked_sources
from mergepipe.checkpoint.safetensors import Checkpoint, CheckpointReader, SafetensorsWriter, open_checkpoint
from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.tensor_table import subset
from mergepipe.checkpoint.treehash import TensorHasher, block_sizes
from mergepipe.index.cache import MERGES, part_stem
from mergepipe.index.store import Store
from mergepipe.output import merge_store
from mergepipe.plan.record import PlanRecord, plan_json
from mergepipe.util.fs import atomic_write_bytes, hash_file

PART_SCHEMA = 2  # 2: tensor hashes are block trees (checkpoint/treehash.py), base_bytes_copied
COPY_BYTES = 64 << 20  # gather copies tensors in chunks of about this many bytes
_PART_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


MAX_PARTS = 1_000_000  # a part holds at least one tensor; no checkpoint has this many


def parse_part(spec: str) -> tuple[int, int]:
    """"I/N" -> (I, N), 1 <= I <= N <= MAX_PARTS."""
    m = _PART_RE.match(spec)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ConfigError(f"--part {spec!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    check_parts(int(m.group(2)), what=f"--part {spec!r}")
    return int(m.group(1)), int(m.group(2))


def check_parts(n: int, *, what: str, tensors: int | None = None) -> None:
    """N parts must be at least 1, at most MAX_PARTS and (given the base) at most its tensor count."""
    if n < 1:
        raise ConfigError(f"{what}: the number of parts must be at least 1")
    limit = MAX_PARTS if tensors is None else min(MAX_PARTS, max(1, tensors))
    if n > limit:
        raise ConfigError(f"{what}: {n} parts, but at most {limit} make sense"
                          + (f" (the base has {tensors} tensors)" if tensors is not None else ""))


def partition(base: Checkpoint, n: int) -> list[list[str]]:
    """The base's tensors (base order) in n contiguous groups of about equal bytes.

    A tensor goes to the group its first byte falls in, so one huge tensor makes
    some groups empty rather than being split.
    """
    total = base.total_bytes
    groups: list[list[str]] = [[] for _ in range(n)]
    done = 0
    for name, t in base.tensors.items():
        groups[min(n - 1, done * n // total) if total else 0].append(name)
        done += t.nbytes
    return groups


def part_paths(parts_dir: str | Path, i: int, n: int) -> tuple[Path, Path]:
    stem = Path(parts_dir) / part_stem(i, n)
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def part_is_ours(path: Path) -> bool:
    """A part file a part job wrote: its sidecar (`_write_json`: sorted keys, indent 1) beside
    it, recording this file's size for the .safetensors. A user's part-1-of-2.* is not."""
    sidecar = path.with_suffix(".json")
    try:
        with open(sidecar, "rb") as f:
            if not f.read(20).startswith(b'{\n "base_bytes_'):
                return False
        if path.suffix == ".json":
            return True
        return json.loads(sidecar.read_text())["file"]["size"] == path.stat().st_size
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _write_json(path: Path, obj: dict) -> None:
    atomic_write_bytes(path, (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode())


def merge_part(plan: PlanRecord, inputs: Inputs, parts_dir: str | Path, i: int, n: int, store: Store, *,
               threads: int = 2, progress: bool = False, force: bool = False) -> dict:
    """Merge part i of n into parts_dir; returns its sidecar (also written as JSON). A file
    of the part's name that a part job did not write (a user's part-1-of-2.safetensors) is
    replaced only with `force`."""
    check_parts(n, what=f"--part {i}/{n}", tensors=len(inputs.base.tensors))
    parts_dir = Path(parts_dir)
    # part files are added to -o, never replacing it; added to an input model's folder they change that model
    models = tuple(ck.root for ck in (inputs.base, *inputs.experts.values()))
    refuse_inside(parts_dir, parts_inputs(WriteInputs(models=models, sources=stacked_sources(models),
                                                      tokenizer=inputs.tokenizer_dir)), what="parts folder -o")
    parts_dir.mkdir(parents=True, exist_ok=True)
    st_path, js_path = part_paths(parts_dir, i, n)
    for p in (st_path, js_path):
        if not force and os.path.lexists(p) and (p.is_symlink() or not p.is_file() or not part_is_ours(p)):
            raise OutputError(f"{p}: exists and is not a part file mergepipe wrote; refusing to replace it "
                              "(choose another -o, or pass --force)")
    names = partition(inputs.base, n)[i - 1]
    info: dict = {"schema": PART_SCHEMA, "plan_hash": plan.plan_hash, "part": i, "parts": n,
                  "from_store": False, "tensors": {}, "base_bytes_read": 0, "base_bytes_copied": 0,
                  "expert_bytes_read": dict.fromkeys(plan.expert_names, 0)}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=parts_dir, prefix=f".part-{i}-of-{n}-") as tmp:
        if merge_store.is_stored(store.layout, plan.plan_hash):
            info["from_store"] = True
            SafetensorsWriter(Path(tmp) / "model.safetensors", [], metadata={"format": "pt"}).close()
        else:
            base = inputs.base
            sub = Checkpoint(base.root, base.files, subset(base.tensors, names))
            # one part file of these tensors in base order (the gather writes the plan's layout)
            doc = plan_json(plan)  # the part's own layout: a new plan, validated at the engine's entry
            sub_plan = {**doc, "output": {**doc["output"], "layout": one_file_record(names)}}
            sub_inputs = Inputs(sub, inputs.base_index, inputs.experts, inputs.expert_indexes, inputs.deltas,
                                cache_dir=inputs.cache_dir, sketches=inputs.sketches)
            realized = run_merge(sub_plan, sub_inputs, Path(tmp), threads=threads, progress=progress)
            info.update(tensors=realized.tensors, base_bytes_read=realized.base_bytes_read,
                        base_bytes_copied=realized.base_bytes_copied, expert_bytes_read=realized.expert_bytes_read)
            if realized.sketch_bytes_read:  # strategy sketch only: other sidecars keep their keys
                info["sketch_bytes_read"] = realized.sketch_bytes_read
        os.replace(Path(tmp) / "model.safetensors", st_path)
    info["file"] = {"blake3": hash_file(st_path), "size": st_path.stat().st_size}
    info["seconds"] = round(time.monotonic() - t0, 3)
    _write_json(js_path, info)
    return info


def _read_part(parts_dir: Path, plan: PlanRecord, i: int, n: int) -> dict:
    st_path, js_path = part_paths(parts_dir, i, n)
    try:
        info = json.loads(js_path.read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{js_path}: cannot read part {i}/{n}: {e}; run "
                             f"`mergepipe merge PLAN --part {i}/{n}` first") from None
    if info.get("schema") != PART_SCHEMA:
        raise IntegrityError(f"{js_path}: part record of another mergepipe version (schema {info.get('schema')}); "
                             "rerun the part jobs")
    if info.get("plan_hash") != plan.plan_hash or (info.get("part"), info.get("parts")) != (i, n):
        raise IntegrityError(f"{js_path}: part of another plan or split (plan {str(info.get('plan_hash'))[:16]}, "
                             f"part {info.get('part')}/{info.get('parts')}); rerun the part jobs")
    if not info.get("from_store"):
        if not st_path.is_file() or hash_file(st_path) != info["file"]["blake3"]:
            raise IntegrityError(f"{st_path}: missing or does not match {js_path.name}; rerun part {i}/{n}")
    return info


def gather(plan: PlanRecord, inputs: Inputs, parts_dir: str | Path, n: int, out_dir: str | Path, store: Store, *,
           threads: int = 2, progress: bool = False, force: bool = False, protect: tuple[Path, ...] = (),
           card: dict[str, bytes] | None = None) -> dict:
    """Assemble the n parts into out_dir and publish it as `merge_plan` does (`card`: its card
    files); returns the manifest. The output folder may not hold the parts folder or `protect`
    (the plan file)."""
    from mergepipe.commands.pipeline import merge_plan  # pipeline imports the engine; keep this module light
    parts_dir = Path(parts_dir)
    check_parts(n, what=f"--parts {n}", tensors=len(inputs.base.tensors))
    infos = [_read_part(parts_dir, plan, i, n) for i in range(1, n + 1)]

    def realize(tmp: Path) -> Realized:
        # Only called when the store has no merge of this plan.
        if any(info["from_store"] for info in infos):
            raise IntegrityError(f"{parts_dir}: the part jobs found plan {plan.plan_hash[:16]} in the store "
                                 f"({store.layout.folder(MERGES)}), but it is gone now; rerun the part jobs")
        t0 = time.monotonic()
        groups = partition(inputs.base, n)
        for i, (info, names) in enumerate(zip(infos, groups), 1):
            if sorted(info["tensors"]) != sorted(names):
                raise IntegrityError(f"{part_paths(parts_dir, i, n)[1]}: holds other tensors than part {i}/{n} "
                                     "of this base; rerun the part jobs")
        # the files a one-process merge writes (engine/ takes the plan's JSON form)
        layout, align = plan_layout(plan, inputs.base.tensors)
        file_of = {t.name: fname for fname, ts in layout.items() for t in ts}
        writers = {fname: SafetensorsWriter(tmp / fname, ts, metadata={"format": "pt"}, align_like=align.get(fname))
                   for fname, ts in layout.items()}
        realized = Realized(expert_bytes_read=dict.fromkeys(plan.expert_names, 0))
        try:
            for i, info in enumerate(infos, 1):
                _copy_part(part_paths(parts_dir, i, n)[0], info, writers, file_of, plan.layout)
                realized.base_bytes_read += info["base_bytes_read"]
                realized.base_bytes_copied += info["base_bytes_copied"]
                sk = info.get("sketch_bytes_read", 0)
                realized.sketch_bytes_read += sk if isinstance(sk, int) and not isinstance(sk, bool) and sk >= 0 else 0
                for name, nbytes in info["expert_bytes_read"].items():
                    realized.expert_bytes_read[name] += nbytes
                realized.tensors.update(info["tensors"])
            for w in writers.values():
                w.close()
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        realized.expert_bytes_read = dict(sorted(realized.expert_bytes_read.items()))
        record_outputs(tmp, layout, writers, realized, block_bytes=plan.layout)
        realized.seconds = time.monotonic() - t0 + sum(info.get("seconds", 0.0) for info in infos)
        return realized

    return merge_plan(plan, inputs, Path(out_dir), store, threads=threads, progress=progress, realize=realize,
                      force=force, protect=(*protect, parts_dir), card=card)


def _copy_part(path: Path, info: dict, writers: dict[str, SafetensorsWriter], file_of: dict[str, str],
               block_bytes: BlockLayout) -> None:
    ckpt = open_checkpoint(path)
    with CheckpointReader(ckpt, random_access=False) as r:
        for name, t in ckpt.tensors.items():
            h = TensorHasher(block_sizes(t.shape, t.dtype, block_bytes, name))
            rows = t.shape[0] if t.shape else 1
            step = max(1, COPY_BYTES // max(1, t.row_bytes())) if t.shape else 1
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                data = r.read_rows(name, r0, r1) if t.shape else r.read_range(t, t.begin, t.end)
                writers[file_of[name]].write_rows(name, r0, data)
                h.update(data)
            if h.digest().hex() != info["tensors"].get(name):
                raise IntegrityError(f"{path}: tensor {name!r} does not match its part record")

