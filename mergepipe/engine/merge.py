"""The merge engine: a plain loop that streams the plan.

For each tensor in the base's order, for each block: read the base rows and only
the planned expert rows (coalesced preads, blake3-checked against the index),
merge in fp32, cast, and pwrite at the block's offset in the output. Reader
threads prefetch a bounded window of blocks while the main thread merges, so
memory is O(window x (K+1) x block_bytes), never O(model).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from blake3 import blake3

from mergepipe.errors import IntegrityError, MethodError
from mergepipe.index.build import DeltaIndex, ModelIndex, TensorDelta
from mergepipe.engine.layout import OUT_DTYPES, output_layout, shard_index_json  # noqa: F401 (re-exported)
from mergepipe.util.memory import keep_freed_memory
from mergepipe.methods import get_method
from mergepipe.methods._common import sequential_sum
from mergepipe.methods.base import BlockInputs, ExpertBlock, RankCut
from mergepipe.methods.slerp import cosine_from_sums
from mergepipe.util.progress import Progress
from mergepipe.index.ranks import magnitude_rank
from mergepipe.checkpoint.safetensors import (DTYPES, FLOAT_DTYPES, INDEX_JSON, Checkpoint, CheckpointReader,
                                      OutTensor, ReadCounter, SafetensorsWriter, TensorInfo, as_tensor, tensor_bytes)

UNIT_BYTES = 4 << 20  # base bytes per prefetch unit: adjacent blocks read with one pread


@dataclass
class Inputs:
    """Opened checkpoints with their indexes, keyed by plan expert name."""

    base: Checkpoint
    base_index: ModelIndex
    experts: dict[str, Checkpoint]
    expert_indexes: dict[str, ModelIndex]
    deltas: dict[str, DeltaIndex]


@dataclass
class Realized:
    base_bytes_read: int = 0
    expert_bytes_read: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    files: dict[str, dict] = field(default_factory=dict)  # name -> {blake3, size}
    tensors: dict[str, str] = field(default_factory=dict)  # name -> blake3 of output bytes
    seconds: float = 0.0


def record_outputs(out_dir: Path, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter],
                   realized: Realized, *, file_hashes: dict[str, str] | None = None) -> None:
    """Record the closed weight files in `realized` (hashes from `file_hashes`, computed
    while writing, else by rereading the file); write the shard index json if sharded."""
    for fname, w in writers.items():
        realized.bytes_written += w.size
        digest = (file_hashes or {}).get(fname) or hash_file(out_dir / fname)
        realized.files[fname] = {"blake3": digest, "size": w.size}
    if len(layout) > 1:  # sharded output: the index json that transformers follows
        index_path = out_dir / INDEX_JSON
        index_path.write_bytes(shard_index_json(layout))
        size = index_path.stat().st_size
        realized.bytes_written += size
        realized.files[INDEX_JSON] = {"blake3": hash_file(index_path), "size": size}


class _OutputHasher:
    """blake3 of the output bytes, in a thread of its own, as they are written.

    Per tensor, and per file: a file's hash is fed its header and then every block
    in file order, which is the order the engine writes them in; if a block ever
    arrives out of order the file is left to `record_outputs` to reread. Hashing the
    bytes handed to pwrite instead of rereading the file saved a full pass over the
    output (`mergepipe run` still rereads the published files in its verify).
    A bounded queue keeps at most `depth` blocks alive.
    """

    def __init__(self, layout: dict[str, list[OutTensor]], writers: dict[str, SafetensorsWriter], *,
                 depth: int = 16) -> None:
        self.writers = writers
        self.file_of = {t.name: fname for fname, ts in layout.items() for t in ts}
        self.files: dict[str, blake3 | None] = {fname: blake3(w.header) for fname, w in writers.items()}
        self.next = {fname: w.data_start for fname, w in writers.items()}
        self.size = {fname: w.size for fname, w in writers.items()}
        self.tensors: dict[str, str] = {}
        self._open: dict[str, blake3] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mergepipe-hash", daemon=True)
        self._thread.start()

    def add(self, name: str, row_start: int, data) -> None:
        self._queue.put((name, row_start, data))

    def end_tensor(self, name: str) -> None:
        self._queue.put((name, -1, None))

    def finish(self) -> dict[str, str]:
        """Wait for the queue; returns file -> blake3 for the files hashed in order."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return {f: h.hexdigest() for f, h in self.files.items() if h is not None and self.next[f] == self.size[f]}

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep draining so that the producer never blocks
            try:
                self._hash(*item)
            except BaseException as e:  # re-raised in the merging thread by finish()
                self._error = e

    def _hash(self, name: str, row_start: int, data) -> None:
        if data is None:
            self.tensors[name] = self._open.pop(name, blake3()).hexdigest()
            return
        self._open.setdefault(name, blake3()).update(data)
        fname = self.file_of[name]
        h = self.files[fname]
        if h is not None:
            if self.writers[fname].offset_of(name, row_start) == self.next[fname]:
                h.update(data)
                self.next[fname] += memoryview(data).nbytes
            else:
                self.files[fname] = None


