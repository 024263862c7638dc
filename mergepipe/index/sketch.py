"""Ternary delta sketches: a 2-bit-per-element summary of an expert's update, read where
the budget cannot afford the expert's block itself (plan strategy `sketch`).

For block b of expert k (the index's row ranges), with delta d = W_k - W_0 in fp32:

    code_i  = +1 where d_i > 0, -1 where d_i < 0, 0 where d_i == 0 (or not finite)
    alpha_b = fp32(sum_i |d_i| / nnz_b)          (nnz_b: the non-zero elements)
    sketch  = alpha_b * code                      (the L2-best scale for these codes)

A full fine-tune with Adam moves almost every weight by a similar amount, so the sign
pattern holds most of the update (EVAL.md: ~77% of its energy on SmolLM2 experts) at an
eighth of a bf16 block's bytes. The residual energy a sketch leaves is, from the delta
index's exact block l2 and these two sums, ||d||^2 - 2 alpha S1 + nnz alpha^2 (S1 = sum |d|).

S1 is summed exactly (each |d| split into an integer mantissa and an exponent, mantissas
summed per exponent: integers below 2^53, so any order gives the same value; then an
exactly rounded fsum), so alpha is the same on every CPU whatever numpy's vector width.

File (one per (expert, base, block layout), in the store's `sketch/` folder):
    codes of every sketched block, each starting on a byte (4 codes per byte, element i of
    the block in bits 2*(i % 4), 1 = +1, 2 = -1), then the canonical JSON header, then the
    header's length (u64 little endian) and the magic b"MPSKETCH". The header lists, per
    tensor, per block, [offset, nbytes, alpha, s1, nnz, blake3 of the codes] (null for a
    block identical to the base). Its blake3 is the artifact hash a plan records; each
    block's codes are checked against their digest when the merge reads them. No torch here.
"""
from __future__ import annotations

import math
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from blake3 import blake3

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, Checkpoint, CheckpointReader
from mergepipe.errors import IntegrityError
from mergepipe.index.cache import CacheLayout
from mergepipe.index import trailed
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.index.scan import _decode
from mergepipe.index.store import cache_write_error
from mergepipe.util.fs import FILE_MODE, canonical_json, fsync_dir
from mergepipe.util.progress import Progress

SKETCH_FORMAT = 1
MAGIC = b"MPSKETCH"
SCALE_BYTES = 4  # alpha, fp32: counted with the codes as what a sketched block costs
SCAN_THREADS = 2  # preads and the C scan release the GIL; the file's bytes do not depend on it
IN_FLIGHT = 8     # blocks being sketched at once (bounded memory: ~2 MiB of reads each)

# byte -> its four codes as int8 (+1, -1, 0) in one uint32 (little-endian: element 0 first):
# one 4-byte gather per code byte unpacks a block in a few passes
_LUT = np.zeros((256, 4), np.int8)
for _byte in range(256):
    for _j in range(4):
        _LUT[_byte, _j] = (0, 1, -1, 0)[(_byte >> (2 * _j)) & 3]
_LUT32 = _LUT.view("<u4").reshape(256)


def code_bytes(n: int) -> int:
    """Bytes of the codes of an n-element block."""
    return (n + 3) // 4


def sketch_cost(n: int) -> int:
    """Expert-I/O bytes a sketched n-element block costs: its codes and its scale."""
    return code_bytes(n) + SCALE_BYTES


def exact_abs_sum(d: np.ndarray) -> float:
    """sum |d| of finite fp32 values, exactly rounded and independent of summation order.

    Each |d_i| = mantissa_i * 2^(e_i - 150) with an integer mantissa < 2^24 (the implicit
    bit added for normals; subnormals scale as e = 1): the mantissas are summed per biased
    exponent, integers below 2^53 for blocks of < 2^29 elements, so exact in any order; then
    an exactly rounded fsum over the (at most 255) exponents."""
    return _fsum_exponents(_mantissa_sums(d))


