"""Buffered against O_DIRECT writes of one new file, alternated (why checkpoint/direct_io.py).

    .venv/bin/python bench/write_paths.py [--mib 944] [--rounds 3] [--dir bench/out]

Each round writes a fresh file both ways: 8 MiB pwrites from one reused buffer, then fsync,
and prints wall and CPU seconds, with this machine's memory first-touch rate
(measure.first_touch_rate) before the rounds.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402

CHUNK = 8 << 20


def write_once(path: Path, chunks: int, direct: bool, buf: mmap.mmap) -> tuple[float, float]:
    path.unlink(missing_ok=True)
    c0, t0 = time.process_time(), time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for i in range(chunks):
            os.pwrite(fd, buf, i * CHUNK)
        os.fsync(fd)
    finally:
        os.close(fd)
    out = time.perf_counter() - t0, time.process_time() - c0
    path.unlink()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=944)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    print(f"memory: {measure.first_touch_rate()}")
    for r in range(args.rounds):
        for direct in ((False, True) if r % 2 == 0 else (True, False)):
            wall, cpu = write_once(args.dir / "write-paths.bin", args.mib // 8, direct, buf)
            print(f"round {r + 1} {'O_DIRECT' if direct else 'buffered'}: {wall:.3f} s wall, {cpu:.3f} CPU-s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
