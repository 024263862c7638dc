"""Group-quantized deltas (index/groupquant.py, issue 29 item 2): k-bit codes with one fp16 scale
per 64 or 128 elements. The codes and scales are the module docstring's formulas (checked
against an independent numpy spelling, bit for bit); a file is one scan of expert and base, the
same bytes whatever the thread count and whichever specs share the scan; every hostile cache
file is refused in one line naming it."""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from mergepipe.errors import IntegrityError
from mergepipe.index import groupquant as gq
from mergepipe.index.scan import _decode
from mergepipe.index.store import Store

SPECS = [gq.Spec(b, g) for b in gq.BITS for g in gq.GROUPS]


def _reference(d: np.ndarray, spec: gq.Spec) -> tuple[bytes, np.ndarray]:
    """The module docstring's quantizer spelled in plain numpy (not the compiled kernels)."""
    d = np.where(np.isfinite(d), d, np.float32(0)).astype(np.float32)
    n, g, k = d.size, spec.group, spec.bits
    levels = 1 << (k - 1)
    pad = np.zeros(gq.n_groups(n, g) * g, np.float32)
    pad[:n] = d
    groups = np.abs(pad).reshape(-1, g)
    if k == 1:
        sizes = np.full(len(groups), g)
        sizes[-1] = n - g * (len(groups) - 1)
        raw = np.array([np.float32(2.0 * math.fsum(map(float, row)) / m) for row, m in zip(groups, sizes, strict=True)],
                       np.float32)
    else:
        raw = groups.max(axis=1) / np.float32(levels)
    half = np.minimum(raw, np.float32(65504)).astype("<f2")
    s = np.repeat(half.astype(np.float32), g)[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.abs(d) / s, 0)
    j = np.minimum(levels - 1, np.floor(q)).astype(np.int64) if k > 1 else np.zeros(n, np.int64)
    neg = (d < 0).astype(np.int64)
    codes = (neg << (k - 1)) | j
    per = 8 // k
    packed = np.zeros(gq.code_bytes(n, k), np.uint8)
    for i in range(per):
        part = codes[i::per]
        packed[:part.size] |= (part << (i * k)).astype(np.uint8)
    value = (j + np.float32(0.5)).astype(np.float32) * s
    value = np.where(neg == 1, -value, value).astype(np.float32)
    return half.tobytes() + packed.tobytes(), value


def _deltas(rng: np.random.Generator, n: int) -> np.ndarray:
    d = (rng.standard_normal(n) * np.exp(rng.uniform(-4, 4, n)) * 1e-3).astype(np.float32)
    d[rng.random(n) < 0.1] = 0
    if n > 8:  # NaN and Inf (a plan with `nonfinite: allow`) as 0, -0, a value past fp16, a subnormal
        d[0], d[1], d[2], d[3], d[4] = np.nan, -np.inf, -0.0, 1e6, 1e-42
    return d


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_quantize_is_the_documented_formula_and_round_trips(spec):
    rng = np.random.default_rng(spec.bits * 1000 + spec.group)
    for n in (1, 7, 63, 64, 65, 129, 1000, 4099):
        d = _deltas(rng, n)
        payload, r2 = gq.quantize(d, spec)
        want_payload, want_value = _reference(d, spec)
        assert len(payload) == gq.block_cost(n, spec)
        assert payload == want_payload, (spec, n)
        got = gq.dequantize(payload, n, spec)
        assert got.dtype == np.float32 and np.array_equal(got, want_value), (spec, n)
        finite = np.where(np.isfinite(d), d, 0).astype(np.float64)
        assert r2 == pytest.approx(math.fsum((finite - got) ** 2), rel=1e-12, abs=1e-30)
        big = np.abs(finite) > 1e-30  # a sign code: the element's sign where it moved
        assert np.array_equal(np.sign(got[big]), np.sign(finite[big]))


def test_more_bits_and_smaller_groups_keep_more_of_a_delta():
    rng = np.random.default_rng(3)
    d = (rng.standard_normal(1 << 14) * rng.uniform(0.1, 3, 1 << 14) * 1e-3).astype(np.float32)
    err = {s: gq.quantize(d, s)[1] for s in SPECS}
    for g in gq.GROUPS:
        assert err[gq.Spec(1, g)] > err[gq.Spec(2, g)] > err[gq.Spec(4, g)] > err[gq.Spec(8, g)]
    assert err[gq.Spec(8, 64)] < 1e-3 * float(np.sum(d.astype(np.float64) ** 2))
    # k = 1: each element is +-mean|d| of its group (the L2-best scale of sign codes, up to fp16)
    got = gq.dequantize(gq.quantize(d, gq.Spec(1, 64))[0], d.size, gq.Spec(1, 64))
    mean = np.abs(d).reshape(-1, 64).mean(axis=1)
    assert np.allclose(np.abs(got).reshape(-1, 64), mean[:, None], rtol=1e-3)


