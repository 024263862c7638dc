"""Scale in tensor count (issue 15): runs of small tensors are merged, copied, written and
hashed as packs (engine/packs.py). The packed engine must give the bytes and the manifest
of the tensor-by-tensor engine, for every kind of run a pack can meet (merged and copied,
bf16 and fp32, 0-d, int, zero-size, large multi-block tensors in between, two shards, a
budget that reads only some tensors, a method whose kernel is not elementwise), and it must
need a bounded number of writes, not one per tensor."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.checkpoint.safetensors import SafetensorsWriter
from mergepipe.cli import main
from mergepipe.engine import work as engine  # the work list (packable)

N_SMALL = 600  # small tensors per shard


def _tensors(g: torch.Generator, shift: float, shard: int) -> dict[str, torch.Tensor]:
    """A shard of mostly tiny tensors: every 7th identical to the base (a copied run inside a
    merged one), some fp32, 0-d and int ones, and a 3-block tensor and an empty one between runs."""
    out: dict[str, torch.Tensor] = {}
    for i in range(N_SMALL):
        name = f"s{shard}.t{i:04d}"
        x = torch.randn(1 + i % 5, generator=g)
        if i % 7 and shift:
            x = x + shift * (1 + i % 3)
        if i % 50 == 17:
            out[name] = x.float()
        elif i % 97 == 3:
            out[name] = torch.tensor(float(i % 11) + shift).bfloat16()  # 0-d
        elif i % 89 == 5:
            out[name] = torch.tensor([i, i + 1], dtype=torch.int64)
        else:
            out[name] = x.bfloat16()
        if i == 300:
            out[f"s{shard}.big"] = (torch.randn(3, 2048, generator=g) + shift).bfloat16()  # 3 blocks of 4 KiB
            out[f"s{shard}.empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return out


def _write_model(folder: Path, shift: float) -> None:
    """Two shards and their index json; each model draws the same base values."""
    folder.mkdir(parents=True)
    weight_map = {}
    for shard in (1, 2):
        g = torch.Generator().manual_seed(shard)
        tensors = _tensors(g, shift, shard)
        fname = f"model-{shard:05d}-of-00002.safetensors"
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many")
    for name, shift in (("base", 0.0), ("e1", 0.25), ("e2", -0.125)):
        _write_model(root / name, shift)
    return root


def _run(family: Path, tmp: Path, method: str, parameters: dict, budget: str) -> Path:
    cfg = {"base": str(family / "base"), "method": method, "parameters": parameters, "seed": 0,
           "experts": [{"name": "e1", "path": str(family / "e1"), "weight": 1.0},
                       {"name": "e2", "path": str(family / "e2"), "weight": 0.5}],
           "budget": budget, "block_bytes": "4KiB", "output": {"dir": str(tmp / "out")},
           "cache_dir": str(tmp / "cache")}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / "params.yaml"), "-q"]) == 0
    assert main(["verify", str(tmp / "out")]) == 0
    return tmp / "out"


@pytest.mark.parametrize(("method", "parameters", "budget"), [
    ("task_arithmetic", {}, "full"),
    ("task_arithmetic", {"lambda": 0.7, "normalize": True}, "40%"),
    ("ties", {"density": 0.5}, "full"),
    ("dare_linear", {"density": 0.8}, "60%"),
])
def test_packed_engine_gives_the_per_tensor_bytes(family, tmp_path, monkeypatch, method, parameters, budget):
    packed = _run(family, tmp_path / "packed", method, parameters, budget)
    with monkeypatch.context() as mp:
        mp.setattr(engine, "packable", lambda t, ranges: False)  # every tensor on its own
        plain = _run(family, tmp_path / "plain", method, parameters, budget)
    names = sorted(p.name for p in plain.iterdir())
    assert names == sorted(p.name for p in packed.iterdir())
    for name in names:
        assert (packed / name).read_bytes() == (plain / name).read_bytes(), name


def test_small_tensors_are_written_in_packs(family, tmp_path, monkeypatch):
    writes = []
    real = SafetensorsWriter.write_rows

    def counted(self, name, row_start, data):
        writes.append(name)
        return real(self, name, row_start, data)

    monkeypatch.setattr(SafetensorsWriter, "write_rows", counted)
    _run(family, tmp_path, "task_arithmetic", {}, "full")
    # 2 x 600 small tensors; packs break at the copied ones, the fp32 and int ones, and
    # the big tensor: a few hundred writes at most, against one per tensor (1,200+)
    assert 0 < len(writes) < 600


def test_batched_index_equals_tensor_by_tensor(family, monkeypatch):
    """Index batches (index/build.py: small tensors read in few preads, one task per batch)
    give the records and the read counts of one task per tensor."""
    from mergepipe.checkpoint.safetensors import ReadCounter, open_checkpoint
    from mergepipe.index import build

    def index(batched: bool):
        with monkeypatch.context() as mp:
            if not batched:
                mp.setattr(build, "SMALL_TENSOR_BYTES", -1)
            base, e1 = open_checkpoint(family / "base"), open_checkpoint(family / "e1")
            counter = ReadCounter()
            bi = build.build_model_index(base, block_bytes=4096, counter=counter)
            ei, delta = build.build_expert_index(base, e1, bi, block_bytes=4096, counter=counter)
            again = build.build_delta_index(base, e1, bi, ei, counter=counter)
            return bi, ei, delta, again, counter.by_file

    batched, plain = index(True), index(False)
    assert batched == plain
    assert batched[2] == batched[3]


def test_truncated_file_in_a_batch_names_the_tensor(tmp_path):
    from mergepipe.checkpoint.safetensors import open_checkpoint
    from mergepipe.errors import CheckpointError
    from mergepipe.index import build

    tensors = {f"t{i}": torch.full((3,), float(i)).bfloat16() for i in range(10)}
    (tmp_path / "m").mkdir()
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    ckpt = open_checkpoint(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])  # t9 loses its last two elements
    with pytest.raises(CheckpointError, match="'t9'.*truncated"):
        build.build_model_index(ckpt, block_bytes=4096)


@pytest.mark.parametrize("row", [("a", "BF16", (1,), ("ab" * 32,)), ('we"ird\\näme\u2028\x00', "F32", (), ()),
                                 ("x", "I64", (3, 0, 5), ("00" * 32, "ff" * 32)),
                                 ("\U0001f600", "BF16", (2**50, 0), ("h",)),
                                 ("t", "BF16", (True, 2), ("h",))])
def test_content_hash_rows_are_the_json_text(row):
    """index/records.py builds each content-hash row without json.dumps (it dominated cached
    loads of 100k tensors): the text must be json.dumps's, odd names and types included."""
    from mergepipe.index.records import TensorEntry, _row_json
    name, dtype, shape, hashes = row
    entry = TensorEntry(name, dtype, shape, tuple((0, 1) for _ in hashes), hashes)
    assert _row_json(name, entry) == json.dumps([name, dtype, list(shape), list(hashes)])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_split_merge_of_packs_is_byte_identical(family, tmp_path):
    """A part's base is a slice of the base (commands/parts.py) merged with the whole base
    index: the engine looks block counts up by name, never by position."""
    cfg = {"base": str(family / "base"), "method": "task_arithmetic", "parameters": {}, "seed": 0,
           "experts": [{"name": "e1", "path": str(family / "e1"), "weight": 1.0},
                       {"name": "e2", "path": str(family / "e2"), "weight": 0.5}],
           "budget": "50%", "block_bytes": "4KiB", "output": {"dir": str(tmp_path / "out")},
           "cache_dir": str(tmp_path / "cache")}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg))
    cache = str(tmp_path / "cache")
    plan = str(tmp_path / "plan.json")
    assert main(["plan", str(tmp_path / "params.yaml"), "-o", plan, "-q"]) == 0
    assert main(["merge", plan, "-o", str(tmp_path / "single"), "--cache-dir", cache, "-q"]) == 0
    assert main(["gc", "--cache-dir", cache, "-q"]) == 0
    for i in (3, 1, 2):
        assert main(["merge", plan, "--part", f"{i}/3", "-o", str(tmp_path / "parts"), "--cache-dir", cache,
                     "-q"]) == 0
    assert main(["gather", plan, str(tmp_path / "parts"), "--parts", "3", "-o", str(tmp_path / "split"),
                 "--cache-dir", cache, "-q"]) == 0
    assert _files(tmp_path / "single") == _files(tmp_path / "split")


