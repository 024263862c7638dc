"""k-bit group-quantized deltas: a budget representation with one scale per group of 64 or 128
elements, where the ternary sketch (index/sketch.py) has one per 1 MiB block.

For block b of expert k (the index's row ranges, flattened row-major), d = W_k - W_0 in fp32
(NaN/Inf as 0), bits k in {1, 2, 4, 8}, group size g in {64, 128}: the block is cut into groups
of g consecutive elements (along a row wherever the row length is a multiple of g; the last
group of a block may be shorter), L = 2^(k-1) magnitude levels, and for each group G

    raw_G   = max_{i in G} |d_i| / L               (k >= 2: absmax, fp32; exact)
            = 2 * (sum_{i in G} |d_i|) / |G|        (k = 1: the L2-best scale of sign codes;
                                                     fp64 over 8 fixed lanes, then fp32)
    s_G     = fp16(raw_G)                           (round to nearest even; capped at 65504)
    j_i     = min(L - 1, floor(|d_i| / s_G))        (0 where s_G = 0; fp32 division)
    code_i  = (d_i < 0) << (k - 1) | j_i            (k bits)
    value_i = +-(j_i + 1/2) * s_G                   (fp32; a midrise quantizer: 2^k levels)

so k = 1 is a sign sketch with a per-group scale (BitDelta's codes, its scale per group), and
every step is an exactly specified IEEE operation in a fixed order: the bytes are the same on
every CPU and whatever the thread count. A block costs 2 * ceil(n / g) + ceil(n * k / 8) bytes
(scales and codes), what a budget counts when a plan reads it in place of the block.

File (one per (expert, base, block layout, k, g), in the store's `groupquant/` folder): every
quantized block's payload from byte 0 in block order (its fp16 scales, little endian, then its
codes, element i at bits k * (i mod 8/k) of byte floor(i k / 8)), then the canonical JSON header
{format, bits, group, expert, base, layout, tensors: {name: [per block: null (identical to the
base) or [offset, nbytes, r2, blake3 of the payload]]}}, then the header's length (u64 LE) and
b"MPGQUANT". r2 = ||d - value||^2 (fp64, 8 fixed lanes, element i in lane i % 8) is what a
plan weighs the representation by. The header's blake3 is the artifact hash a plan would
record. The file is untrusted cache input: opening it checks the inputs, the format, the block
counts, that the payloads tile the file in block order with each block's exact size, and r2;
each payload is checked against its blake3 when it is read. No torch here.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
from blake3 import blake3
from numba import njit

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, CheckpointReader
from mergepipe.errors import IntegrityError
from mergepipe.index.cache import CacheLayout
from mergepipe.index import trailed
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.index.scan import _decode
from mergepipe.index.sketch import _TempFile
from mergepipe.util.fs import canonical_json
from mergepipe.util.progress import Progress

FORMAT = 1
MAGIC = b"MPGQUANT"
BITS = (1, 2, 4, 8)
GROUPS = (64, 128)
SCALE_BYTES = 2  # fp16 per group
FP16_MAX = 65504.0
SCAN_THREADS = 2  # the kernels release the GIL; the files' bytes do not depend on the count
IN_FLIGHT = 8  # blocks being quantized at once (bounded memory)
LANES = 8


class Spec(NamedTuple):
    """One representation kind: k bits per element, one scale per `group` elements."""

    bits: int
    group: int

    def check(self) -> Spec:
        if self.bits not in BITS or self.group not in GROUPS:
            raise ValueError(f"group quantization: bits must be one of {BITS} and group one of {GROUPS}, "
                             f"not {self.bits} and {self.group}")
        return self

    @property
    def name(self) -> str:
        return f"gq{self.bits}g{self.group}"


def n_groups(n: int, group: int) -> int:
    return -(-n // group)


def code_bytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def block_cost(n: int, spec: Spec) -> int:
    """Bytes a quantized n-element block costs (and stores): its fp16 scales and its codes."""
    return SCALE_BYTES * n_groups(n, spec.group) + code_bytes(n, spec.bits)


@njit(nogil=True, cache=True)
def _raw_scales(d: np.ndarray, group: int, bits: int, out: np.ndarray) -> None:
    """Each group's scale before its fp16 rounding (the module docstring's raw_G)."""
    levels = np.float32(1 << (bits - 1))
    inf = np.float32(np.inf)
    lanes = np.zeros(LANES, dtype=np.float64)
    for gi in range(out.size):
        lo = gi * group
        hi = min(lo + group, d.size)
        if bits == 1:
            lanes[:] = 0.0
            for i in range(lo, hi):
                a = abs(d[i])
                lanes[(i - lo) % LANES] += np.float64(a) if a < inf else 0.0  # NaN and Inf as 0
            s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
            out[gi] = np.float32(2.0 * s / (hi - lo))
        else:
            m = np.float32(0.0)
            for i in range(lo, hi):
                a = abs(d[i])
                m = max(m, a if a < inf else np.float32(0.0))
            out[gi] = m / levels  # levels is a power of 2: exact


@njit(nogil=True, cache=True)
def _encode(d: np.ndarray, scales: np.ndarray, group: int, bits: int, c: np.ndarray) -> float:
    """Write each element's k-bit code to c (one uint8 per element) given the groups' fp32
    scales (the stored fp16 values); returns ||d - value||^2 in fp64, element i in lane i % 8
    (groups start on a multiple of 8), lanes combined pairwise."""
    top = np.float32((1 << (bits - 1)) - 1)
    inf = np.float32(np.inf)
    acc = np.zeros(LANES, dtype=np.float64)
    for gi in range(scales.size):
        s = scales[gi]
        lo = gi * group
        for i in range(lo, min(lo + group, d.size)):
            x = d[i]
            a = abs(x)
            a = a if a < inf else np.float32(0.0)  # NaN and Inf as 0
            # floor(|x| / s), capped at L - 1; 0 where s = 0 or k = 1 (one level)
            q = min(np.floor(a / s), top) if s > 0 else np.float32(0.0)
            c[i] = (np.uint8(x < 0 and a > 0) << np.uint8(bits - 1)) | np.uint8(q)
            r = np.float64(a) - np.float64((q + np.float32(0.5)) * s)  # |x| - |value|: x - value up to sign
            acc[i % LANES] += r * r
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


def _pack(c: np.ndarray, bits: int) -> bytes:
    """Codes (one per uint8, zero-padded to a whole byte's worth) packed 8/k to a byte, element
    i at bits k * (i mod 8/k)."""
    per = 8 // bits
    out = c[0::per].copy()
    for p in range(1, per):
        out |= c[p::per] << np.uint8(p * bits)
    return out.tobytes()


def _make_lut(bits: int) -> np.ndarray:
    """byte -> the signed level multipliers +-(j + 1/2) of its 8/bits codes, fp32."""
    per, levels = 8 // bits, 1 << (bits - 1)
    lut = np.zeros((256, per), np.float32)
    for byte in range(256):
        for p in range(per):
            c = (byte >> (p * bits)) & ((1 << bits) - 1)
            v = (c & (levels - 1)) + 0.5
            lut[byte, p] = -v if c >> (bits - 1) else v
    return lut


_LUTS = {b: _make_lut(b) for b in BITS}


def quantize(d: np.ndarray, spec: Spec) -> tuple[bytes, float]:
    """(payload, r2) of one block's fp32 delta: fp16 scales then codes, and ||d - decoded||^2."""
    d = np.ascontiguousarray(d, dtype=np.float32).reshape(-1)
    raw = np.empty(n_groups(d.size, spec.group), np.float32)
    _raw_scales(d, spec.group, spec.bits, raw)
    half = np.minimum(raw, np.float32(FP16_MAX)).astype("<f2")  # RNE; finite
    c = np.zeros(code_bytes(d.size, spec.bits) * (8 // spec.bits), np.uint8)
    r2 = _encode(d, half.astype(np.float32), spec.group, spec.bits, c)
    return half.tobytes() + _pack(c, spec.bits), float(r2)


def dequantize(payload: bytes, n: int, spec: Spec) -> np.ndarray:
    """The quantized delta (fp32, n elements) of a block's payload."""
    g = n_groups(n, spec.group)
    scales = np.frombuffer(payload, "<f2", count=g).astype(np.float32)
    codes = np.frombuffer(payload, np.uint8, offset=SCALE_BYTES * g)
    mult = _LUTS[spec.bits][codes].reshape(-1)[:n]
    return mult * np.repeat(scales, spec.group)[:n]


def cache_path(root: Path, expert_hash: str, base_hash: str, layout_key: int | str, spec: Spec) -> Path:
    key = f"{expert_hash}:{base_hash}:{layout_key}:b{spec.bits}:g{spec.group}:v{FORMAT}"
    return CacheLayout(root).groupquant(blake3(key.encode()).hexdigest()[:40])


def build(paths: dict[Spec, Path], base: Checkpoint, base_index: ModelIndex, expert: Checkpoint,
          expert_index: ModelIndex, delta: DeltaIndex, *, counter=None, progress: Progress | None = None,
          threads: int = SCAN_THREADS) -> None:
    """One scan of base and expert writes the file of every spec in `paths`, each atomically
    (temp file, fsync, rename). Blocks are quantized on `threads` threads and written in the
    base index's order, so the files do not depend on the thread count.

    Raises:
        OutputError: the cache cannot take a file (index/store.py cache_write_error); no
            file, temp or partial, is left.
    """
    specs = [s.check() for s in paths]
    outs: dict[Spec, _TempFile] = {}
    try:
        for s in specs:
            outs[s] = _TempFile(paths[s])
        tensors: dict[Spec, dict[str, list]] = {s: {} for s in specs}
        offsets = dict.fromkeys(specs, 0)
        with CheckpointReader(base, counter=counter, random_access=False) as br, \
                CheckpointReader(expert, counter=counter, random_access=False) as er, \
                ThreadPoolExecutor(max_workers=max(1, threads)) as pool:

            def one(name: str, t, r0: int, r1: int):
                n = (r1 - r0) * (t.numel // t.shape[0] if t.shape else 1)
                w0 = _decode(br.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32))
                wk = _decode(er.read_rows(name, r0, r1), t.dtype, np.empty(n, np.float32))
                d = wk - w0
                if progress:
                    progress.step(2 * n * t.itemsize)
                return [quantize(d, s) for s in specs]

            jobs: list = []  # (tensor, None for an identical block, or the future of its payloads)
            for name, entry in base_index.tensors.items():
                t = base.tensors[name]
                if t.dtype not in FLOAT_DTYPES or t.numel == 0:
                    continue
                same = delta.tensors[name].identical
                for s in specs:
                    tensors[s][name] = []
                for b, (r0, r1) in enumerate(entry.ranges):
                    jobs.append((name, None if same[b] else pool.submit(one, name, t, r0, r1)))
                    if len(jobs) >= IN_FLIGHT:  # bounded memory: write the oldest first
                        _write_done(outs, jobs, tensors, offsets, IN_FLIGHT // 2)
            _write_done(outs, jobs, tensors, offsets, 0)
        if progress:
            progress.step(progress.total - progress.done)
        for s in specs:
            header = canonical_json({"format": FORMAT, "bits": s.bits, "group": s.group,
                                     "expert": expert_index.content_hash, "base": base_index.content_hash,
                                     "layout": base_index.layout.key, "tensors": tensors[s]})
            outs[s].write(trailed.trailer(header, MAGIC))
        for s in specs:
            outs[s].publish()
    except BaseException:
        for out in outs.values():
            if not out.done:
                out.discard()
        raise


def _write_done(outs: dict, jobs: list, tensors: dict, offsets: dict, keep: int) -> None:
    """Write the oldest blocks' payloads until `keep` jobs are left."""
    while len(jobs) > keep:
        name, fut = jobs.pop(0)
        got = None if fut is None else fut.result()
        for i, s in enumerate(outs):
            if got is None:
                tensors[s][name].append(None)
                continue
            payload, r2 = got[i]
            outs[s].write(payload)
            tensors[s][name].append([offsets[s], len(payload), r2, blake3(payload).hexdigest()])
            offsets[s] += len(payload)


def _block_elements(entry, r0: int, r1: int) -> int:
    return (r1 - r0) * (math.prod(entry.shape) // entry.shape[0] if entry.shape else 1)


class GroupQuant:
    """An opened group-quantized file: its header checked; payloads read (and checked) per block."""

    def __init__(self, path: Path, *, expert: str, base: str, base_index: ModelIndex, spec: Spec):
        self.path, self.spec = path, spec.check()
        self.payload, raw, head = trailed.read_header(
            path, MAGIC, "group-quantized delta", "no group-quantization trailer")
        self.digest = blake3(raw).hexdigest()
        if not (isinstance(head, dict) and head.get("format") == FORMAT and head.get("bits") == spec.bits
                and head.get("group") == spec.group and head.get("expert") == expert and head.get("base") == base
                and head.get("layout") == base_index.layout.key and isinstance(head.get("tensors"), dict)):
            raise IntegrityError(f"{path}: a group-quantized delta of other inputs, settings or format; delete it")
        self.tensors: dict[str, list] = head["tensors"]
        self._check_rows(base_index)
        self._fd: int | None = None
        self._open_lock = threading.Lock()

    def _check_rows(self, base_index: ModelIndex) -> None:
        """Every block record well-formed, sized for its block, and the payloads tiling the file
        in block order (no overlap, no gap, nothing after the last)."""
        at = 0
        for name, rows in self.tensors.items():
            entry = base_index.tensors.get(name)
            if entry is None or not isinstance(rows, list) or len(rows) != len(entry.ranges):
                raise IntegrityError(f"{self.path}: tensor {name!r} does not match the base's blocks; delete it")
            for b, r in enumerate(rows):
                if r is None:
                    continue
                want = block_cost(_block_elements(entry, *entry.ranges[b]), self.spec)
                if not _valid_row(r, at, want):
                    raise IntegrityError(f"{self.path}: tensor {name!r} block {b} has a malformed record "
                                         f"(offset, size {want} bytes, r2, blake3); delete it")
                at += want
        if at != self.payload:
            raise IntegrityError(f"{self.path}: the blocks' payloads hold {at} bytes, the file {self.payload}; "
                                 "delete it")

    def has(self, tensor: str, block: int) -> bool:
        rows = self.tensors.get(tensor)
        return rows is not None and block < len(rows) and rows[block] is not None

    def residual_sq(self, tensor: str, block: int) -> float:
        """||d - decoded||^2 of a quantized block."""
        return float(self.tensors[tensor][block][2])

    def cost(self, tensor: str, block: int) -> int:
        return int(self.tensors[tensor][block][1])

    def delta(self, tensor: str, block: int, n: int) -> np.ndarray:
        """The quantized delta (fp32, n elements) of one block, its payload checked."""
        off, nbytes, _, digest = self.tensors[tensor][block]
        if nbytes != block_cost(n, self.spec):
            raise IntegrityError(f"{self.path}: tensor {tensor!r} block {block}: {nbytes} bytes for {n} elements; "
                                 "delete it")
        with self._open_lock:  # reader threads share one descriptor (pread has no file position)
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            fd = self._fd
        payload = os.pread(fd, nbytes, off)
        if len(payload) != nbytes or blake3(payload).hexdigest() != digest:
            raise IntegrityError(f"{self.path}: tensor {tensor!r} block {block}: the payload does not match its "
                                 "blake3 (damaged or edited); delete it")
        return dequantize(payload, n, self.spec)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _valid_row(r: object, at: int, nbytes_want: int) -> bool:
    if not (isinstance(r, list) and len(r) == 4):
        return False
    off, nbytes, r2, digest = r
    return (isinstance(off, int) and not isinstance(off, bool) and off == at
            and isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes == nbytes_want
            and isinstance(r2, float | int) and not isinstance(r2, bool) and math.isfinite(r2) and r2 >= 0
            and isinstance(digest, str) and len(digest) == 64)