def test_a_spec_outside_the_formats_choices_is_refused():
    for bad in (gq.Spec(3, 64), gq.Spec(4, 32), gq.Spec(16, 128)):
        with pytest.raises(ValueError, match="bits must be one of"):
            bad.check()


def _inputs(tiny_family, tmp_path, k=0):
    store = Store(tmp_path / "cache")
    root = tiny_family["root"]
    base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
    expert, index = store.model_index(root / f"expert_{k}", block_bytes=16 << 10)
    return store, base, base_index, expert, index, store.delta_index(base, base_index, expert, index)


def _build(tmp_path, inputs, specs, threads, sub):
    store, base, base_index, expert, index, delta = inputs
    paths = {s: gq.cache_path(tmp_path / sub, index.content_hash, base_index.content_hash, base_index.layout.key, s)
             for s in specs}
    gq.build(paths, base, base_index, expert, index, delta, threads=threads)
    return paths


def _open(path, inputs, spec):
    _, _, base_index, _, index, _ = inputs
    return gq.GroupQuant(path, expert=index.content_hash, base=base_index.content_hash, base_index=base_index,
                         spec=spec)


def test_one_scan_gives_the_same_bytes_at_any_thread_count(tiny_family, tmp_path):
    inputs = _inputs(tiny_family, tmp_path)
    specs = [gq.Spec(1, 64), gq.Spec(4, 128), gq.Spec(8, 64)]
    one = _build(tmp_path, inputs, specs, 1, "t1")
    many = _build(tmp_path, inputs, specs, 4, "t4")
    alone = _build(tmp_path, inputs, [gq.Spec(4, 128)], 3, "alone")
    for s in specs:
        assert one[s].read_bytes() == many[s].read_bytes()
        assert not list(one[s].parent.glob(".*tmp*"))  # no temp file left beside the published ones
    assert alone[gq.Spec(4, 128)].read_bytes() == one[gq.Spec(4, 128)].read_bytes()
    assert len({p.read_bytes() for p in one.values()}) == len(specs)


def test_the_file_decodes_each_block_to_its_quantized_delta(tiny_family, tmp_path):
    inputs = _inputs(tiny_family, tmp_path, k=1)
    _, base, base_index, expert, _, delta = inputs
    spec = gq.Spec(2, 64)
    opened = _open(_build(tmp_path, inputs, [spec], 2, "c")[spec], inputs, spec)
    from mergepipe.checkpoint.safetensors import CheckpointReader
    seen = 0
    with CheckpointReader(base) as br, CheckpointReader(expert) as er:
        for name, entry in base_index.tensors.items():
            t = base.tensors[name]
            for b, (r0, r1) in enumerate(entry.ranges):
                if delta.tensors[name].identical[b]:
                    assert not opened.has(name, b)
                    continue
                n = (r1 - r0) * (t.numel // t.shape[0] if t.shape else 1)
                d = (_decode(er.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32))
                     - _decode(br.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32)))
                payload, r2 = gq.quantize(d, spec)
                assert np.array_equal(opened.delta(name, b, n), gq.dequantize(payload, n, spec))
                assert opened.residual_sq(name, b) == r2 and opened.cost(name, b) == gq.block_cost(n, spec)
                seen += 1
    assert seen > 10
    opened.close()


def _split(raw: bytes) -> tuple[bytes, dict]:
    (hlen,) = struct.unpack("<Q", raw[-16:-8])
    return raw[:len(raw) - 16 - hlen], json.loads(raw[len(raw) - 16 - hlen:-16])


def _join(payload: bytes, head: dict) -> bytes:
    h = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    return payload + h + struct.pack("<Q", len(h)) + gq.MAGIC


def _first_block(head: dict) -> tuple[str, int]:
    return next((t, b) for t, rows in head["tensors"].items() for b, r in enumerate(rows) if r is not None)


def _edit_header(key):
    def edit(payload, head):
        t, b = _first_block(head)
        row = head["tensors"][t][b]
        if key == "bits":
            head["bits"] = 2
        elif key == "expert":
            head["expert"] = "0" * 64
        elif key == "nbytes":
            row[1] += 2
        elif key == "offset":
            row[0] += 1
        elif key == "r2":
            row[2] = -1.0
        elif key == "digest":
            row[3] = 5
        elif key == "tensor":
            head["tensors"]["no.such.tensor"] = [None]
        elif key == "blocks":
            head["tensors"][t].append(None)
        return payload, head
    return edit