def test_columnar_indexes_give_the_records_and_checks(family):
    """A decoded index is columnar (index/columns.py): the same entries, content hash and
    cache checks as the built one, and the plan's byte sums (index/read_bytes.py) equal
    the tensor-by-tensor sums."""
    from mergepipe.checkpoint.blocks import BlockLayout, row_bytes
    from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE, open_checkpoint
    from mergepipe.index import binfmt, build, store
    from mergepipe.index.columns import DeltaColumns, ModelColumns
    from mergepipe.index.read_bytes import full_read_bytes, planned_bytes
    from mergepipe.index.records import ModelIndex, TensorEntry, content_hash

    layout = BlockLayout(4096)
    base, e1 = open_checkpoint(family / "base"), open_checkpoint(family / "e1")
    bi = build.build_model_index(base, block_bytes=layout)
    ei, delta = build.build_expert_index(base, e1, bi, block_bytes=layout)
    cb, ce, cd = (binfmt.decode_model(binfmt.encode_model(bi)), binfmt.decode_model(binfmt.encode_model(ei)),
                  binfmt.decode_delta(binfmt.encode_delta(delta)))
    assert isinstance(cb.tensors, ModelColumns) and isinstance(cd.tensors, DeltaColumns)
    assert (cb, ce) == (bi, ei) and dict(cd.tensors.items()) == delta.tensors
    assert cb.tensors.content_hash() == content_hash(bi.tensors) == bi.content_hash
    assert store._model_matches(cb, base, layout) and store._delta_matches(cd, cb, ce)
    # a consistent lie: one block hash changed, the stored content hash kept
    first = next(iter(bi.tensors.values()))
    lie = ModelIndex(bi.content_hash, bi.block_bytes,
                     {**bi.tensors, first.name: TensorEntry(first.name, first.dtype, first.shape, first.ranges,
                                                            ("0" * 64,) + first.hashes[1:])})
    assert not store._model_matches(binfmt.decode_model(binfmt.encode_model(lie)), base, layout)

    reads = {n: [b for b, same in enumerate(t.identical) if not same][::2] for n, t in delta.tensors.items()
             if ei.tensors[n].dtype in FLOAT_DTYPES}
    reads = {n: bs for n, bs in reads.items() if bs}
    slow = sum((ei.tensors[n].ranges[b][1] - ei.tensors[n].ranges[b][0])
               * row_bytes(ei.tensors[n].shape, ITEMSIZE[ei.tensors[n].dtype]) for n, bs in reads.items() for b in bs)
    assert planned_bytes(reads, ce, cb, cd) == slow > 0
    same = next(n for n, t in delta.tensors.items() if any(t.identical) and ei.tensors[n].dtype in FLOAT_DTYPES)
    assert planned_bytes({same: [delta.tensors[same].identical.index(True)]}, ce, cb, cd) is None
    assert planned_bytes({first.name: [len(first.ranges)]}, ce, cb, cd) is None  # outside the tensor
    assert planned_bytes({"no such tensor": [0]}, ce, cb, cd) is None
    full = sum((r1 - r0) * row_bytes(e.shape, ITEMSIZE[e.dtype]) for n, e in ei.tensors.items()
               if e.dtype in FLOAT_DTYPES for (r0, r1), s in zip(e.ranges, delta.tensors[n].identical) if not s)
    assert full_read_bytes(ce, cd) == full


