"""The exact cuts off the index's grid that a magnitude merge needs (index/extra_cuts.py): the
ranks its densities and gammas ask beyond the delta index's (plan/cut_ranks.py), made in one scan
per expert of the tensors that need them, then cached by content in the store's `cuts/` folder.
The plan records each expert's cuts by their blake3 (`cuts`, only when some are needed: a
config on the grid plans as it always did); a merge of a plan from disk finds or makes the
same cuts and refuses a plan whose record they do not match."""
from __future__ import annotations

from mergepipe.checkpoint.safetensors import Checkpoint
from mergepipe.errors import IntegrityError
from mergepipe.index import extra_cuts
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.index.store import Store, cache_write_error
from mergepipe.plan.cut_ranks import wanted_cuts
from mergepipe.plan.record import PlanRecord, plan_json


def expert_cuts(store: Store, base: Checkpoint, base_index: ModelIndex,
                expert: tuple[Checkpoint, ModelIndex, DeltaIndex], wanted: dict[str, tuple[int, ...]], *,
                threads: int = 2, progress: bool = False) -> extra_cuts.ExtraCuts:
    """One expert's cuts at `wanted`, from the store or made by one scan of those tensors."""
    ckpt, expert_index, delta = expert
    path = extra_cuts.cache_path(store.root, expert_index.content_hash, base_index.content_hash,
                                 base_index.layout.key, wanted)
    cached = extra_cuts.load(path, wanted, {n: delta.tensors[n] for n in wanted})
    if cached is not None:
        store.hits += 1
        return cached
    from mergepipe.index.build import build_extra_cuts
    made = extra_cuts.from_scan(build_extra_cuts(base, ckpt, base_index, expert_index, wanted, threads=threads,
                                                 counter=store.index_reads, progress=progress))
    store.builds += 1
    try:
        extra_cuts.save(path, made)
    except OSError as e:
        raise cache_write_error(path, e) from None
    return made


def config_cuts(plan_like: dict, store: Store, base: Checkpoint, base_index: ModelIndex,
                experts: dict[str, tuple[Checkpoint, ModelIndex, DeltaIndex]], *, threads: int = 2,
                progress: bool = False) -> tuple[dict[str, str] | None, dict[str, DeltaIndex]]:
    """(the plan's `cuts` record: expert -> blake3 of its cuts, None when none is needed; every
    expert's delta index with its cuts laid in). `plan_like`: method, parameters, experts
    (name, density, gamma) and tensor_parameters, as the plan will hold them."""
    deltas = {n: d for n, (_, _, d) in experts.items()}
    wanted = wanted_cuts(plan_like, base_index, deltas)
    if not wanted:
        return None, deltas
    record = {}
    for name in sorted(wanted):
        cuts = expert_cuts(store, base, base_index, experts[name], wanted[name], threads=threads, progress=progress)
        record[name] = cuts.digest
        deltas[name] = extra_cuts.with_cuts(deltas[name], cuts)
    return record, deltas


def plan_cuts(plan: PlanRecord, store: Store, base: Checkpoint, base_index: ModelIndex,
              experts: dict[str, tuple[Checkpoint, ModelIndex, DeltaIndex]], where: str, *,
              threads: int = 2) -> dict[str, DeltaIndex]:
    """Every expert's delta index with the cuts `plan` was made with, found or made again (a
    function of the inputs: a replay's fresh store makes them), each matched against the plan's
    record. Raises IntegrityError where they differ, or the plan records cuts it does not need."""
    doc = plan_json(plan)
    recorded = doc.get("cuts")
    made, deltas = config_cuts(doc, store, base, base_index, experts, threads=threads)
    if made != recorded:
        missing = sorted(set(made or {}) ^ set(recorded or {}))
        name = missing[0] if missing else next(n for n in sorted(made) if made[n] != recorded[n])
        raise IntegrityError(f"{where}: plan key cuts.{name}: the exact cuts off the grid this merge needs are "
                             f"{(made or {}).get(name, 'none')[:12]}, the plan records "
                             f"{(recorded or {}).get(name, 'none')[:12]}; plan again")
    return deltas
