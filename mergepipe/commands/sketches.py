"""The experts' ternary sketches a `sketch` plan chooses from (index/sketch.py): one scan of
each expert against the base the first time, then cached in the store's `sketch/` folder by
(expert, base, block layout). A cached file is untrusted: a damaged or foreign one is
rebuilt, and each block's codes are checked again when the merge reads them."""
from __future__ import annotations

from mergepipe.checkpoint.safetensors import Checkpoint
from mergepipe.errors import IntegrityError
from mergepipe.index import sketch
from mergepipe.index.records import DeltaIndex, ModelIndex
from mergepipe.index.store import Store
from mergepipe.methods import _ckernels
from mergepipe.util.progress import Progress


def sketch_inputs(store: Store, base: Checkpoint, base_index: ModelIndex,
                  experts: dict[str, tuple[Checkpoint, ModelIndex, DeltaIndex]],
                  progress: bool = False) -> dict[str, sketch.Sketch]:
    """expert name -> its opened sketch, built where missing or damaged (a progress line on a
    terminal while it scans)."""
    out = {}
    for name, (ckpt, index, delta) in sorted(experts.items()):
        path = sketch.cache_path(store.root, index.content_hash, base_index.content_hash, base_index.layout.key)
        opened = None
        if path.exists():
            try:
                opened = sketch.Sketch(path, expert=index.content_hash, base=base_index.content_hash,
                                       base_index=base_index)
            except IntegrityError:
                opened = None  # the store is untrusted: rebuilt
        if opened is None:
            with Progress(2 * base.total_bytes, f"sketching {name}", progress) as prog:
                sketch.build(path, base, base_index, ckpt, index, delta, counter=store.index_reads, progress=prog,
                             bf16_scan=getattr(_ckernels.load(), "sketch_bf16", None))
            opened = sketch.Sketch(path, expert=index.content_hash, base=base_index.content_hash,
                                   base_index=base_index)
        out[name] = opened
    return out


def plan_sketches(plan, store: Store, base: Checkpoint, base_index: ModelIndex,
                  experts: dict[str, tuple[Checkpoint, ModelIndex, DeltaIndex]],
                  where: str) -> dict[str, sketch.Sketch]:
    """The sketches a plan names, from the store (made again where missing: they are a function
    of the inputs, as in a replay's fresh store), each matched against the plan's hash."""
    rec = plan.sketch  # plan/record.py SketchRecord
    if rec is None:
        return {}
    # only the experts the plan sketches: a full-budget sketch plan (nothing sketched)
    # replays without scanning anything
    used = {n: e for n, e in experts.items() if any(rec.blocks.get(n, {}).values())}
    out = sketch_inputs(store, base, base_index, used)
    for name, opened in out.items():
        if opened.digest != rec.artifacts[name]:
            raise IntegrityError(f"{where}: expert {name!r}: its sketch {opened.path} is not the one the plan was "
                                 f"made with (plan {rec.artifacts[name][:12]}, now {opened.digest[:12]}); "
                                 "plan again")
    return out
