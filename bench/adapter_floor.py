"""The matmul floor of LoRA adapter merges: CPU-seconds, on one thread, of one bench adapter's
Δ rows over every module (checkpoint/_lorac.c mp_lora_rows_f32), and of the one-pass sum
(mp_lora_task_arithmetic_bf16: Δ, bf16 rounding and the weighted sum) for K = 1 and K = 8 copies
of it, in slabs of 1024 rows, over a zero base. No I/O is timed.

    flock -x /tmp/cpu.lock .venv/bin/python bench/adapter_floor.py [ADAPTER_FOLDER]

ADAPTER_FOLDER defaults to bench/out/family-adapters/adapter_r16_0 (made by bench/adapters.py).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROWS = 1024


def main(argv: list[str]) -> int:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from mergepipe.checkpoint import _lora_kernel

    torch.set_num_threads(1)
    folder = Path(argv[0]) if argv else Path(__file__).parent / "out" / "family-adapters" / "adapter_r16_0"
    factors = load_file(folder / "adapter_model.safetensors")
    rows_f32, summed = _lora_kernel.load(), _lora_kernel.load_sum()
    if rows_f32 is None or summed is None:
        print("mergepipe.checkpoint._lorac is not built", file=sys.stderr)
        return 2
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in factors})
    elements, seconds = 0, {"rows": 0.0, "sum1": 0.0, "sum8": 0.0}
    for m in modules:
        a, b = factors[f"{m}.lora_A.weight"].contiguous(), factors[f"{m}.lora_B.weight"].contiguous()
        cols = a.shape[1]
        elements += b.shape[0] * cols
        for r0 in range(0, b.shape[0], ROWS):
            left = b[r0:r0 + ROWS].contiguous()
            n = left.shape[0]
            out, base = torch.empty(n, cols), np.zeros(n * cols, dtype=np.uint16)
            bits = np.empty_like(base)
            for key, call in (("rows", lambda: rows_f32(left, a, 2.0, out)),
                              ("sum1", lambda: summed(base, n, cols, [(left, a, 2.0)], [0.5], 1.0, False, 1.0, False,
                                                      bits)),
                              ("sum8", lambda: summed(base, n, cols, [(left, a, 2.0)] * 8, [0.5] * 8, 1.0, False, 1.0,
                                                      False, bits))):
                t = time.process_time()
                call()
                seconds[key] += time.process_time() - t
    print(f"{folder.name}: {len(modules)} modules, {elements / 1e6:.0f} M elements; Δ rows {seconds['rows']:.3f} "
          f"CPU-s; one-pass sum K=1 {seconds['sum1']:.3f} CPU-s, K=8 {seconds['sum8']:.3f} CPU-s "
          f"({seconds['sum8'] / 8:.3f} per adapter)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