class _Cuts:
    """RankCut lookups for one (expert, tensor), from the delta index."""

    def __init__(self, td: TensorDelta, expert: str) -> None:
        self.td, self.expert = td, expert
        self.pos = {r: j for j, r in enumerate(td.ranks)}
        self.prefix: dict[int, list[int]] = {}

    def for_block(self, i: int, block_numel: int):
        def cut(rank: int) -> RankCut:
            if rank <= 0:
                return RankCut(0, float("inf"), 0)
            if rank >= self.td.numel:  # everything: every |delta| > -inf
                return RankCut(rank, float("-inf"), 0)
            j = self.pos.get(rank)
            if j is None:
                raise MethodError(f"expert {self.expert!r}, tensor {self.td.name!r}: no exact threshold for rank "
                                  f"{rank} of {self.td.numel}; densities and gammas must have at most 2 decimals")
            keep_eq = rank - self.td.count_gt[j]
            if j in self.td.block_eq:
                if j not in self.prefix:
                    acc, pre = 0, []
                    for c in self.td.block_eq[j]:
                        pre.append(acc)
                        acc += c
                    self.prefix[j] = pre
                eq_keep = max(0, min(keep_eq - self.prefix[j][i], self.td.block_eq[j][i]))
            else:
                eq_keep = block_numel if keep_eq >= self.td.count_eq[j] and keep_eq > 0 else 0
            return RankCut(rank, self.td.values[j], eq_keep)
        return cut