def _mantissa_sums(d: np.ndarray) -> np.ndarray:
    """Per biased exponent, the sum of the integer mantissas of |d| (exact: float64 integers)."""
    bits = np.ascontiguousarray(d, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    exp = bits >> np.uint32(23)
    mant = (bits & np.uint32(0x7FFFFF)) | ((exp > 0).astype(np.uint32) << np.uint32(23))
    return np.bincount(exp, weights=mant, minlength=1)


def _fsum_exponents(sums: np.ndarray) -> float:
    """The exactly rounded sum of sums[e] * 2^(max(e, 1) - 150); each integer is split in two
    32-bit halves so every term is exact as a float."""
    terms = []
    for e, v in enumerate(sums.tolist()):
        v = int(v)
        if v:
            terms += [math.ldexp(v >> 32, max(e, 1) - 118), math.ldexp(v & 0xFFFFFFFF, max(e, 1) - 150)]
    return math.fsum(terms)


def pack_codes(d: np.ndarray) -> bytes:
    """The ternary codes of d, four per byte."""
    codes = (d > 0).astype(np.uint8) | ((d < 0).astype(np.uint8) << 1)
    pad = -codes.size % 4
    if pad:
        codes = np.concatenate([codes, np.zeros(pad, np.uint8)])
    q = codes.reshape(-1, 4)
    return (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).tobytes()


def unpack(codes: bytes, n: int, alpha: float) -> np.ndarray:
    """The sketched delta of an n-element block, fp32."""
    signs = _LUT32[np.frombuffer(codes, np.uint8)].view(np.int8)[:n]
    out = signs.astype(np.float32)
    out *= np.float32(alpha)  # +-alpha exactly, +0.0 where the code is 0
    return out


def block_sketch(d: np.ndarray) -> tuple[bytes, float, float, int]:
    """(codes, alpha, s1, nnz) of one block's fp32 delta; NaN/Inf elements (a plan with
    `nonfinite: allow`) are sketched as 0."""
    d = np.where(np.isfinite(d), d, np.float32(0))
    return _finish(pack_codes(d), _mantissa_sums(d), int(np.count_nonzero(d)))


def _finish(codes: bytes, sums: np.ndarray, nnz: int) -> tuple[bytes, float, float, int]:
    """(codes, alpha, s1, nnz) from the per-exponent mantissa sums (exact_abs_sum's)."""
    s1 = _fsum_exponents(sums)
    alpha = float(np.float32(s1 / nnz)) if nnz else 0.0
    return codes, alpha, s1, nnz


def residual_sq(l2: float, alpha: float, s1: float, nnz: int) -> float:
    """||d - alpha * code||^2 from the block's exact l2 and the sketch's sums (>= 0)."""
    return max(0.0, l2 * l2 - 2.0 * alpha * s1 + nnz * alpha * alpha)


def cache_path(root: Path, expert_hash: str, base_hash: str, layout_key: int | str) -> Path:
    key = blake3(f"{expert_hash}:{base_hash}:{layout_key}:v{SKETCH_FORMAT}".encode()).hexdigest()[:40]
    return CacheLayout(root).sketch(key)


class _TempFile:
    """The temp file a sketch is written to, beside its cache path; renamed over it only when
    complete, removed otherwise. Every OSError of the writes, the fsync and the rename (disk
    full, quota, file size limit, read-only cache) is the store's one-line cache error."""

    BUFFER_BYTES = 1 << 20  # small blocks' codes are written in runs of this size, not one call each

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd, self.tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        except OSError as e:
            raise cache_write_error(path, e) from None
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.done = False

    def write(self, data: bytes) -> None:
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= self.BUFFER_BYTES:
            self._flush()

    def _flush(self) -> None:
        view = memoryview(b"".join(self.pending))
        self.pending, self.pending_bytes = [], 0
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            raise cache_write_error(self.path, e) from None

    def publish(self) -> None:
        self._flush()
        try:
            os.fchmod(self.fd, FILE_MODE)  # readable by every user of a shared cache, as the index files
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise cache_write_error(self.path, e) from None
        self.done = True
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Close and remove the temp file: after a failed write nothing half-written is left."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def build(path: Path, base: Checkpoint, base_index: ModelIndex, expert: Checkpoint, expert_index: ModelIndex,
          delta: DeltaIndex, *, counter=None, progress: Progress | None = None, bf16_scan=None) -> None:
    """Scan base and expert once and write the sketch file atomically (temp file, fsync, rename).
    `bf16_scan`: the compiled scan of a bf16 block (methods/_ckernels.py sketch_bf16, passed in:
    the index layer does not import methods), else numpy. Blocks are sketched on a few threads
    (preads and the C scan release the GIL) and written in the base index's order, so the file
    is the same whatever the thread count or backend.

    Raises:
        OutputError: the cache cannot take the file (index/store.py cache_write_error); no
            file, temp or partial, is left.
    """
    out = _TempFile(path)
    try:
        tensors: dict[str, list] = {}
        offset = 0
        with CheckpointReader(base, counter=counter, random_access=False) as br, \
                CheckpointReader(expert, counter=counter, random_access=False) as er, \
                ThreadPoolExecutor(max_workers=SCAN_THREADS) as pool:

            def one(name: str, t, r0: int, r1: int):
                n = (r1 - r0) * (t.numel // t.shape[0] if t.shape else 1)
                got = _sketch_rows(br.read_rows(name, r0, r1), er.read_rows(name, r0, r1), t.dtype, n, bf16_scan)
                if progress:
                    progress.step(2 * n * t.itemsize)
                return got

            jobs = []  # (tensor, None for an identical block, or the future of its sketch)
            for name, entry in base_index.tensors.items():
                t = base.tensors[name]
                if t.dtype not in FLOAT_DTYPES or t.numel == 0:
                    continue
                same = delta.tensors[name].identical
                tensors[name] = []
                for b, (r0, r1) in enumerate(entry.ranges):
                    jobs.append((name, None if same[b] else pool.submit(one, name, t, r0, r1)))
                    if len(jobs) >= IN_FLIGHT:  # bounded memory: write the oldest first
                        offset = _write_done(out, jobs, tensors, offset, IN_FLIGHT // 2)
            _write_done(out, jobs, tensors, offset, 0)
        if progress:
            progress.step(progress.total - progress.done)  # identical blocks were not read: end the line
        header = canonical_json({"format": SKETCH_FORMAT, "expert": expert_index.content_hash,
                                 "base": base_index.content_hash, "layout": base_index.layout.key,
                                 "tensors": tensors})
        out.write(trailed.trailer(header, MAGIC))
        out.publish()
    except BaseException:
        if not out.done:
            out.discard()
        raise


def _write_done(out: _TempFile, jobs: list, tensors: dict[str, list], offset: int, keep: int) -> int:
    """Write the oldest sketches until `keep` jobs are left; returns the next code offset."""
    while len(jobs) > keep:
        name, fut = jobs.pop(0)
        if fut is None:
            tensors[name].append(None)
            continue
        codes, alpha, s1, nnz = fut.result()
        out.write(codes)
        tensors[name].append([offset, len(codes), alpha, s1, nnz, blake3(codes).hexdigest()])
        offset += len(codes)
    return offset


def _sketch_rows(base_raw, expert_raw, dtype: str, n: int, bf16_scan=None) -> tuple[bytes, float, float, int]:
    """block_sketch of one block from its raw bytes: bf16 by `bf16_scan` where given (the
    same values), anything else through numpy."""
    if dtype != "BF16" or bf16_scan is None:
        w0 = _decode(base_raw, dtype, np.empty(n, np.float32))
        wk = _decode(expert_raw, dtype, np.empty(n, np.float32))
        return block_sketch(wk - w0)
    codes, sums, nnz = bf16_scan(np.frombuffer(base_raw, np.uint16), np.frombuffer(expert_raw, np.uint16))
    return _finish(codes.tobytes(), sums, nnz)


def header_digest(path: Path) -> str | None:
    """The blake3 of a sketch file's header (what plans record), or None for any other file
    (gc's test of what it may remove and what a kept plan references)."""
    return trailed.header_digest(path, MAGIC)


class Sketch:
    """An opened sketch file: its header checked; codes read (and checked) per block."""

    def __init__(self, path: Path, *, expert: str, base: str, base_index: ModelIndex):
        self.path = path
        self.payload, raw, head = trailed.read_header(path, MAGIC, "sketch", "no sketch trailer")
        self.digest = blake3(raw).hexdigest()
        if not (isinstance(head, dict) and head.get("format") == SKETCH_FORMAT and head.get("expert") == expert
                and head.get("base") == base and head.get("layout") == base_index.layout.key
                and isinstance(head.get("tensors"), dict)):
            raise IntegrityError(f"{path}: a sketch of other inputs or another format; delete it")
        self.tensors: dict[str, list] = head["tensors"]
        for name, rows in self.tensors.items():
            entry = base_index.tensors.get(name)
            if entry is None or not isinstance(rows, list) or len(rows) != len(entry.ranges):
                raise IntegrityError(f"{path}: tensor {name!r} does not match the base's blocks; delete it")
            for r in rows:
                if r is not None and not _valid_row(r, self.payload):
                    raise IntegrityError(f"{path}: tensor {name!r} has a malformed block record; delete it")
        self._fd: int | None = None
        self._open_lock = threading.Lock()

    def has(self, tensor: str, block: int) -> bool:
        rows = self.tensors.get(tensor)
        return rows is not None and block < len(rows) and rows[block] is not None

    def stats(self, tensor: str, block: int) -> tuple[float, float, int]:
        """(alpha, s1, nnz) of a sketched block."""
        _, _, alpha, s1, nnz, _ = self.tensors[tensor][block]
        return float(alpha), float(s1), int(nnz)

    def delta(self, tensor: str, block: int, n: int) -> np.ndarray:
        """The sketched delta (fp32, n elements) of one block, its codes checked."""
        codes, alpha = self.codes(tensor, block, n)
        return unpack(codes, n, alpha)

    def codes(self, tensor: str, block: int, n: int) -> tuple[bytes, float]:
        """(codes, alpha) of one block of n elements, the codes checked against their blake3."""
        off, nbytes, alpha, _, _, digest = self.tensors[tensor][block]
        if nbytes != code_bytes(n):
            raise IntegrityError(f"{self.path}: tensor {tensor!r} block {block}: {nbytes} code bytes for "
                                 f"{n} elements; delete it")
        with self._open_lock:  # reader threads share one descriptor (pread has no file position)
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            fd = self._fd
        codes = os.pread(fd, nbytes, off)  # the codes start the file
        if len(codes) != nbytes or blake3(codes).hexdigest() != digest:
            raise IntegrityError(f"{self.path}: tensor {tensor!r} block {block}: the codes do not match their "
                                 "blake3 (damaged or edited); delete it")
        return codes, float(alpha)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _valid_row(r: object, payload: int) -> bool:
    if not (isinstance(r, list) and len(r) == 6):
        return False
    off, nbytes, alpha, s1, nnz, digest = r
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, nbytes, nnz))
    floats = all(isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                 for v in (alpha, s1))
    # alpha is the float32 of s1 / nnz (_finish): a scale edited or damaged alone is not trusted
    return (ints and floats and off + nbytes <= payload and isinstance(digest, str) and len(digest) == 64
            and float(np.float32(alpha)) == float(alpha)
            and float(alpha) == (float(np.float32(s1 / nnz)) if nnz else 0.0))
