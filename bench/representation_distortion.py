"""Distortion per byte of the budget representations (issue 29, items 2 and 4): the ternary sketch
(index/sketch.py, 2 bits an element, one scale per block) against k-bit group-quantized deltas
(index/groupquant.py, k = 1, 2, 4, 8, one fp16 scale per 64 or 128 elements), on real experts.

    flock -x /tmp/cpu.lock .venv/bin/python bench/representation_distortion.py \
        --base DIR --experts DIR [DIR ...] [--block-bytes 1MiB] [--budgets 10%,25%,50%] \
        [--json bench/results/representation-distortion-<commit>.json]

Two measurements, both against the full read (every expert's exact delta):
1. Every block as one representation: bits per element, relative Frobenius error of the deltas
   (sqrt(sum_kb ||d - r||^2 / sum_kb ||d||^2)) and of the merged update
   (||M_r - M|| / ||M||, M = merged - base) for task arithmetic (lambda 1) and TIES (density 0.5,
   lambda 1), every expert weight 1.
2. At matched bytes: for each budget (a share of the full read, as `budget: 25%`), the `sketch`
   strategy's selection (plan/strategies/sketch.py: skip, representation or full read per
   block, greedy by energy per byte) with that representation's residuals and bytes in place of
   the sketch's, and `energy` (whole blocks only); the merged update's relative error, and what
   the plan predicts of it before any merge (the certified bound and the uncorrelated estimate
   from the blocks' residual norms, issue 29 item 4).

TIES on a representation: each expert's delta is trimmed by its tensor's magnitude cut of the
exact delta (the index's rank cut: the top density share of |d|), applied to the decoded values;
a ternary sketch is left untrimmed as the engine does (its elements share one magnitude; with
--untrimmed every representation is); then
sign election by the weighted sum and the disjoint mean, as methods/ties.py. Also times the scans
(sketch build against group-quantized builds) on the same inputs.
"""
from __future__ import annotations

import argparse
from collections import Counter
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, CheckpointReader  # noqa: E402
from mergepipe.index import groupquant as gq  # noqa: E402
from mergepipe.index import sketch  # noqa: E402
from mergepipe.index.scan import _decode  # noqa: E402
from mergepipe.index.store import Store  # noqa: E402
from mergepipe.plan.strategies import quant  # noqa: E402
from mergepipe.plan.strategies.registry import Candidate, PlanContext  # noqa: E402
from mergepipe.plan.strategies.sketch import SketchParams  # noqa: E402
from mergepipe.plan.strategies.sketch import select as sketch_select  # noqa: E402
from mergepipe.units import parse_bytes  # noqa: E402

SPECS = [gq.Spec(b, g) for b in gq.BITS for g in gq.GROUPS]
DENSITY = 0.5
SKETCH = "sketch"
QUANT = "quant"  # the per-block allocation over every kind
UNTRIMMED = {SKETCH}  # kinds TIES leaves untrimmed (--untrimmed: every kind)


def _inputs(cache: Path, base_dir: Path, expert_dirs: list[Path], block_bytes: int):
    store = Store(cache)
    base, base_index = store.model_index(base_dir, block_bytes=block_bytes)
    experts = {}
    for i, path in enumerate(expert_dirs):
        ckpt, index = store.model_index(path, block_bytes=block_bytes)
        experts[f"e{i}"] = (ckpt, index, store.delta_index(base, base_index, ckpt, index))
    return store, base, base_index, experts


def build_representations(root: Path, base, base_index, experts) -> tuple[dict, dict]:
    """Every expert's sketch and its 8 group-quantized files (one scan for all 8); the scan times."""
    from mergepipe.methods import _ckernels
    bf16_scan = getattr(_ckernels.load(), "sketch_bf16", None)
    times = {"sketch": 0.0, "gq4g128_alone": 0.0, "gq_all8_one_scan": 0.0}  # all8: every kind in SPECS
    for s in SPECS:  # load the compiled kernels (numba's cache) before timing: once per process
        gq.quantize(np.ones(8, np.float32), s)
    opened: dict[str, dict] = {}
    for name, (ckpt, index, delta) in experts.items():
        args = (base, base_index, ckpt, index, delta)
        sk_path = sketch.cache_path(root, index.content_hash, base_index.content_hash, base_index.layout.key)
        t0 = time.perf_counter()
        sketch.build(sk_path, *args, bf16_scan=bf16_scan)
        times["sketch"] += time.perf_counter() - t0
        one = {gq.Spec(4, 128): root / "alone" / f"{name}.gq"}
        t0 = time.perf_counter()
        gq.build(one, *args)
        times["gq4g128_alone"] += time.perf_counter() - t0
        paths = {s: gq.cache_path(root, index.content_hash, base_index.content_hash, base_index.layout.key, s)
                 for s in SPECS}
        t0 = time.perf_counter()
        gq.build(paths, *args)
        times["gq_all8_one_scan"] += time.perf_counter() - t0
        reps = {SKETCH: sketch.Sketch(sk_path, expert=index.content_hash, base=base_index.content_hash,
                                      base_index=base_index)}
        for s in SPECS:
            reps[s.name] = gq.GroupQuant(paths[s], expert=index.content_hash, base=base_index.content_hash,
                                         base_index=base_index, spec=s)
        opened[name] = reps
    return opened, {k: round(v, 3) for k, v in times.items()}