class _CompiledMerge:
    """bf16 blocks of task_arithmetic and TIES through mergepipe.engine.kernels: the
    torch path's fp32 arithmetic in its operation order, fused, so the same bytes
    (tests/test_merge_kernels.py). Other methods and dtypes keep the torch path."""

    METHODS = ("task_arithmetic", "ties")

    def __init__(self, method: str, params, experts: list[dict], default_density: float) -> None:
        from mergepipe.engine import kernels as merge_kernels
        self.k = merge_kernels
        self.ties = method == "ties"
        self.normalize = bool(params.normalize)
        self.lambda_ = np.float32(params.lambda_)
        self.apply_lambda = params.lambda_ != 1
        self.weight = {e["name"]: np.float32(float(e["weight"])) for e in experts}
        self.density = {e["name"]: float(e.get("density", default_density)) for e in experts}
        # task arithmetic divides by the sum of every expert's weight, read or not
        # (methods._common.combine), summed left to right in fp32 like the torch path
        divisor = sequential_sum([torch.tensor(float(e["weight"]), dtype=torch.float32) for e in experts],
                                 torch.zeros((), dtype=torch.float32))
        if divisor.abs() < 1e-8:
            divisor = torch.ones((), dtype=torch.float32)
        self.divisor = np.float32(divisor.item())

    def __call__(self, t: TensorInfo, b: int, raw: memoryview, got: dict[str, dict[int, memoryview]],
                 experts: list[dict], cuts: dict, inputs: Inputs) -> memoryview:
        present = [e["name"] for e in experts if b in got.get(e["name"], {})]
        base = np.frombuffer(raw, dtype=np.uint16)
        n = base.shape[0]
        stacked = tuple(_writable(np.frombuffer(got[name][b], dtype=np.uint16)) for name in present)
        base = _writable(base)
        weights = np.array([self.weight[name] for name in present], dtype=np.float32)
        out = np.empty(n, dtype=np.uint16)
        if not self.ties:
            self.k.task_arithmetic_bf16(base, stacked, weights, self.divisor, self.normalize, self.lambda_,
                                        self.apply_lambda, out)
            return memoryview(out).cast("B")
        modes = np.empty(len(present), dtype=np.int64)
        values = np.zeros(len(present), dtype=np.float32)
        limits = np.zeros(len(present), dtype=np.int64)
        numel = t.numel
        for i, name in enumerate(present):
            rank = magnitude_rank(self.density[name], numel)
            if rank is None or rank >= numel:
                modes[i] = self.k.KEEP_ALL
            elif rank <= 0:
                modes[i] = self.k.DROP_ALL
            else:
                key = (name, t.name)
                if key not in cuts:
                    cuts[key] = _Cuts(inputs.deltas[name].tensors[t.name], name)
                cut = cuts[key].for_block(b, n)(rank)
                if cut.rank != rank:
                    raise MethodError(f"tensor {t.name!r}, expert {name!r}: asked for the rank cut at {rank} "
                                      f"and got one at {cut.rank}; the delta index is stale, rebuild it")
                modes[i], values[i] = self.k.CUT, cut.value
                limits[i] = self._eq_limit(cuts[key], b, rank, n, cut.eq_keep, base, stacked[i], values[i])
        self.k.ties_bf16(base, stacked, weights, modes, values, limits, self.normalize, self.lambda_,
                         self.apply_lambda, out)
        return memoryview(out).cast("B")

    def _eq_limit(self, cuts: _Cuts, b: int, rank: int, n: int, eq_keep: int, base: np.ndarray,
                  expert: np.ndarray, value: np.float32) -> int:
        """Where this block stops keeping threshold-equal elements; scans the block only
        when the index says the cut splits its run of equal values (one block per tensor)."""
        if eq_keep <= 0:
            return 0
        j = cuts.pos[rank]
        if j not in cuts.td.block_eq or eq_keep >= cuts.td.block_eq[j][b]:
            return n  # every threshold-equal element of the block is kept
        return self.k.eq_limit(base, expert, value, eq_keep)


def _writable(a: np.ndarray) -> np.ndarray:
    # the kernels take a tuple of one array type; reads are bytearrays, so this never copies
    return a if a.flags.writeable else a.copy()


def _units(t: TensorInfo, ranges: tuple[tuple[int, int], ...]) -> list[list[int]]:
    """Group a tensor's blocks into prefetch units of about UNIT_BYTES."""
    units, cur, size = [], [], 0
    row_bytes = t.row_bytes()
    for b, (r0, r1) in enumerate(ranges):
        nbytes = (r1 - r0) * row_bytes
        if cur and size + nbytes > UNIT_BYTES:
            units.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += nbytes
    if cur:
        units.append(cur)
    return units