def test_header_columns_of_the_scan_equal_the_json_columns(tmp_path, monkeypatch):
    """safetensors headers are validated a column at a time (_table_of_columns), from the
    regular expression's columns or from json.loads' (the same table), whatever the order of
    the entries (sorted by data offset), zero-size tensors included; a refused header's error
    names what is wrong (_header_error)."""
    import struct
    from mergepipe.checkpoint import safetensors as st

    def write(entries: dict, data_len: int) -> Path:
        raw = json.dumps({"__metadata__": {"format": "pt"}, **entries}).encode()
        path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
        return path

    files = [
        write({"b": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]},
               "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
               "z": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [4, 4]},
               "c": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}}, 16),
        write({f"t{i}": {"dtype": "BF16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]} for i in range(50)}, 100),
    ]
    for path in files:
        fast = st.parse_header(path)
        with monkeypatch.context() as mp:
            mp.setattr(st.header_scan, "scan", lambda *a: None)  # the json.loads columns
            mp.setattr(st, "_LAST", [])  # parsed again, not the last header's entries
            slow = st.parse_header(path)
        assert fast == slow and [t.name for t in fast.tensors][:3] in (["a", "z", "b"], ["t0", "t1", "t2"])
    bad = [({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
             "b": {"dtype": "BF16", "shape": [1], "data_offsets": [4, 6]}}, 6, "gap"),
           ({"a": {"dtype": "BF16", "shape": [True], "data_offsets": [0, 2]}}, 2, "shape"),
           ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 2]}}, 2, "needs"),
           ({"a": {"dtype": "BF17", "shape": [1], "data_offsets": [0, 2]}}, 2, "dtype")]
    for entries, n, what in bad:
        with pytest.raises(st.CheckpointError, match=what):
            st.parse_header(write(entries, n))


