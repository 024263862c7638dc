"""Planning time per strategy once the indexes and the calibration artifact exist (issue 12:
<= 1 s for a 1 GB K=4 merge with any strategy).

For each strategy, a params.yaml over the family (task arithmetic, every expert weight 1,
1 MiB blocks; `*_emb64k`: vocabulary tensors in 64 KiB blocks) is planned once to fill the
cache (indexes; for `calibrated`, the Fisher-weighted block energies of each expert), then
`mergepipe plan CONFIG --budget B -o plan.json -q` is timed `--repeats` times, each a fresh
process (wall clock, median reported; imports included), and then the planning call itself,
in this process with every module imported: `commands.pipeline.plan_config` (load the cached
indexes, the artifact and the block energies, make the plan), median of `--repeats`.

The calibration artifact: if the cache has none for the family's base and the text, one is
written with seeded random positive vectors (marked `synthetic` in its metadata), since a
Fisher pass of a 0.5B base does not fit a benchmark run on 2 cores; planning reads the
artifact's vectors only through the cached block energies, so its time does not depend on
their values. The real pass is timed by `bench/calibration_speed.py`.

    flock /tmp/mergepipe-heavy.lock nice .venv/bin/python bench/plan_speed.py \
        --family bench/out/family-bench-k4 --cache /tmp/plan-speed-cache \
        --text workflows/real/work/smollm/calib/calib.txt --out bench/out/plan_speed.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from blake3 import blake3

STRATEGIES = {
    "energy": ({"strategy": "energy"}, None),  # named: a config without `plan:` gets sketch below full
    "sketch": ({"strategy": "sketch"}, None),
    "balanced": ({"strategy": "balanced"}, None),
    "compensated": ({"strategy": "compensated"}, None),
    "calibrated": ({"strategy": "calibrated", "shares": "none"}, None),
    "energy_emb64k": ({"strategy": "energy"}, "64KiB"),
    "calibrated_emb64k": ({"strategy": "calibrated", "shares": "none"}, "64KiB"),
    "calibrated_emb64k_v10": ({"strategy": "calibrated", "shares": "none", "vocabulary_share": 0.1}, "64KiB"),
}


def write_config(path: Path, family: Path, cache: Path, text: Path, plan: dict, emb: str | None) -> None:
    experts = sorted(p for p in family.iterdir() if p.name.startswith("expert_"))
    cfg = {"base": str((family / "base").resolve()),
           "experts": [{"name": p.name, "path": str(p.resolve()), "weight": 1.0} for p in experts],
           "method": "task_arithmetic", "parameters": {"lambda": 1.0}, "budget": "25%", "block_bytes": "1MiB",
           "output": {"dir": str(path.parent / "unused")}, "cache_dir": str(cache.resolve())}
    if emb:
        cfg["embedding_block_bytes"] = emb
    if plan:
        cfg["plan"] = {**plan, **({"text": str(text.resolve())} if plan.get("strategy") == "calibrated" else {})}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def ensure_artifact(family: Path, cache: Path, text: Path) -> str:
    """The artifact path for the base and text; a synthetic one is written when none exists."""
    from mergepipe.calibrate import artifact
    from mergepipe.calibrate.fisher import read_text
    from mergepipe.commands.calibration import RECIPE
    from mergepipe.index.store import Store
    base, index = Store(cache).model_index(family / "base", block_bytes=1 << 20)
    recipe = {"kind": RECIPE, "max_tokens": 16384, "seq_len": 256}
    text_hash = blake3(read_text(text).encode()).hexdigest()
    path = artifact.artifact_path(cache, index.content_hash, text_hash, recipe)
    if not path.exists():
        rng = np.random.default_rng(0)
        imp = {}
        for name, t in base.tensors.items():
            if t.dtype in ("BF16", "F16", "F32") and t.numel:
                r, c = artifact.vector_lengths(t.shape)
                imp[name] = (rng.random(r, dtype=np.float32) + 0.01, rng.random(c, dtype=np.float32) + 0.01)
        artifact.save(path, imp, {"base": index.content_hash, "text": text_hash, "recipe": RECIPE,
                                  "key": path.stem, "synthetic": "bench/plan_speed.py: seeded random vectors"})
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--budgets", default="25%,10%")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from mergepipe.commands.pipeline import plan_config
    from mergepipe.config.params import load_config
    from mergepipe.index.store import Store
    family, cache, text = Path(a.family), Path(a.cache), Path(a.text)
    work = cache.with_name(cache.name + "-configs")  # beside the cache: an output may not overlap it
    work.mkdir(parents=True, exist_ok=True)
    result = {"family": str(family), "artifact": ensure_artifact(family, cache, text), "runs": []}
    for s in a.strategies.split(","):
        plan, emb = STRATEGIES[s]
        cfg = work / f"{s}.yaml"
        write_config(cfg, family, cache, text, plan, emb)
        for budget in a.budgets.split(","):
            cmd = [sys.executable, "-m", "mergepipe", "plan", str(cfg), "--budget", budget, "-q",
                   "-o", str(work / f"{s}-{budget.rstrip('%')}.json")]
            t0 = time.monotonic()
            subprocess.run(cmd, check=True)  # warm: indexes, weighted energies
            warm = time.monotonic() - t0
            walls = []
            for _ in range(a.repeats):
                t0 = time.monotonic()
                subprocess.run(cmd, check=True)
                walls.append(time.monotonic() - t0)
            calls = []
            for _ in range(a.repeats):
                t0 = time.monotonic()
                plan_config(load_config(cfg), Store(cache), budget=budget, threads=2)
                calls.append(time.monotonic() - t0)
            row = {"strategy": s, "budget": budget, "first_s": round(warm, 2),
                   "walls_s": [round(w, 3) for w in walls], "median_s": round(statistics.median(walls), 3),
                   "plan_config_s": [round(w, 3) for w in calls],
                   "plan_config_median_s": round(statistics.median(calls), 3)}
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