def run_merge(plan: dict, inputs: Inputs, out_dir: Path, *, threads: int = 2, progress: bool = False,
              compiled: bool = True) -> Realized:
    """Execute `plan` into `out_dir` (an empty folder, normally a publisher's temp).

    `compiled=False` merges every block through the methods' torch code (the
    reference the compiled kernels are tested against); the bytes are the same."""
    t_start = time.monotonic()
    keep_freed_memory()  # every block allocates and frees MiB-sized temporaries
    method = get_method(plan["method"])
    params = method.params.model_validate(plan["parameters"])
    experts = plan["experts"]  # canonical order (content hash)
    reads = {e["name"]: {t: set(bs) for t, bs in plan["reads"][e["name"]].items()} for e in experts}
    method_params = plan["parameters"]
    default_density = float(1.0 if method_params.get("density") is None else method_params["density"])
    default_gamma = float(0.01 if method_params.get("gamma") is None else method_params["gamma"])
    base = inputs.base
    base_counter = ReadCounter()
    exp_counters = {e["name"]: ReadCounter() for e in experts}
    layout = output_layout(base, dtype=plan["output"].get("dtype"), shard_bytes=plan["output"].get("shard_bytes"))
    out_of = {t.name: (fname, t) for fname, ts in layout.items() for t in ts}
    realized = Realized()
    writers = {fname: SafetensorsWriter(out_dir / fname, ts, metadata={"format": "pt"}) for fname, ts in layout.items()}
    base_r = CheckpointReader(base, counter=base_counter, random_access=False)
    exp_rs = {e["name"]: CheckpointReader(inputs.experts[e["name"]], counter=exp_counters[e["name"]])
              for e in experts}
    prog = Progress(base.total_bytes, "merging", progress)
    kernel = (_CompiledMerge(plan["method"], params, experts, default_density)
              if plan["method"] in _CompiledMerge.METHODS and compiled else None)

    def load(name: str, unit: list[int]) -> tuple[memoryview, dict[str, dict[int, memoryview]]]:
        t = base.tensors[name]
        ranges = inputs.base_index.tensors[name].ranges
        r0, r1 = ranges[unit[0]][0], ranges[unit[-1]][1]
        base_buf = memoryview(base_r.read_rows(name, r0, r1))
        _check(base_buf, t, ranges, unit, inputs.base_index.tensors[name].hashes, str(base.root))
        got: dict[str, dict[int, memoryview]] = {}
        for e in experts:
            wanted = [b for b in unit if b in reads[e["name"]].get(name, ())]
            if not wanted:
                continue
            bufs = exp_rs[e["name"]].read_blocks(name, [ranges[b] for b in wanted])
            hashes = inputs.expert_indexes[e["name"]].tensors[name].hashes
            for b, buf in zip(wanted, bufs):
                if blake3(buf).hexdigest() != hashes[b]:
                    raise IntegrityError(f"{inputs.experts[e['name']].tensors[name].file}: tensor {name!r} rows "
                                         f"{ranges[b][0]}:{ranges[b][1]} do not match the index (corrupted or "
                                         "modified since indexing); re-index with `mergepipe index`")
            got[e["name"]] = dict(zip(wanted, bufs))
        return base_buf, got

    work = [(name, unit) for name in base.tensors for unit in _units(base.tensors[name],
                                                                     inputs.base_index.tensors[name].ranges)]
    hasher: _OutputHasher | None = None
    try:
        hasher = _OutputHasher(layout, writers)
        with ThreadPoolExecutor(max(1, threads)) as pool, _one_torch_thread():
            window: deque[Future] = deque()
            ahead = iter(work)
            for _ in range(2 * max(1, threads)):
                nxt = next(ahead, None)
                if nxt is not None:
                    window.append(pool.submit(load, *nxt))
            cuts: dict[tuple[str, str], _Cuts] = {}
            for name, unit in work:
                base_buf, got = window.popleft().result()
                nxt = next(ahead, None)
                if nxt is not None:
                    window.append(pool.submit(load, *nxt))
                fname, out_t = out_of[name]
                t = base.tensors[name]
                _merge_unit(t, out_t, unit, base_buf, got, inputs, experts, method, params, plan["seed"],
                            default_density, default_gamma, writers[fname], hasher, cuts, kernel)
                prog.step(len(base_buf))
                if unit[-1] == len(inputs.base_index.tensors[name].ranges) - 1:
                    hasher.end_tensor(name)
                    for e in experts:
                        cuts.pop((e["name"], name), None)
        file_hashes = hasher.finish()
        realized.tensors.update(hasher.tensors)
        for name in base.tensors:  # zero-row tensors have no blocks
            if name not in realized.tensors:
                realized.tensors[name] = blake3().hexdigest()
        for w in writers.values():
            w.close()
    except BaseException:
        if hasher is not None:
            try:
                hasher.finish()
            except BaseException:
                pass  # the first error is the one to report
        for w in writers.values():
            w.abort()
        raise
    finally:
        base_r.close()
        for r in exp_rs.values():
            r.close()
    record_outputs(out_dir, layout, writers, realized, file_hashes=file_hashes)
    realized.base_bytes_read = base_counter.total
    realized.expert_bytes_read = {name: c.total for name, c in sorted(exp_counters.items())}
    realized.seconds = time.monotonic() - t_start
    return realized


