"""The joint-statistics scan: for a method whose registry entry declares `joint`
(methods/joint.py), one pass over the whole family before the merge computes each float
tensor's statistics, and the result is kept in the store as a content-addressed artifact
(index/joint.py, `<cache_dir>/joint/<key>.stats`).

The key (methods/joint.statistics_key: format version, method, base and expert content
hashes, block size, and the parameters, expert knobs and seed the spec names) is in the
plan (`joint.key`); the artifact's blake3 goes into the manifest. Reading: tensor by
tensor, every block of the base and of every expert (a block identical to the base is
not read: its delta is zero), through the merge's reader (engine/prefetch.py: bounded
window, every block blake3-checked against the index), once per pass of the spec.
Memory: the reader window plus one tensor's accumulator. Like the index, the scan is
not part of the merge's budget (which counts the merge's expert reads); it runs once
per family and key, later merges load it. A stored artifact is untrusted: a wrong
magic, checksum, key, tensor set or size makes it a miss, recomputed and replaced.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

from mergepipe.checkpoint.blocks import BlockLayout
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES
from mergepipe.engine.prefetch import UnitReader, prefetched, units
from mergepipe.errors import IntegrityError
from mergepipe.index import joint as artifact
from mergepipe.index.cache import CacheLayout
from mergepipe.index.store import cache_write_error
from mergepipe.methods.base import expert_knobs
from mergepipe.methods.joint import JointExpert, JointSpec, TensorContext, as_rows, run_passes, statistics_key
from mergepipe.methods.registry import Method
from mergepipe.plan.record import PlanRecord
from mergepipe.util.fs import atomic_write_bytes


@dataclass
class JointStatistics:
    key: str
    digest: str  # blake3 of the artifact's bytes (recorded in the manifest)
    tensors: dict[str, np.ndarray]  # tensor -> fp64 statistics (methods/joint.py)
    bytes_read: int  # bytes the scan read (base and experts); 0 when loaded from the store


def plan_statistics_key(plan: PlanRecord, spec: JointSpec) -> str:
    """The statistics key a plan's inputs and parameters give (what `plan.joint.key` must be)."""
    return statistics_key(spec, method=plan.method, params=plan.parameters, base_hash=plan.base.content_hash,
                          experts=[e.model_dump() for e in plan.experts], seed=plan.seed,
                          block_bytes=BlockLayout(plan.block_bytes, plan.embedding_block_bytes).key)


def joint_statistics(plan: PlanRecord, inputs, method: Method, params, *,
                     threads: int = 2) -> JointStatistics | None:
    """The family's statistics for `plan` (engine.merge.Inputs `inputs`): from the store when a
    valid artifact is there, else scanned and stored. None for a method without statistics."""
    spec = method.joint
    if spec is None or not spec.active(params):
        return None
    key = plan_statistics_key(plan, spec)
    recorded = plan.joint.key if plan.joint is not None else None
    if recorded != key:
        raise IntegrityError(f"plan {plan.plan_hash[:12]}: joint statistics key {recorded!r} is not "
                             f"the one its inputs and parameters give ({key[:12]}); make the plan again")
    contexts = _contexts(plan, inputs, params)
    cache_dir = getattr(inputs, "cache_dir", None)
    path = CacheLayout(cache_dir).joint(key) if cache_dir is not None else None
    if path is not None:
        loaded = _load(path, key, plan.method, spec, contexts)
        if loaded is not None:
            return loaded
    tensors, nbytes = _scan(spec, inputs, contexts, threads)
    data = artifact.encode(key, plan.method, {n: a.astype("<f8").tobytes() for n, a in tensors.items()})
    whole = set(contexts) == {n for n, e in inputs.base_index.tensors.items() if e.dtype in FLOAT_DTYPES}
    if path is not None and whole:  # a split merge's part scans its own tensors: not the family's artifact
        try:
            atomic_write_bytes(path, data)
        except OSError as e:
            raise cache_write_error(path, e) from None
    return JointStatistics(key, blake3(data).hexdigest(), tensors, nbytes)


def _contexts(plan: PlanRecord, inputs, params) -> dict[str, TensorContext]:
    experts = tuple(JointExpert(e.name, e.content_hash, float(e.weight), **expert_knobs(params, e.model_dump()))
                    for e in plan.experts)  # plan order is canonical (content hash)
    return {name: TensorContext(name, tuple(t.shape), experts, params, plan.seed)
            for name, t in inputs.base.tensors.items() if t.dtype in FLOAT_DTYPES}


def _load(path: Path, key: str, method: str, spec: JointSpec,
          contexts: dict[str, TensorContext]) -> JointStatistics | None:
    try:
        data = path.read_bytes()
        got_key, got_method, arrays = artifact.decode(data)
    except (OSError, ValueError):
        return None
    if got_key != key or got_method != method or not set(contexts) <= set(arrays):
        return None  # (a split merge's part uses the tensors it merges)
    tensors = {}
    for name, ctx in contexts.items():
        values = np.frombuffer(arrays[name], dtype=np.float64)
        if values.size != spec.result_size(ctx):
            return None
        tensors[name] = values
    return JointStatistics(key, blake3(data).hexdigest(), tensors, 0)


def _f32(buf: memoryview, dtype: str) -> np.ndarray:
    """A block's stored values as fp32 (the engine's `.float()`: exact for bf16/fp16)."""
    if dtype == "BF16":
        return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return np.frombuffer(buf, dtype="<f2").astype(np.float32)
    if dtype == "F64":
        return np.frombuffer(buf, dtype="<f8").astype(np.float32)
    return np.frombuffer(buf, dtype="<f4").astype(np.float32)


def _scan(spec: JointSpec, inputs, contexts: dict[str, TensorContext],
          threads: int) -> tuple[dict[str, np.ndarray], int]:
    names = [e.name for e in next(iter(contexts.values())).experts] if contexts else []
    reads = {n: {t: {b for b, same in enumerate(inputs.deltas[n].tensors[t].identical) if not same}
                 for t in contexts} for n in names}
    reader = UnitReader(inputs.base, inputs.base_index, inputs.experts, inputs.expert_indexes, reads)
    out: dict[str, np.ndarray] = {}
    try:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for name, ctx in contexts.items():
                t = inputs.base.tensors[name]
                ranges = inputs.base_index.tensors[name].ranges
                work = [(name, u) for u in units(t, ranges)]

                def blocks(t=t, ranges=ranges, work=work):
                    for (_, unit), (base_buf, got) in prefetched(pool, reader.load, work, 2 * max(1, threads)):
                        pos = 0
                        for b in unit:
                            r0, r1 = ranges[b]
                            n = (r1 - r0) * t.row_bytes()
                            base = _f32(base_buf[pos:pos + n], t.dtype)
                            pos += n
                            deltas = np.zeros((len(names), base.size), dtype=np.float32)
                            for i, e in enumerate(names):
                                buf = got.get(e, {}).get(b)
                                if buf is not None:
                                    np.subtract(_f32(buf, t.dtype), base, out=deltas[i])
                            rows = as_rows(base, ctx.shape)
                            yield r0, r1, rows, deltas.reshape((len(names),) + rows.shape)

                out[name] = run_passes(spec, ctx, blocks)
    finally:
        reader.close()
    return out, reader.base_counter.total + sum(c.total for c in reader.counters.values())
