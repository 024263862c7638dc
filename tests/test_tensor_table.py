"""checkpoint/tensor_table.py: a checkpoint's tensors as columns behave as the dict of
TensorInfo they replace, and engine/packs.pack_runs cuts the packs PackBuilder cuts."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from mergepipe.checkpoint.safetensors import TensorInfo
from mergepipe.checkpoint.tensor_table import TensorTable, concat, subset
from mergepipe.engine.work import COPY, MERGE
from mergepipe.engine.packs import PACK_BYTES, SMALL_TENSOR_BYTES, PackBuilder, pack_runs, packable


def _table(path: Path, sizes: list[int], first: int = 0, prefix: str = "t") -> TensorTable:
    begins, pos = [], 64
    for s in sizes:
        begins.append(pos)
        pos += s
    ends = [b + s for b, s in zip(begins, sizes)]
    names = [f"{prefix}{first + i}" for i in range(len(sizes))]
    return TensorTable(names, ["U8"] * len(sizes), [(s,) for s in sizes], begins, ends, [(path, 0)])


def test_lookups_match_the_dict_of_tensor_infos(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    t = concat([_table(a, [3, 0, 5]), _table(b, [7, 2], first=3)])
    want = {f"t{i}": TensorInfo(f"t{i}", "U8", (s,), f, beg, beg + s)
            for i, (s, f, beg) in enumerate([(3, a, 64), (0, a, 67), (5, a, 67), (7, b, 64), (2, b, 71)])}
    assert dict(t.items()) == want and list(t) == list(want) and len(t) == 5 and t == want
    assert [t[n] for n in want] == list(want.values()) and t.get("nope") is None and "t4" in t
    assert t.total_bytes() == 17 and list(t.values()) == list(want.values())
    for _ in range(3 * len(t)):  # looked up one by one past a quarter of its size: kept, the same values
        assert t["t3"] == want["t3"]
    assert dict(t.items()) == want
    part = subset(t, ["t4", "t0", "t1"])
    assert list(part.items()) == [(n, want[n]) for n in ("t4", "t0", "t1")]
    other = t.with_file(tmp_path / "c.safetensors")
    assert {i.file for i in other.values()} == {tmp_path / "c.safetensors"} and other.names is t.names


def _builder_packs(table, counts, kinds, out_files):
    """The packs PackBuilder makes, tensor by tensor (the reference)."""
    out, b = [], PackBuilder(table)
    starts = [r for _, r in out_files]
    for i in range(len(table.names)):
        size = table.ends[i] - table.begins[i]
        if kinds[i] is None or not packable(size, counts[i]):
            if (done := b.flush()) is not None:
                out.append(done)
            out.append(i)
            continue
        f = max(k for k, r in enumerate(starts) if r <= i)
        offset = sum(table.ends[j] - table.begins[j] for j in range(starts[f], i))
        if (done := b.add(i, kinds[i], out_files[f][0], offset)) is not None:
            out.append(done)
    if (done := b.flush()) is not None:
        out.append(done)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_pack_runs_cut_the_packs_pack_builder_cuts(tmp_path, seed):
    rng = random.Random(seed)
    n_files = rng.choice([1, 1, 2, 3])
    tables, first = [], 0
    for f in range(n_files):
        sizes = [rng.choice([0, 2, 2, 4, 100, SMALL_TENSOR_BYTES, SMALL_TENSOR_BYTES + 2, PACK_BYTES // 3])
                 for _ in range(rng.randint(1, 60))]
        tables.append(_table(tmp_path / f"m{f}.safetensors", sizes, first))
        first += len(sizes)
    table = concat(tables)
    n = len(table.names)
    counts = [rng.choice([1, 1, 1, 2]) for _ in range(n)]
    kinds = [rng.choice([MERGE, MERGE, COPY, None]) for _ in range(n)]
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 2)))) if n > 1 else []
    out_files = [(f"out{k}.safetensors", r) for k, r in enumerate([0, *cuts])]
    got = [x if what == "row" else x for what, x in pack_runs(table, counts, kinds, out_files)]
    want = _builder_packs(table, counts, kinds, out_files)
    norm = [x if isinstance(x, int) else (x.kind, x.names, x.file, x.begin, x.end, x.out_file, x.r0, x.r1)
            for x in got]
    assert norm == [x if isinstance(x, int) else (x.kind, x.names, x.file, x.begin, x.end, x.out_file, x.r0, x.r1)
                    for x in want]