# Branchy: a random-document generator nested in the test, one branch per JSON kind.
def test_manifest_json_is_canonical_json(monkeypatch, tmp_path):  # noqa: C901
    """The manifest's pretty JSON (output/manifest_json.py) is util.fs.canonical_json's text,
    whatever its batches; canonical_blake3 (util/canonical.py) hashes the compact text."""
    import random
    from blake3 import blake3
    from mergepipe.output import manifest_json
    from mergepipe.output.manifest_json import pretty_json
    from mergepipe.util.canonical import canonical_blake3
    from mergepipe.util.fs import canonical_json

    rng = random.Random(0)

    def value(depth: int = 0):
        k = rng.randrange(9 if depth < 4 else 5)
        if k == 0:
            return rng.randrange(-10**20, 10**20)
        if k == 1:
            return rng.choice([True, False, None, 0.0, -0.0, 1e300, 1.5, -2.25e-8])
        if k == 2:
            return "".join(rng.choice('ab\n\t"\\é\x00\u2028\U0001f600') for _ in range(rng.randrange(5)))
        if k == 3:
            return [rng.randrange(100) for _ in range(rng.randrange(4))]
        if k == 4:
            return {f"t{i}": f"{rng.getrandbits(256):064x}" for i in range(rng.randrange(4))}
        if k == 5:
            return {f"r{i}": [rng.randrange(9) for _ in range(rng.randrange(3))] for i in range(rng.randrange(4))}
        if k == 6:
            return (1, "a")
        if k == 7:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["a", "é", 'x"y', ""]) + str(i): value(depth + 1) for i in range(rng.randrange(4))}

    for i in range(2000):
        doc = value()
        if i == 1000:  # small batches: every join and flush boundary is crossed
            monkeypatch.setattr(manifest_json, "CHUNK", 2)
            monkeypatch.setattr(manifest_json, "FLUSH", 3)
        assert pretty_json(doc, indent=1) == canonical_json(doc, indent=1)
        assert canonical_blake3(doc) == blake3(canonical_json(doc)).hexdigest()
    for bad in ({1: 2}, [float("nan")], {"a": float("inf")}, {"a": {"b": {1: 2, "c": 3}}}):
        try:
            want = blake3(canonical_json(bad)).hexdigest()
        except (TypeError, ValueError) as e:
            with pytest.raises(type(e)):
                canonical_blake3(bad)
        else:
            assert canonical_blake3(bad) == want
    for doc in (value(), {"a": {"b": [1, 2]}, "c": [{1: 2}]}, {"t": {f"n{i}": "ab" for i in range(99)}}):
        path = tmp_path / "m.json"  # written a batch at a time, json.dumps' text where it decides
        manifest_json.write_pretty_json(path, doc)
        assert path.read_bytes() == canonical_json(doc, indent=1)
    for bad in ({1: 2}, [float("nan")], {"a": float("inf")}):
        try:
            want = canonical_json(bad, indent=1)
        except ValueError:
            with pytest.raises(ValueError):
                pretty_json(bad)
        else:
            assert pretty_json(bad) == want


def test_plan_object_loads_what_json_loads():
    """Plan files are loaded with plan/record.plan_object (shared one-block read lists,
    interned keys): the same values as json.loads, a repeated key's last value included."""
    from mergepipe.plan.record import plan_object
    text = ('{"reads": {"e1": {"a": [0], "b": [0], "c": [1, 2], "d": [true], "e": [0.0], "f": [1]}}, '
            '"x": {"k": 1, "k": [2]}, "experts": [{"name": "e1"}]}')
    got = json.loads(text, object_pairs_hook=plan_object)
    assert got == json.loads(text) and got["x"] == {"k": [2]}
    reads = got["reads"]["e1"]
    assert reads["a"] is reads["b"] and reads["d"] == [True] and reads["e"] == [0.0]
    from mergepipe.plan.record import loads_plan  # what `merge` loads plan files with: the same values
    fast = loads_plan(text)
    assert fast == json.loads(text) and fast["x"] == {"k": [2]}
    reads = fast["reads"]["e1"]
    assert reads["a"] is reads["b"] and reads["f"] is not reads["a"] and type(reads["d"][0]) is bool \
        and type(reads["e"][0]) is float and reads["c"] == [1, 2]


def test_canonical_int_lists_are_json_dumps():
    """util/canonical.py's text of a plan's reads (a dict of int lists) is json.dumps'."""
    from mergepipe.util.canonical import _dumps
    d = {f"t{i}": ([i, 2**70, -3] if i % 3 else []) for i in range(200)}
    d['\u00e9"x'] = [5]
    d["t7"] = d["t8"]  # shared lists, as a loaded plan has them
    assert _dumps(d) == json.dumps(d, sort_keys=True, separators=(",", ":"))
    d["t9"] = [True]  # not an int list: json.dumps' own text
    assert _dumps(d) == json.dumps(d, sort_keys=True, separators=(",", ":"))