HOSTILE = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "magic": lambda raw: raw[:-8] + b"MPSKETCH",
    "huge header length": lambda raw: raw[:-16] + struct.pack("<Q", 1 << 40) + raw[-8:],
    "not json": lambda raw: (lambda p, h: p + b"{not json" + struct.pack("<Q", 9) + gq.MAGIC)(*_split(raw)),
    "trailing payload": lambda raw: _join(*(lambda p, h: (p + b"\0" * 7, h))(*_split(raw))),
    **{f"header {k}": (lambda k: lambda raw: _join(*_edit_header(k)(*_split(raw))))(k)
       for k in ("bits", "expert", "nbytes", "offset", "r2", "digest", "tensor", "blocks")},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_cache_file_is_refused_in_one_line(tiny_family, tmp_path, case):
    inputs = _inputs(tiny_family, tmp_path)
    spec = gq.Spec(4, 64)
    path = _build(tmp_path, inputs, [spec], 2, "h")[spec]
    path.write_bytes(HOSTILE[case](path.read_bytes()))
    with pytest.raises(IntegrityError) as e:
        _open(path, inputs, spec)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg and "delete it" in msg, msg


def test_a_damaged_payload_is_caught_when_its_block_is_read(tiny_family, tmp_path):
    inputs = _inputs(tiny_family, tmp_path)
    spec = gq.Spec(8, 128)
    path = _build(tmp_path, inputs, [spec], 2, "p")[spec]
    raw = bytearray(path.read_bytes())
    _, head = _split(bytes(raw))
    t, b = _first_block(head)
    raw[head["tensors"][t][b][0] + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    opened = _open(path, inputs, spec)  # the header is intact
    n = next(m for m in range(1, 1 << 22) if gq.block_cost(m, spec) == head["tensors"][t][b][1])
    with pytest.raises(IntegrityError, match=r"does not match its blake3") as e:
        opened.delta(t, b, n)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(IntegrityError, match="bytes for"):
        opened.delta(t, b, n + 1000)
    opened.close()


def test_a_cache_that_cannot_take_the_file_leaves_nothing(tiny_family, tmp_path):
    from mergepipe.errors import OutputError
    inputs = _inputs(tiny_family, tmp_path)
    blocked = tmp_path / "ro"
    blocked.write_text("a file where the cache folder would be")
    with pytest.raises(OutputError):
        _build(tmp_path, inputs, [gq.Spec(4, 64)], 2, "ro")
    assert blocked.read_text().startswith("a file")


def test_the_distortion_bench_orders_the_kinds_and_a_full_budget_is_the_plain_merge(tiny_family, tmp_path):
    """bench/representation_distortion.py on the tiny family: more bits, less error; the
    sketch strategy's selection with any representation's residuals reads every block in full
    at the full budget (zero error), and stays within every smaller budget."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import representation_distortion as rd
    root = tiny_family["root"]
    _, base, base_index, experts = rd._inputs(tmp_path / "cache", root / "base",
                                              [root / f"expert_{k}" for k in range(3)], 64 << 10)
    reps, _ = rd.build_representations(tmp_path / "reps", base, base_index, experts)
    cands, residual = rd.candidates(base, base_index, experts, reps)
    full = sum(c.cost for c in cands)
    budgets = {"25%": full // 4, "100%": full}
    sels = rd.selections(cands, residual, budgets, list(experts))
    delta_err, errs = rd.measure(base, base_index, experts, reps, sels)
    for g in gq.GROUPS:
        chain = [delta_err[gq.Spec(b, g).name] for b in gq.BITS]
        assert chain == sorted(chain, reverse=True) and chain[-1] < 0.01
    assert delta_err["gq2g64"] < delta_err["sketch"]
    assert len({v for v in sels[("25%", rd.QUANT)].values()}) > 1  # the allocation mixes kinds
    cost = {(c.expert, c.tensor, c.block): c.cost for c in cands}
    for (label, rep), sel in sels.items():
        spent = sum(cost[k] if v == "full" else residual[v][k][1] for k, v in sel.items())  # quant: a kind per block
        assert spent <= budgets[label]
        if label == "100%":
            assert set(sel.values()) == {"full"} and len(sel) == len(cands)
            assert errs.rel((label, rep), "ta") == 0 and errs.rel((label, rep), "ties") == 0
        else:
            assert 0 < errs.rel((label, rep), "ta") < 1
    for opened in reps.values():
        for r in opened.values():
            r.close()
