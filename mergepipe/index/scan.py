"""The delta scan of one (expert, base, tensor): per-block statistics and histogram in
pass 1, exact |delta| rank cuts in pass 2, split counts by a rescan where the sparse
table outgrows BLOCK_COUNTS_CAP (the method is described in index/build.py). One class
with its numeric helpers: the passes share the block cache and the thread's tables.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np
from blake3 import blake3

from mergepipe.checkpoint.safetensors import CheckpointReader, TensorInfo
from mergepipe.errors import CheckpointError
from mergepipe.index import ckernels
from mergepipe.index.ranks import requested_ranks
from mergepipe.index.records import TensorDelta
from mergepipe.util.progress import Progress

HI_BINS = 1 << 15  # sign bit is 0 for |x|
SMALL_NUMEL = 4096  # tensors this small take DeltaTensorScan._run_small (a sort, not the histogram passes)


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's three fp32 work buffers of n elements (reused: no allocation per block)."""
    bufs = getattr(_tables, "scratch", None)
    if bufs is None or bufs.shape[1] < n:
        bufs = _tables.scratch = np.empty((3, max(n, 1 << 18)), dtype=np.float32)
    return bufs[0, :n], bufs[1, :n], bufs[2, :n]


def _decode(buf: bytearray, dtype: str, out: np.ndarray) -> np.ndarray:
    """A block's elements as fp32 in `out`, exactly as torch's .float() makes them."""
    if dtype == "BF16":  # bf16 is the upper half of an fp32
        np.left_shift(np.frombuffer(buf, np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
        return out
    src = np.frombuffer(buf, {"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype])
    out[...] = src  # fp16 -> fp32 exact; fp64 -> fp32 round to nearest even, as torch
    return out


def _add_sums(sums: list[float], bb: float, ee: float, be: float) -> None:
    sums[0] += bb  # each a block's sum in a fixed order (ckernels): the same on every CPU
    sums[1] += ee
    sums[2] += be


def _kernels():
    return ckernels.kernels()  # C, or numba where the library was not built


class DeltaTensorScan:
    """The passes for one (expert, base, tensor): stats and histogram, exact cuts, (rarely) split counts."""

    def __init__(self, base_r: CheckpointReader, exp_r: CheckpointReader, t: TensorInfo,
                 ranges: list[tuple[int, int]], exp_hashes: tuple[str, ...] | None, cache_bytes: int,
                 ranks: tuple[int, ...] | None = None) -> None:
        self.base_r, self.exp_r, self.t, self.ranges = base_r, exp_r, t, ranges
        # the ranks 0 < r < numel to cut at, ascending: the index's (requested_ranks), or
        # those a config asks for beyond them (index/extra_cuts.py); the same passes either way
        self.wanted = requested_ranks(t.numel) if ranks is None else ranks
        self.exp_hashes = exp_hashes  # None: hash the expert's blocks here (its ModelIndex is being built)
        self.hashes: list[str] = []
        self.progress: Progress | None = None
        self.keep = t.numel * 4 <= cache_bytes
        self.cache: list[np.ndarray | None] = []

    def _delta(self, base_buf: bytearray, exp_buf: bytearray, hist: np.ndarray | None = None,
               keep: bool = False) -> tuple[np.ndarray, tuple]:
        """int32 patterns of |expert - base| in fp32 (non-negative: integer order is float order),
        in a scratch buffer, or a new array when `keep` (it is cached between passes), and the
        block's statistics (nnz, nonfinite, sum b^2, sum e^2, sum b*e, finite sum d^2, sum d),
        the upper 16 bits counted into `hist` unless None; one kernel pass."""
        n = len(exp_buf) // self.t.itemsize
        b, e, d = _scratch(n)
        if keep:
            d = np.empty(n, dtype=np.float32)
        if self.t.dtype == "BF16":
            stats = _kernels().delta_bf16(np.frombuffer(base_buf, np.uint16), np.frombuffer(exp_buf, np.uint16),
                                          d, hist)
        else:
            stats = _kernels().delta_f32(_decode(base_buf, self.t.dtype, b), _decode(exp_buf, self.t.dtype, e),
                                         d, hist)
        return d.view(np.int32), stats

    def _read(self, i: int) -> tuple[bytearray, bytearray]:
        a, b = self.ranges[i]
        return self.base_r.read_rows(self.t.name, a, b), self.exp_r.read_rows(self.t.name, a, b)

    def _first_read(self, i: int) -> tuple[bytearray, bytearray]:
        """Block i of base and expert, read for the first pass: the expert's block hash is
        taken (or checked against its index) from the same bytes."""
        base_buf, exp_buf = self._read(i)
        digest = blake3(exp_buf).hexdigest()
        self.hashes.append(digest)
        if self.progress:
            self.progress.step(len(exp_buf))
        if self.exp_hashes is not None and digest != self.exp_hashes[i]:
            raise CheckpointError(f"{self.t.file}: tensor {self.t.name!r} rows {self.ranges[i]} changed while indexing")
        return base_buf, exp_buf

    def _bits(self, i: int) -> np.ndarray:
        if self.keep:
            return self.cache[i]
        base_buf, exp_buf = self._read(i)
        return self._delta(base_buf, exp_buf)[0]

    def _nonidentical(self) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(len(self.ranges)):
            if not self.identical[i]:
                yield i, self._bits(i)

    def run(self) -> TensorDelta:
        if self.t.numel <= SMALL_NUMEL and self.keep:
            return self._run_small()
        t = self.t
        n_blocks = len(self.ranges)
        block_l2, block_max = [0.0] * n_blocks, [0.0] * n_blocks
        block_nnz, identical = [0] * n_blocks, [False] * n_blocks
        block_n = [(b - a) * (t.numel // max(1, t.shape[0])) if t.shape else 1 for a, b in self.ranges]
        hist = np.zeros(HI_BINS, dtype=np.int64)
        l1 = l2sq = 0.0
        nonfinite = 0
        sums = [0.0, 0.0, 0.0]  # sum W0^2, sum Wk^2, sum W0*Wk
        for i in range(n_blocks):
            base_buf, exp_buf = self._first_read(i)
            if base_buf == exp_buf:
                identical[i] = True
                hist[0] += block_n[i]
                self.cache.append(None)
                base = _decode(base_buf, t.dtype, _scratch(block_n[i])[0])
                _add_sums(sums, *_kernels().slerp_sums(base, base))
                continue
            bits, (nnz, bad, bb, ee, be, sq, block_l1) = self._delta(base_buf, exp_buf, hist, keep=self.keep)
            values = bits.view(np.float32)
            _add_sums(sums, bb, ee, be)
            block_nnz[i] = nnz
            nonfinite += bad  # |x| >= inf in the bit order: Inf and NaN
            # norms of the finite part (NaN/Inf are counted in `nonfinite`), so that a plan made
            # with `nonfinite: allow` stays finite JSON; fp64 sums in a fixed order (ckernels.py)
            block_l2[i] = math.sqrt(sq)
            block_max[i] = float(values.max()) if values.size else 0.0
            l1 += block_l1
            l2sq += block_l2[i] ** 2
            self.cache.append(bits if self.keep else None)
        self.identical = identical

        ranks = [0, *self.wanted]
        wanted = np.array(ranks[1:], dtype=np.int64)
        cum_desc = np.cumsum(hist[::-1])
        target_bins = np.unique(HI_BINS - 1 - np.searchsorted(cum_desc, wanted))
        keys, counts = self._exact_values(target_bins, identical, block_n)
        # walk the present values from the largest down: elements above each one, and
        # above-or-equal, both increasing, so a rank's value is one searchsorted away
        keys, counts = keys[::-1], counts[::-1]
        slot = keys >> 16
        above_bin = t.numel - np.cumsum(hist)[target_bins]  # elements in higher bins
        run_total = np.cumsum(counts)
        slot_start = np.searchsorted(-slot, -np.arange(len(target_bins)), side="left")
        before_in_bin = run_total - counts - np.concatenate([[0], run_total])[slot_start[slot]]
        gt = above_bin[slot] + before_in_bin
        at = np.searchsorted(gt + counts, wanted, side="left")
        v_bits = ((target_bins[slot[at]] << 16) | (keys[at] & 0xFFFF)).astype(np.int32)
        values = [math.inf, *v_bits.view(np.float32).tolist()]
        count_gt = [0, *gt[at].tolist()]
        count_eq = [0, *counts[at].tolist()]
        splits = np.flatnonzero((gt[at] < wanted) & (wanted < gt[at] + counts[at]))  # cut inside a run of ties
        split = {int(j) + 1: v_bits[j] for j in splits}
        block_eq = self._block_eq(split, identical, block_n) if split else {}
        return TensorDelta(t.name, t.numel, l1, math.sqrt(l2sq), nonfinite, tuple(block_l2), tuple(block_max),
                           tuple(block_nnz), tuple(identical), tuple(ranks), tuple(values), tuple(count_gt),
                           tuple(count_eq), block_eq, *sums)

    def _run_small(self) -> TensorDelta:
        """`run` for a tensor of at most SMALL_NUMEL elements, with the same result: the rank cuts
        from one sort of its |delta| patterns instead of a 2^15-bin histogram and a counting pass,
        whose fixed cost (~0.4 ms) dominated checkpoints of many tiny tensors (MoE, norms, biases)."""
        t = self.t
        n_blocks = len(self.ranges)
        block_l2, block_max = [0.0] * n_blocks, [0.0] * n_blocks
        block_nnz, identical = [0] * n_blocks, [False] * n_blocks
        block_n = [(b - a) * (t.numel // max(1, t.shape[0])) if t.shape else 1 for a, b in self.ranges]
        l1 = l2sq = 0.0
        nonfinite = 0
        sums = [0.0, 0.0, 0.0]
        kernels = _kernels()
        parts: list[np.ndarray] = []
        for i in range(n_blocks):
            base_buf, exp_buf = self._first_read(i)
            if base_buf == exp_buf:
                identical[i] = True
                self.cache.append(None)
                base = _decode(base_buf, t.dtype, _scratch(block_n[i])[0])
                _add_sums(sums, *kernels.slerp_sums(base, base))
                parts.append(np.zeros(block_n[i], dtype=np.int32))
                continue
            bits, (nnz, bad, bb, ee, be, sq, block_l1) = self._delta(base_buf, exp_buf, keep=True)
            values = bits.view(np.float32)
            _add_sums(sums, bb, ee, be)
            block_nnz[i] = nnz
            nonfinite += bad  # Inf and NaN patterns
            block_l2[i] = math.sqrt(sq)
            block_max[i] = float(values.max()) if values.size else 0.0
            l1 += block_l1
            l2sq += block_l2[i] ** 2
            self.cache.append(bits)
            parts.append(bits)
        self.identical = identical
        ranks = [0, *self.wanted]
        values_out, count_gt, count_eq, block_eq = [math.inf], [0], [0], {}
        if len(ranks) > 1:
            asc = np.sort(np.concatenate(parts))
            wanted = np.array(ranks[1:], dtype=np.int64)
            v_bits = asc[t.numel - wanted]  # the wanted-th largest
            hi = np.searchsorted(asc, v_bits, side="right")
            lo = np.searchsorted(asc, v_bits, side="left")
            gt, eq = t.numel - hi, hi - lo
            values_out += v_bits.view(np.float32).tolist()
            count_gt += gt.tolist()
            count_eq += eq.tolist()
            for j in np.flatnonzero((gt < wanted) & (wanted < gt + eq)):  # a cut inside a run of ties
                v = v_bits[j]
                block_eq[int(j) + 1] = tuple(
                    (block_n[i] if v == 0 else 0) if identical[i] else int(np.count_nonzero(self.cache[i] == v))
                    for i in range(n_blocks))
        return TensorDelta(t.name, t.numel, l1, math.sqrt(l2sq), nonfinite, tuple(block_l2), tuple(block_max),
                           tuple(block_nnz), tuple(identical), tuple(ranks), tuple(values_out), tuple(count_gt),
                           tuple(count_eq), block_eq, *sums)

    def _exact_values(self, bins: np.ndarray, identical: list[bool],
                      block_n: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Every |delta| pattern present in the target bins, as ascending keys (slot << 16 | low 16
        bits, slot = position in `bins`), and how many elements have it.

        Counted block by block into a sparse table, which also leaves each block's own
        counts of those patterns (few: bf16 deltas repeat) in `self.block_counts`, so
        that split cuts need no third pass; past BLOCK_COUNTS_CAP entries it gives up on
        that (fp32 deltas are mostly distinct) and _block_eq scans again."""
        m = len(bins)
        stride = m + 1
        slot_of_bin = np.full(HI_BINS, m, dtype=np.int64)  # slot m: every other bin, ignored
        slot_of_bin[bins] = np.arange(m)
        table = _count_table("block", stride << 16, self.t.numel)
        total = _count_table("tensor", stride << 16, self.t.numel)
        occupied = np.empty(min(max(block_n, default=0), stride << 16) + 1, dtype=np.int64)
        seen: list[np.ndarray] = []
        self.block_counts: dict[int, tuple[np.ndarray, np.ndarray]] | None = {}
        recorded = 0
        for i, bits in self._nonidentical():
            n = _kernels().count_low(bits, slot_of_bin, table, occupied, 0)
            j = occupied[:n].copy()
            c = table[j].astype(np.int64)
            table[j] = 0
            before = total[j]
            seen.append(j[before == 0])
            total[j] = before + c
            if self.block_counts is not None:
                mine = j % stride != m
                order = np.argsort(j[mine])
                self.block_counts[i] = (j[mine][order], c[mine][order])
                recorded += len(order)
                if recorded > BLOCK_COUNTS_CAP:
                    self.block_counts = None
        occ = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
        counts = total[occ].astype(np.int64)
        total[occ] = 0  # the tables are reused by this thread's next tensor
        low, slot = np.divmod(occ, stride)
        keys = (slot << 16) | low
        order = np.argsort(keys)
        keys, counts = keys[order], counts[order]
        keep = keys < (m << 16)  # drop slot m
        keys, counts = keys[keep], counts[keep]
        self.slot_of_bin = slot_of_bin
        zeros_from_identical = sum(n for n, same in zip(block_n, identical) if same)
        if zeros_from_identical and m and bins[0] == 0:
            # identical blocks hold exact zeros: bin 0, low 0 (the first key when present)
            if len(keys) and keys[0] == 0:
                counts[0] += zeros_from_identical
            else:
                keys, counts = np.insert(keys, 0, 0), np.insert(counts, 0, zeros_from_identical)
        return keys, counts

    def _block_eq(self, split: dict[int, np.int32], identical: list[bool], block_n: list[int]) -> dict:
        """Per block, how many elements equal each split value."""
        positions = list(split)
        wanted = np.unique(np.array([split[j] for j in positions], dtype=np.int32))
        counts = np.zeros((len(self.ranges), len(wanted) + 1), dtype=np.int64)
        for i in range(len(self.ranges)):
            if identical[i] and wanted[0] == 0:
                counts[i, 0] = block_n[i]
        if self.block_counts is not None:
            # keys of pass 2's table: (low 16 bits) * stride + slot of the upper 16 bits
            stride = int(self.slot_of_bin.max()) + 1
            want = (wanted.astype(np.int64) & 0xFFFF) * stride + self.slot_of_bin[wanted >> 16]
            for i, (keys, c) in self.block_counts.items():
                at = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
                if len(keys):
                    counts[i, :-1] = np.where(keys[at] == want, c[at], 0)
        else:
            self._scan_equal(wanted, identical, counts)
        slot = {int(v): k for k, v in enumerate(wanted)}
        columns = counts.T.tolist()
        return {j: tuple(columns[slot[int(split[j])]]) for j in positions}

    def _scan_equal(self, wanted: np.ndarray, identical: list[bool], counts: np.ndarray) -> None:
        """counts[block, k] = elements equal to wanted[k], by one more pass over the tensor."""
        # one kernel call per layer of values that share an upper-16 bin (almost always one layer)
        layers: list[list[int]] = []
        for k, v in enumerate(wanted):
            layer = next((la for la in layers if all(wanted[x] >> 16 != v >> 16 for x in la)), None)
            if layer is None:
                layers.append(layer := [])
            layer.append(k)
        tables = []
        for layer in layers:
            index_of_bin = np.full(HI_BINS, len(wanted), dtype=np.int64)
            index_of_bin[wanted[layer] >> 16] = layer
            tables.append(index_of_bin)
        probe = np.append(wanted, np.int32(-1))  # the ignored counter's value never matches |delta|
        for i in range(len(self.ranges)):
            if identical[i]:
                continue
            bits = self._bits(i)
            for index_of_bin in tables:
                _kernels().count_equal(bits, index_of_bin, probe, counts[i])


BLOCK_COUNTS_CAP = 4 << 20  # per-block pattern counts kept per tensor (int64 key + count: 64 MiB)
_tables = threading.local()


def _count_table(name: str, size: int, numel: int) -> np.ndarray:
    """This thread's zeroed flat count table `name` of at least `size` entries (pages touched on use)."""
    dtype = np.int32 if numel < (1 << 31) else np.int64
    table = getattr(_tables, name, None)
    if table is None or table.size < size or table.dtype != dtype:
        table = np.zeros(size, dtype=dtype)
        setattr(_tables, name, table)
    return table