def _block_n(t, r0: int, r1: int) -> int:
    return (r1 - r0) * (t.numel // t.shape[0] if t.shape else 1)


def candidates(base, base_index, experts, reps) -> tuple[list[Candidate], dict]:
    """The planner's candidates (every expert weight 1: score = l2) in the energy order, and
    per representation (expert, tensor, block) -> (residual energy, bytes)."""
    cands, residual = [], {r: {} for r in [SKETCH, *(s.name for s in SPECS)]}
    for name, (_, index, delta) in experts.items():
        for tname, entry in base_index.tensors.items():
            t = base.tensors[tname]
            if t.dtype not in FLOAT_DTYPES or t.numel == 0:
                continue
            td = delta.tensors[tname]
            for b, (r0, r1) in enumerate(entry.ranges):
                if td.identical[b]:
                    continue
                n, l2 = _block_n(t, r0, r1), td.block_l2[b]
                cost = n * t.itemsize
                cands.append(Candidate(-l2 / cost, tname, r0, index.content_hash, name, b, cost, l2, l2))
                alpha, s1, nnz = reps[name][SKETCH].stats(tname, b)
                residual[SKETCH][(name, tname, b)] = (sketch.residual_sq(l2, alpha, s1, nnz), sketch.sketch_cost(n))
                for s in SPECS:
                    g = reps[name][s.name]
                    residual[s.name][(name, tname, b)] = (g.residual_sq(tname, b), g.cost(tname, b))
    cands.sort()
    return cands, residual


def selections(cands, residual, budgets: dict[str, int], names: list[str], times: dict | None = None) -> dict:
    """(budget, representation) -> {(expert, tensor, block): 'full' | rep}; `energy`: whole blocks;
    `quant`: a kind per block (plan/strategies/quant.py), its planning seconds in `times`."""
    out = {}
    for label, nbytes in budgets.items():
        chosen, used = {}, 0
        for c in cands:  # the energy strategy: greedy by score per byte, an item that does not fit skipped
            if used + c.cost <= nbytes:
                used += c.cost
                chosen[(c.expert, c.tensor, c.block)] = "full"
        out[(label, "energy")] = chosen
        for rep in residual:
            ctx = PlanContext(experts=tuple((n, n) for n in names), effective=dict.fromkeys(names, 1.0),
                              sketch=residual[rep])
            sel = sketch_select(cands, nbytes, ctx, SketchParams())
            got = {}
            for c, full, sk in zip(cands, sel.chosen, sel.sketched, strict=True):
                if full or sk:
                    got[(c.expert, c.tensor, c.block)] = "full" if full else rep
            out[(label, rep)] = got
        out[(label, QUANT)], took = _allocated(cands, residual, nbytes)
        if times is not None:
            times[label] = took
    return out


def _allocated(cands, residual, nbytes: int) -> tuple[dict, float]:
    """plan/strategies/quant.py's rate-distortion allocation over every kind (weights 1), and
    its seconds."""
    options = {(c.expert, c.tensor, c.block): [quant.Option(r, table[(c.expert, c.tensor, c.block)][1],
                                                            table[(c.expert, c.tensor, c.block)][0])
                                                for r, table in residual.items()] for c in cands}
    t0 = time.perf_counter()
    chosen = quant.allocate(cands, options, nbytes, dict.fromkeys(options, 1.0))
    took = time.perf_counter() - t0
    got = {}
    for c, ch in zip(cands, chosen, strict=True):
        if ch.kind != quant.NOTHING:
            got[(c.expert, c.tensor, c.block)] = "full" if ch.kind == quant.EXACT else ch.kind
    return got, took


def _ties(terms: list[np.ndarray]) -> np.ndarray:
    """TIES's sign election and disjoint mean of trimmed deltas (weights 1), lambda 1."""
    stacked = np.stack(terms)
    elected = np.sign(stacked.sum(axis=0))
    agree = (np.sign(stacked) == elected) & (stacked != 0)
    count = agree.sum(axis=0)
    return np.where(count > 0, (stacked * agree).sum(axis=0) / np.maximum(count, 1), 0).astype(np.float32)


class Errors:
    """Accumulated squared errors of each configuration's merged update against the full read's."""

    def __init__(self) -> None:
        self.sq: dict = {}
        self.ref = {"ta": 0.0, "ties": 0.0}

    def add(self, key, method: str, got: np.ndarray, want: np.ndarray) -> None:
        self.sq[(key, method)] = self.sq.get((key, method), 0.0) + float(np.sum((got - want).astype(np.float64) ** 2))

    def rel(self, key, method: str) -> float:
        return (self.sq.get((key, method), 0.0) / self.ref[method]) ** 0.5


def _merge_block(deltas: dict, decoded: dict, cuts: dict, pick: dict | None, rep: str | None):
    """(TA, TIES) merged updates of one block: each expert's exact delta, its representation
    `rep`, or nothing, by `pick` (expert -> 'full' | rep | absent); pick None: every expert as rep."""
    ta, ties = [], []
    for name, d in deltas.items():
        how = rep if pick is None else pick.get(name)
        if how is None:
            continue
        x = d if how == "full" else decoded[name][how]
        ta.append(x)
        untrimmed = how in UNTRIMMED
        ties.append(x if untrimmed else np.where(np.abs(x) >= cuts[name], x, np.float32(0)))
    if not ta:
        return None, None
    return np.sum(ta, axis=0, dtype=np.float32), _ties(ties)


def measure(base, base_index, experts, reps, sels: dict) -> tuple[dict, dict]:
    errs, delta_sq, delta_ref = Errors(), dict.fromkeys(reps[next(iter(reps))], 0.0), 0.0
    with CheckpointReader(base) as br:
        readers = {n: CheckpointReader(e[0]) for n, e in experts.items()}
        for tname, entry in base_index.tensors.items():
            t = base.tensors[tname]
            if t.dtype not in FLOAT_DTYPES or t.numel == 0:
                continue
            w0 = _decode(br.read_rows(tname, 0, t.shape[0] if t.shape else 1), t.dtype, np.empty(t.numel, np.float32))
            full = {n: _decode(r.read_rows(tname, 0, t.shape[0] if t.shape else 1), t.dtype,
                               np.empty(t.numel, np.float32)) - w0 for n, r in readers.items()}
            keep = int(DENSITY * t.numel)  # the top `density` share of |d|, per expert and tensor
            cuts = {n: (np.partition(np.abs(d), t.numel - keep)[t.numel - keep] if keep else np.inf)
                    for n, d in full.items()}
            off = 0
            for b, (r0, r1) in enumerate(entry.ranges):
                n = _block_n(t, r0, r1)
                deltas = {e: full[e][off:off + n] for e in full if not experts[e][2].tensors[tname].identical[b]}
                off += n
                if not deltas:
                    continue
                decoded = {e: {r: reps[e][r].delta(tname, b, n) for r in reps[e]} for e in deltas}
                for e, d in deltas.items():
                    d64 = d.astype(np.float64)
                    delta_ref += float(np.sum(d64 ** 2))
                    for r, x in decoded[e].items():
                        delta_sq[r] += float(np.sum((d64 - x) ** 2))
                ref_ta, ref_ties = _merge_block(deltas, decoded, cuts, dict.fromkeys(deltas, "full"), None)
                errs.ref["ta"] += float(np.sum(ref_ta.astype(np.float64) ** 2))
                errs.ref["ties"] += float(np.sum(ref_ties.astype(np.float64) ** 2))
                for r in decoded[next(iter(decoded))]:
                    ta, ties = _merge_block(deltas, decoded, cuts, None, r)
                    errs.add(("all", r), "ta", ta, ref_ta)
                    errs.add(("all", r), "ties", ties, ref_ties)
                for key, sel in sels.items():
                    pick = {e: sel[(e, tname, b)] for e in deltas if (e, tname, b) in sel}
                    ta, ties = _merge_block(deltas, decoded, cuts, pick, None)
                    zero = np.zeros(n, np.float32)
                    errs.add(key, "ta", zero if ta is None else ta, ref_ta)
                    errs.add(key, "ties", zero if ties is None else ties, ref_ties)
        for r in readers.values():
            r.close()
    return {r: (v / delta_ref) ** 0.5 for r, v in delta_sq.items()}, errs


def predicted(cands: list[Candidate], residual: dict, sel: dict, rep: str) -> tuple[float, float]:
    """What the plan alone predicts of a selection's task-arithmetic error, relative to the
    estimate sqrt(sum_kb l2^2) of the merged update (weights 1): the certified bound
    sqrt(sum_b (sum_k r_kb)^2) and the uncorrelated estimate sqrt(sum_kb r_kb^2), r_kb the norm
    an expert's block leaves out (0 read in full, its representation's residual, l2 skipped)."""
    per_block: dict[tuple[str, int], float] = {}
    sq = ref = 0.0
    for c in cands:
        key = (c.expert, c.tensor, c.block)
        how = sel.get(key)
        r2 = 0.0 if how == "full" else c.l2 * c.l2 if how is None else residual[how][key][0]
        per_block[(c.tensor, c.row_start)] = per_block.get((c.tensor, c.row_start), 0.0) + r2 ** 0.5
        sq += r2
        ref += c.l2 * c.l2
    bound = sum(v * v for v in per_block.values()) ** 0.5
    return bound / ref ** 0.5, (sq / ref) ** 0.5


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(args, base, base_index, experts, cands, residual, sels, delta_err, errs, times) -> dict:
    full_bytes = sum(c.cost for c in cands)
    elements = sum(c.cost // base.tensors[c.tensor].itemsize for c in cands)
    reps = {}
    for r, table in residual.items():
        nbytes = sum(v[1] for v in table.values())
        reps[r] = {"bytes": nbytes, "bits_per_element": round(8 * nbytes / elements, 4),
                   "share_of_full_read": round(nbytes / full_bytes, 4),
                   "delta_rel_err": round(delta_err[r], 5), "ta_rel_err": round(errs.rel(("all", r), "ta"), 5),
                   "ties_rel_err": round(errs.rel(("all", r), "ties"), 5)}
    budgets: dict = {}
    for (label, rep), sel in sels.items():
        n_full = sum(1 for v in sel.values() if v == "full")
        bound, rms = predicted(cands, residual, sel, rep)
        budgets.setdefault(label, {})[rep] = {"predicted_ta_bound": round(bound, 5), "predicted_ta_rms": round(rms, 5),
            "ta_rel_err": round(errs.rel((label, rep), "ta"), 5),
            "ties_rel_err": round(errs.rel((label, rep), "ties"), 5),
            "blocks_full": n_full, "blocks_as_representation": len(sel) - n_full,
            "blocks_by_kind": dict(sorted(Counter(sel.values()).items()))}
    return {"commit": _commit(), "command": " ".join(sys.argv), "machine": platform.platform(),
            "base": str(args.base), "experts": [str(p) for p in args.experts], "block_bytes": args.block_bytes,
            "dtypes": sorted({base.tensors[c.tensor].dtype for c in cands}), "candidates": len(cands),
            "elements": elements, "full_read_bytes": full_bytes,
            "ties": {"density": DENSITY, "lambda": 1.0, "untrimmed": sorted(UNTRIMMED)},
            "ta": {"lambda": 1.0}, "weights": 1.0,
            "scan_seconds": times, "representations": reps, "budgets": budgets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True)
    ap.add_argument("--experts", type=Path, nargs="+", required=True)
    ap.add_argument("--block-bytes", default="1MiB")
    ap.add_argument("--budgets", default="10%,25%,50%")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--untrimmed", action="store_true",
                    help="TIES leaves every representation untrimmed (default: only the sketch, as the engine)")
    ap.add_argument("--kinds", help="group-quantized kinds to make, comma-separated (default: all eight), e.g. "
                    "gq1g128,gq2g128,gq4g128,gq8g128: the scan then writes only those")
    args = ap.parse_args()
    if args.kinds:
        SPECS[:] = [s for s in SPECS if s.name in args.kinds.split(",")]
    if args.untrimmed:
        UNTRIMMED.update(s.name for s in SPECS)
    args.block_bytes = parse_bytes(args.block_bytes)
    with tempfile.TemporaryDirectory(prefix="repr-distortion-") as tmp:
        root = Path(tmp)
        _, base, base_index, experts = _inputs(root / "cache", args.base, args.experts, args.block_bytes)
        reps, times = build_representations(root / "reps", base, base_index, experts)
        cands, residual = candidates(base, base_index, experts, reps)
        full = sum(c.cost for c in cands)
        budgets = {b: int(full * float(b.rstrip("%")) / 100) for b in args.budgets.split(",")}
        plan_times: dict = {}
        sels = selections(cands, residual, budgets, list(experts), plan_times)
        times["quant_allocation"] = {k: round(v, 4) for k, v in plan_times.items()}
        delta_err, errs = measure(base, base_index, experts, reps, sels)
        out = report(args, base, base_index, experts, cands, residual, sels, delta_err, errs, times)
        for opened in reps.values():
            for r in opened.values():
                r.close()
    print(json.dumps({k: out[k] for k in ("scan_seconds", "representations", "budgets")}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
