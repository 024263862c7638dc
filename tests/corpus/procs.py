"""Real `mergepipe` processes for the crash and concurrency tests, plus a shared
"small" demo family.

A `Warm` process imports mergepipe (and torch) first, says "ready", and runs
`mergepipe.cli.main(argv)` only when released, so that a kill lands at a chosen
moment of the run itself rather than during the 1-3 s of interpreter start-up.
It is the same code path as the console script: `main` with the same argv.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mergepipe.demo import make_family
from mergepipe.store import Store

REPO = Path(__file__).resolve().parents[2]
_WARM = """\
import sys
import mergepipe.cli, mergepipe.config, mergepipe.engine, mergepipe.manifest, mergepipe.pipeline, mergepipe.store
print("ready", flush=True)
sys.stdin.readline()
sys.exit(mergepipe.cli.main(sys.argv[1:]))
"""


class Warm:
    """A started interpreter, waiting to run `mergepipe ARGV`."""

    def __init__(self, argv: list[str], *, preexec_fn=None) -> None:
        self.argv = argv
        self.p = subprocess.Popen([sys.executable, "-c", _WARM, *argv], cwd=REPO, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=preexec_fn)
        self.t0: float | None = None

    def go(self) -> None:
        line = self.p.stdout.readline()
        assert line == b"ready\n", (line, self.p.stderr.read())
        self.t0 = time.monotonic()
        self.p.stdin.write(b"\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)

    def wait(self, timeout: float = 300) -> tuple[int, str, float]:
        """(exit code, stderr, seconds since go); a kill reads as -9."""
        _, err = self.p.communicate(timeout=timeout)
        return self.p.returncode, err.decode(errors="replace"), time.monotonic() - (self.t0 or 0)

    def close(self) -> None:
        self.kill()
        self.p.communicate()


@pytest.fixture(scope="session")
def small_family(tmp_path_factory) -> dict:
    """base + 2 bf16 experts of the "small" preset (~48 MB each), one merge ~1-3 s."""
    root = tmp_path_factory.getbasetemp() / "small-family"
    family = {"root": root, "base": root / "base", "experts": [root / "expert_0", root / "expert_1"],
              "cache": root / "cache"}  # indexed at 16 KiB blocks; tests may empty its merges/ store
    if not (root / ".done").exists():
        make_family(root, preset="small", n_experts=2, seed=0)
        store = Store(family["cache"])
        base, base_index = store.model_index(family["base"], block_bytes=16 << 10)
        for path in family["experts"]:
            expert, index = store.model_index(path, block_bytes=16 << 10)
            store.delta_index(base, base_index, expert, index)
        (root / ".done").touch()
    return family


def params(path: Path, family: dict, out: Path, cache: Path, **overrides) -> Path:
    """params.yaml for `family` (task_arithmetic, full budget, 16 KiB blocks)."""
    import yaml
    cfg = {"base": str(family["base"]),
           "experts": [{"name": f"e{k}", "path": str(p), "weight": [1.0, 0.5, 0.7][k]}
                       for k, p in enumerate(family["experts"])],
           "method": "task_arithmetic", "parameters": {"lambda": 1.0}, "seed": 0, "budget": "full",
           "block_bytes": "16KiB", "output": {"dir": str(out)}, "cache_dir": str(cache)}
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def leftovers(target: Path) -> list[str]:
    """Temp folders, old versions and locks beside `target` (names starting with .TARGET.)."""
    if not target.parent.is_dir():
        return []
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))
