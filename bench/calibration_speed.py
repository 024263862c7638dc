"""Wall time of the calibration pass (issue 12: <= 2 min for a 135M base on 2 cores).

Runs `mergepipe.calibrate.fisher.fisher` (what `mergepipe run` does for a `calibrated` plan
when the cache has no artifact) on a base and a text with the given recipe, in this
process, with `--threads` torch threads, and reports the wall of each phase: model and
tokenizer load, the forward + backward passes, the squared-gradient sums, total.

The pass is run once as fisher() does it (total; fisher() records the seconds of its
sequence loop), then the forward + backward alone over the same sequences, so the sums'
share is the difference. Run it under the heavy lock on a quiet machine:

    flock /tmp/mergepipe-heavy.lock nice .venv/bin/python bench/calibration_speed.py \
        --base workflows/real/work/smollm/base --text workflows/real/work/smollm/calib/calib.txt \
        --out bench/out/calibration_speed.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    from mergepipe.calibrate.fisher import fisher, read_text
    from mergepipe.checkpoint.safetensors import open_checkpoint
    base = open_checkpoint(a.base)
    text = read_text(Path(a.text))
    t0 = time.monotonic()
    _, meta = fisher(base, text, max_tokens=a.max_tokens, seq_len=a.seq_len)
    total = time.monotonic() - t0
    # forward + backward alone, same sequences, same model (load timed separately)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t1 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(a.base)
    model = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32)
    load = time.monotonic() - t1
    ids = tok(text, add_special_tokens=False)["input_ids"][:a.max_tokens]
    seqs = [ids[i:i + a.seq_len] for i in range(0, len(ids), a.seq_len)]
    model.eval()
    t2 = time.monotonic()
    for s in seqs:
        x = torch.tensor([s])
        model.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x).loss.backward()
    fwd_bwd = time.monotonic() - t2
    row = {"base": a.base, "threads": a.threads, "max_tokens": a.max_tokens, "seq_len": a.seq_len,
           "sequences": int(meta["sequences"]), "tokens": int(meta["tokens"]),
           "total_s": round(total, 1), "passes_s_in_fisher": float(meta["seconds"]), "load_s": round(load, 1),
           "forward_backward_s": round(fwd_bwd, 1),
           "squared_gradient_sums_s": round(float(meta["seconds"]) - fwd_bwd, 1)}
    print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
