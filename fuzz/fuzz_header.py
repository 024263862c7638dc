"""Long-run fuzz target for the safetensors header parser (issue 5).

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/fuzz_header.py -runs=1000000 -dict=fuzz/header.dict

Every input is written to a file on /dev/shm and parsed with
`mergepipe.checkpoint.safetensors.parse_header`. Allowed outcomes: a CheckpointError (one
line, naming the file) or a header whose invariants hold (tensors tile the data
region exactly, sizes match shapes x itemsize, names unique and valid Unicode,
metadata str -> str). Anything else is a crash: libFuzzer stops and writes the
input to crash-<sha1>. Without a corpus folder on the command line, a seed corpus
of real safetensors files (written by `safetensors.torch.save_file`) is generated.

Without atheris, `--own N` runs N inputs through a seeded mutator of the same
seeds (byte flips, splices of JSON tokens, length-field rewrites, truncations).
"""
from __future__ import annotations

import os
import random
import struct
import sys
import tempfile
import time
from math import prod
from pathlib import Path

SCRATCH = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / f"mergepipe-fuzz-{os.getpid()}"
TOKENS = [b'"dtype"', b'"shape"', b'"data_offsets"', b'"__metadata__"', b'"F32"', b'"BF16"', b'"F8_E4M3"',
          b"[", b"]", b"{", b"}", b",", b":", b"-1", b"0", b"1e999", b"NaN", b"true", b"null", b'"\\ud800"',
          b"18446744073709551615", b"9007199254740993", b'""', b" "]


def make_seeds(folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    samples = {
        "one": {"w": torch.randn(4, 3, generator=g)},
        "dtypes": {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.int64),
                   "c": torch.zeros(1, 2, 2, dtype=torch.float16), "d": torch.tensor(1.0, dtype=torch.float64),
                   "e": torch.zeros(5, dtype=torch.uint8), "f": torch.zeros(2, dtype=torch.bool)},
        "empty": {"z": torch.zeros(0, 4)},
        "llama": {f"model.layers.{i}.{n}.weight": torch.zeros(2, 2, dtype=torch.bfloat16)
                  for i in range(2) for n in ("q_proj", "k_proj", "mlp.up_proj")},
    }
    for name, tensors in samples.items():
        save_file(tensors, folder / f"{name}.safetensors", metadata={"format": "pt"} if name != "empty" else None)
    (folder / "no-tensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    return folder


def check(data: bytes) -> None:
    from mergepipe.errors import CheckpointError
    from mergepipe.checkpoint.safetensors import DTYPES, parse_header
    SCRATCH.write_bytes(data)
    try:
        h = parse_header(SCRATCH)
    except CheckpointError as e:
        if str(SCRATCH) not in str(e) or "\n" in str(e):
            raise AssertionError(f"error message does not name the file on one line: {e!r}") from None
        return
    pos, seen = h.data_start, set()
    for t in h.tensors:
        if t.begin != pos or t.end - t.begin != prod(t.shape) * DTYPES[t.dtype][0] or t.name in seen:
            raise AssertionError(f"accepted a header that breaks the invariants: {t}")
        t.name.encode("utf-8")
        seen.add(t.name)
        pos = t.end
    if pos != h.size or h.size != len(data):
        raise AssertionError("accepted a file whose tensors do not tile its data region")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in h.metadata.items()):
        raise AssertionError("accepted non-string metadata")


def mutate(rng: random.Random, seed: bytes) -> bytes:
    buf = bytearray(seed)
    for _ in range(rng.choice((1, 1, 2, 3, 6))):
        kind = rng.randrange(7)
        if kind == 0 and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif kind == 1 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif kind == 2 and buf:
            i = rng.randrange(len(buf))
            del buf[i:i + rng.randrange(1, 16)]
        elif kind == 3:
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.choice(TOKENS)
        elif kind == 4 and len(buf) >= 8:
            n = int.from_bytes(buf[:8], "little")
            buf[:8] = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, n * 2, 2**63, 2**64 - 1, 100_000_001]) % 2**64)
        elif kind == 5:
            del buf[rng.randrange(len(buf) + 1):]
        elif kind == 6 and len(buf) > 8:  # a digit changed inside the JSON (shapes, offsets)
            digits = [i for i in range(8, len(buf)) if 48 <= buf[i] <= 57]
            if digits:
                buf[rng.choice(digits)] = rng.randrange(48, 58)
    return bytes(buf)


def own_loop(n: int, seeds: list[bytes], seed: int = 0) -> None:
    rng = random.Random(seed)
    t0, last = time.monotonic(), time.monotonic()
    for i in range(1, n + 1):
        check(mutate(rng, rng.choice(seeds)))
        if time.monotonic() - last > 30:
            last = time.monotonic()
            print(f"#{i} {i / (last - t0):,.0f} exec/s", file=sys.stderr)
    print(f"done: {n} inputs, 0 crashes, {time.monotonic() - t0:.0f} s", file=sys.stderr)


def main() -> None:
    try:
        if "--own" in sys.argv:
            n = int(sys.argv[sys.argv.index("--own") + 1])
            folder = make_seeds(Path(tempfile.mkdtemp(prefix="mergepipe-seeds-")))
            own_loop(n, [p.read_bytes() for p in sorted(folder.iterdir())])
            return
        import atheris
        import torch  # noqa: F401 - imported first so that only mergepipe is instrumented
        with atheris.instrument_imports(include=["mergepipe"]):
            import mergepipe.checkpoint.safetensors  # noqa: F401
        argv = list(sys.argv)
        if not [a for a in argv[1:] if not a.startswith("-")]:
            argv.append(str(make_seeds(Path(tempfile.mkdtemp(prefix="mergepipe-seeds-")))))
        atheris.Setup(argv, check)
        atheris.Fuzz()
    finally:
        SCRATCH.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
