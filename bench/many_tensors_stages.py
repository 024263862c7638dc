"""Where a cached 100k-tensor `mergepipe merge` spends its time: each step of
`commands.pipeline.open_inputs` and `merge_plan`, timed in one process (wall, CPU, peak RSS).

    .venv/bin/python bench/many_tensors_stages.py [--tensors 100000]

Writes the family of bench/many_tensors.py, indexes and plans it (`mergepipe run`, `plan`),
then loads the plan, opens the three checkpoints with their cached indexes, the two delta
indexes, checks the plan's reads, runs the engine and builds and serializes the manifest.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

T = [time.perf_counter(), time.process_time()]  # before any mergepipe import
sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_tensors import PY, write_model  # noqa: E402


def mark(what: str) -> None:
    now, cpu = time.perf_counter(), time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{what:28s} {now - T[0]:6.2f} s  cpu {cpu - T[1]:6.2f} s  peak RSS {peak:5.0f} MB", flush=True)
    T[0], T[1] = now, cpu


def stages(work: Path) -> None:
    os.chdir(work)
    from mergepipe.plan.load import load_plan
    from mergepipe.plan.record import plan_json
    from mergepipe.commands import pipeline as P
    from mergepipe.engine.merge import run_merge
    from mergepipe.index.store import Store
    from mergepipe.output.manifest import build_manifest, dumps
    import gc
    from mergepipe.util.gcpause import RARE_THRESHOLD
    gc.set_threshold(*RARE_THRESHOLD)  # as cli.main runs a command (util/gcpause.rare_gc)
    mark("imports")
    plan = load_plan("plan.json")
    mark("plan file")
    store, root, bb = Store(".mergepipe"), Path("."), plan.layout
    base, base_index = store.model_index(P.resolve(plan.base.path, root), block_bytes=bb)
    mark("base checkpoint + index")
    experts, eidx, deltas = {}, {}, {}
    for e in plan.experts:
        experts[e.name], eidx[e.name] = store.model_index(P.resolve(e.path, root), block_bytes=bb)
    mark("2 experts + indexes")
    for e in plan.experts:
        deltas[e.name] = store.delta_index(base, base_index, experts[e.name], eidx[e.name])
    mark("2 delta indexes")
    P.check_plan_inputs(plan, base_index, eidx)
    P.check_plan_reads(plan, base_index, eidx, deltas, "plan.json")
    mark("plan checks")
    (work / "out-stages").mkdir()
    realized = run_merge(plan_json(plan), P.Inputs(base, base_index, experts, eidx, deltas, cache_dir=store.root),
                         work / "out-stages")
    mark("engine")
    man = build_manifest(plan, realized, {})
    mark("manifest build")
    dumps(man)
    mark("manifest JSON")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--stages", help=argparse.SUPPRESS)  # internal: time the stages in this folder
    args = ap.parse_args()
    if args.stages:
        stages(Path(args.stages))
        return 0
    n = args.tensors
    work = Path(tempfile.mkdtemp(prefix="mergepipe-stages-"))
    try:
        for name, shift in (("base", 0.0), ("e1", 0.5), ("e2", -0.25)):
            write_model(work / name, [float(i % 97) + shift for i in range(n)], "BF16")
        params = {"base": "base", "experts": [{"name": "e1", "path": "e1", "weight": 1.0},
                                              {"name": "e2", "path": "e2", "weight": 0.5}],
                  "method": "task_arithmetic", "parameters": {}, "seed": 0, "budget": "full",
                  "block_bytes": "1MiB", "output": {"dir": "out"}}
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        for cmd in (["run", "params.yaml", "-q"], ["plan", "params.yaml", "-q", "-o", "plan.json"]):
            subprocess.run([PY, "-m", "mergepipe", *cmd], cwd=work, check=True)
        # the stages in a fresh interpreter: imports and memory as a `mergepipe merge` process has them
        subprocess.run([PY, __file__, "--stages", str(work)], check=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
