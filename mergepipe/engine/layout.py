"""The output's file layout: which weight file each tensor goes to, in which order, where
each file's data starts, and the shard index json.

The layout is a function of the plan (`plan_layout`), never of how the base is laid out on
disk when the plan is merged: the plan's `output.layout` where it has one, else the canonical
layout of its tensors (`canonical_layout`). The planner records `output.layout`
(`layout_record`) exactly where mirroring the base's files (their names, which tensors each
holds and in which order, and each file's data start, for reflinks) differs from the
canonical layout. So the same plan hash gives the same files, whether or not the base was
re-sharded since, and two bases of one content laid out differently give two plans.

Kept apart from the engine (merge.py) so that the writer of a split merge
(commands/parts.py) and the engine share one definition of where tensors go.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate, repeat
from math import prod
from operator import itemgetter, mul, sub

from pydantic import ValidationError

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, FS_BLOCK, ITEMSIZE, Checkpoint, OutTensor, _header_json
from mergepipe.checkpoint.tensor_table import TensorTable
from mergepipe.errors import ConfigError
from mergepipe.plan.record import OutputRecord, PlanRecord

__all__ = ["OUT_DTYPES", "Layout", "OutTensor", "base_alignment", "canonical_layout", "layout_record",
           "mirror_layout", "one_file_record", "plan_layout", "shard_index_json", "usable_shard_names"]

OUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
ONE_FILE = "model.safetensors"

Layout = dict[str, list[OutTensor]]  # output file name -> its tensors, in file order

_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")


def usable_shard_names(names: list[str]) -> bool:
    """Whether the base's shard file names can name the output's shards too: each a plain
    `*.safetensors` name (so never one of the output's own files: README.md, config.json,
    manifest.json, run.json, tokenizer files, the index json), and no two alike (shards
    in different subfolders may share a name). Otherwise the output names its shards
    `model-0000i-of-0000n.safetensors`."""
    return len(set(names)) == len(names) and all(_SHARD_NAME.fullmatch(n) for n in names)


def _out_tensors(table: TensorTable, dtype: str | None) -> list[OutTensor]:
    """The table's tensors as output tensors, in table order, cast to `dtype` where float."""
    if not dtype:  # each OutTensor(name, dtype, shape) from the columns, without a Python call each
        return list(map(tuple.__new__, repeat(OutTensor), zip(table.names, table.dtypes, table.shapes)))
    d = OUT_DTYPES[dtype]
    return [OutTensor(t.name, d if t.dtype in FLOAT_DTYPES else t.dtype, t.shape) for t in table.values()]