def _check(buf: memoryview, t: TensorInfo, ranges, unit: list[int], hashes, where: str) -> None:
    row_bytes = t.row_bytes()
    pos = 0
    for b in unit:
        n = (ranges[b][1] - ranges[b][0]) * row_bytes
        if blake3(buf[pos:pos + n]).hexdigest() != hashes[b]:
            raise IntegrityError(f"{t.file}: tensor {t.name!r} rows {ranges[b][0]}:{ranges[b][1]} do not match "
                                 f"the index of {where} (corrupted or modified since indexing)")
        pos += n


def _merge_unit(t: TensorInfo, out_t: OutTensor, unit: list[int], base_buf: memoryview,
                got: dict[str, dict[int, memoryview]], inputs: Inputs, experts: list[dict], method, params,
                seed: int, default_density: float, default_gamma: float, writer: SafetensorsWriter,
                hasher: _OutputHasher, cuts: dict, kernel=None) -> None:
    ranges = inputs.base_index.tensors[t.name].ranges
    row_bytes = t.row_bytes()
    same_dtype = out_t.dtype == t.dtype
    pos = 0
    for b in unit:
        r0, r1 = ranges[b]
        n = (r1 - r0) * row_bytes
        raw = base_buf[pos:pos + n]
        pos += n
        shape = (r1 - r0, *t.shape[1:]) if t.shape else ()
        if t.dtype not in FLOAT_DTYPES or not any(b in got.get(e["name"], {}) for e in experts):
            # nothing to merge here: the base rows, cast if the output dtype differs
            out = raw if same_dtype else tensor_bytes(as_tensor(raw, t.dtype, shape).to(DTYPES[out_t.dtype][1]))
        elif kernel is not None and t.dtype == "BF16" and out_t.dtype == "BF16":
            out = kernel(t, b, raw, got, experts, cuts, inputs)
        else:
            base_block = as_tensor(raw, t.dtype, shape).float()
            blocks = []
            for e in experts:
                buf = got.get(e["name"], {}).get(b)
                delta = None
                if buf is not None:
                    delta = as_tensor(buf, t.dtype, shape).float() - base_block
                cut = None
                if method.magnitude:
                    key = (e["name"], t.name)
                    if key not in cuts:
                        cuts[key] = _Cuts(inputs.deltas[e["name"]].tensors[t.name], e["name"])
                    cut = cuts[key].for_block(b, base_block.numel())
                cosine = None
                if method.cosine:
                    td = inputs.deltas[e["name"]].tensors[t.name]
                    cosine = cosine_from_sums(td.base_sq, td.expert_sq, td.dot)
                blocks.append(ExpertBlock(e["name"], e["content_hash"], float(e["weight"]), delta,
                                          density=float(e.get("density", default_density)),
                                          gamma=float(e.get("gamma", default_gamma)), cut=cut, cosine=cosine))
            merged = method.fn(BlockInputs(t.name, r0, r1, t.shape, base_block, tuple(blocks), seed), params)
            out = tensor_bytes(merged.to(DTYPES[out_t.dtype][1]))
        writer.write_rows(t.name, r0, out)
        hasher.add(t.name, r0, out)


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    # Per-block ops are ~0.5M elements: too small for intra-op threads to pay, and
    # with reader threads (or other processes) on the cores, OpenMP's spinning
    # threads slowed the merge 3-5x (BENCHMARKS.md). One thread also makes any
    # reduction's order independent of the machine's core count.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hash_file(path: Path, *, chunk_bytes: int = 16 << 20) -> str:
    # Chunked reads, not update_mmap: a mapping's touched pages count in the
    # process's RSS, which then grew with the output size (BENCHMARKS.md).
    h = blake3(max_threads=blake3.AUTO)
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