def _split(tensors: list[OutTensor], shard_bytes: int | None) -> Layout:
    """`tensors` in order, cut into shards of at most shard_bytes (a larger tensor alone);
    one file `model.safetensors`, else `model-0000i-of-0000n.safetensors`."""
    if shard_bytes is None:
        return {ONE_FILE: tensors}
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for o in tensors:
        nbytes = ITEMSIZE[o.dtype] * prod(o.shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(o)
        size += nbytes
    if len(groups) == 1:
        return {ONE_FILE: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def mirror_layout(base: Checkpoint, *, dtype: str | None, shard_bytes: int | None) -> Layout:
    """The layout that mirrors the base: its files (and its shard names, where
    `usable_shard_names`) and tensor order, unless shard_bytes is set (then the base's
    tensor order cut by `_split`). What the planner records, where it is not canonical."""
    if shard_bytes is not None or len(base.files) == 1:
        return _split(_out_tensors(base.tensors, dtype), shard_bytes)
    names = [h.path.name for h in base.files]
    if not usable_shard_names(names):  # README.md, config.json, a/x + b/x, ...: names of our own
        n = len(names)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return {name: _out_tensors(h.table, dtype) for name, h in zip(names, base.files)}


def base_alignment(base: Checkpoint, layout: Layout) -> dict[str, int]:
    """Output file -> data start of the base file it mirrors byte for byte in its data section
    (same tensors, dtypes and shapes at the same data offsets), for SafetensorsWriter's
    `align_like`; files that mirror none (resharded, cast) are absent."""
    out: dict[str, int] = {}
    if len(layout) != len(base.files):
        return out
    for (fname, tensors), h in zip(layout.items(), base.files):
        if _mirrors(tensors, h):
            out[fname] = h.data_start
            continue
        offset, same = 0, len(tensors) == len(h.tensors)  # the definition, tensor by tensor
        for o, t in zip(tensors, h.tensors):
            same = same and (o.name, o.dtype, tuple(o.shape)) == (t.name, t.dtype, tuple(t.shape)) \
                and t.begin - h.data_start == offset
            offset += ITEMSIZE[o.dtype] * prod(o.shape)
        if same:
            out[fname] = h.data_start
    return out


def _mirrors(tensors: list[OutTensor], h) -> bool:
    """base_alignment's test in whole-column steps (C speed at 100k tensors): True only where
    the tensor-by-tensor test is; False may still be a mirror by it (shapes as lists)."""
    table = h.table  # the file's tensors as columns (checkpoint/tensor_table.py)
    if len(tensors) != len(table) or tensors != list(zip(table.names, table.dtypes, table.shapes)):
        return False
    sizes = map(mul, map(ITEMSIZE.__getitem__, map(itemgetter(1), tensors)), map(prod, map(itemgetter(2), tensors)))
    return list(map(sub, table.begins, repeat(h.data_start))) == [0, *accumulate(sizes)][:-1]


def _data_starts(aligned: dict[str, int]) -> dict[str, int]:
    """`align_like` values as the writer uses them: modulo FS_BLOCK, only 8-byte aligned ones."""
    return {f: ds % FS_BLOCK for f, ds in aligned.items() if ds % 8 == 0}


def _plain_data_start(tensors: list[OutTensor]) -> int:
    """Where the data of one file of `tensors` starts as `safetensors.save_file` writes it
    without metadata: 8 + its compact header JSON padded with spaces to a multiple of 8."""
    names, dtypes, shapes = (list(map(itemgetter(i), tensors)) for i in range(3))
    offsets = [0, *accumulate(map(mul, map(ITEMSIZE.__getitem__, dtypes), map(prod, shapes)))]
    raw = _header_json(names, dtypes, shapes, offsets[:-1], offsets[1:], None)
    return 8 + len(raw) + (-len(raw) % 8)


def _canonical_starts(layout: Layout, tensors: TensorTable, dtype: str | None) -> dict[str, int]:
    """A single canonical file whose tensors keep their dtypes starts its data where
    `_plain_data_start` puts it (where a base written so starts its data: reflinkable);
    other files right after their headers."""
    cast = dtype is not None and any(d in FLOAT_DTYPES and d != OUT_DTYPES[dtype] for d in set(tensors.dtypes))
    if cast or len(layout) != 1:
        return {}
    return {ONE_FILE: _plain_data_start(layout[ONE_FILE]) % FS_BLOCK}


def canonical_layout(tensors: TensorTable, *, dtype: str | None,
                     shard_bytes: int | None) -> tuple[Layout, dict[str, int]]:
    """The layout of a plan without `output.layout`, and each file's data start modulo FS_BLOCK
    (`_canonical_starts`): the tensors in name order (the content hash's), cut by `_split`.
    A function of the plan's content only."""
    layout = _split(sorted(_out_tensors(tensors, dtype), key=itemgetter(0)), shard_bytes)
    return layout, _canonical_starts(layout, tensors, dtype)


def _names(layout: Layout) -> list[tuple[str, list[str]]]:
    return [(f, list(map(itemgetter(0), ts))) for f, ts in layout.items()]


def layout_record(base: Checkpoint, *, dtype: str | None, shard_bytes: int | None) -> dict | None:
    """The plan's `output.layout`: the base-mirroring layout, or None where it is the
    canonical one (so plans of single-file bases in name order keep the hash they had).

    {"files": [{"name", "tensors": how many, "data_start": modulo FS_BLOCK or null}, ...],
    "order": every tensor name in output order, only where that is not name order}."""
    layout = mirror_layout(base, dtype=dtype, shard_bytes=shard_bytes)
    starts = _data_starts(base_alignment(base, layout))
    canonical = _split(sorted((t for ts in layout.values() for t in ts), key=itemgetter(0)), shard_bytes)
    if _names(layout) == _names(canonical) and starts == _canonical_starts(canonical, base.tensors, dtype):
        return None
    record: dict = {"files": [{"name": f, "tensors": len(ts), "data_start": starts.get(f)}
                              for f, ts in layout.items()]}
    order = [n for _, names in _names(layout) for n in names]
    if order != sorted(order):
        record["order"] = order
    return record


def one_file_record(names: list[str]) -> dict:
    """An `output.layout` of one file holding `names` in this order (a split merge's part file)."""
    return {"files": [{"name": ONE_FILE, "tensors": len(names), "data_start": None}], "order": list(names)}


def plan_layout(plan: PlanRecord | dict, tensors: TensorTable, *,
                where: str = "plan") -> tuple[Layout, dict[str, int]]:
    """The plan's output layout over the base's `tensors` (their dtypes and shapes; the content
    hash fixes them), and each file's data start modulo FS_BLOCK (SafetensorsWriter's
    `align_like`; absent: none). `plan`: the typed record, or its JSON form (a dict).

    Raises:
        ConfigError: `output.layout` does not name each of the base's tensors exactly once.
    """
    output = plan.output if isinstance(plan, PlanRecord) else _output_record(plan["output"], where)
    record = output.layout
    if record is None:
        return canonical_layout(tensors, dtype=output.dtype, shard_bytes=output.shard_bytes)
    outs = _out_tensors(tensors, output.dtype)
    order = record.order
    if order is None:
        outs.sort(key=itemgetter(0))
    else:
        row, listed = tensors.row_map, set(order)
        if len(order) != len(outs) or len(listed) != len(order) or not listed <= row.keys():
            odd = next((n for n in order if n not in row), None) or next(
                (n for n in tensors.names if n not in listed), None)
            raise ConfigError(f"{where}: output.layout.order does not list each tensor of the base once"
                              + (f" ({odd!r})" if odd is not None else "") + "; make the plan again")
        outs = [outs[row[n]] for n in order]
    files = record.files
    counts = [f.tensors for f in files]
    if sum(counts) != len(outs) or len({f.name for f in files}) != len(files):
        raise ConfigError(f"{where}: output.layout.files name {len(files)} files of {sum(counts)} tensors in all "
                          f"(each name once; the base has {len(outs)} tensors); make the plan again")
    bounds = list(accumulate(counts, initial=0))
    layout = {f.name: outs[a:b] for f, a, b in zip(files, bounds, bounds[1:])}
    return layout, {f.name: f.data_start for f in files if f.data_start is not None}


def _output_record(output: dict, where: str) -> OutputRecord:
    """A plan dict's `output` as its typed record (a ConfigError naming the bad key)."""
    try:
        return OutputRecord.model_validate(output)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in ("output", *err["loc"]))
        raise ConfigError(f"{where}: plan key {key}: {err['msg']}; make the plan again") from None


def shard_index_json(layout: Layout) -> bytes:
    """model.safetensors.index.json for a sharded layout (sorted, stable bytes)."""
    total = sum(prod(t.shape) * ITEMSIZE[t.dtype] for ts in layout.values() for t in ts)
    weight_map = {t.name: fname for fname, ts in layout.items() for t in ts}
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
