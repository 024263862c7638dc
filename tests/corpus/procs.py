"""Real `mergepipe` processes for the crash and concurrency tests, plus a shared
"small" demo family.

Runs are forked from a zygote: one interpreter that has imported mergepipe (and
torch) and forks a child per run, which calls `mergepipe.cli.main(argv)` (the
console script's code path) and exits with its return code. A run thus starts in
milliseconds instead of 1-3 s of interpreter start-up, so a kill lands at a chosen
moment of the run itself, and 25 runs do not cost 25 imports of torch. The zygote
has run no mergepipe code and started no threads when it forks.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mergepipe.commands.demo import make_family
from mergepipe.index.store import Store

REPO = Path(__file__).resolve().parents[2]
_ZYGOTE = """\
import json, os, resource, signal, sys, traceback
import mergepipe.cli, mergepipe.config.params, mergepipe.engine.merge, mergepipe.output.manifest, mergepipe.commands.pipeline, mergepipe.index.store
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "wait":
        _, status = os.waitpid(req["pid"], 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            fd = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)
            if req.get("fsize"):
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
            rc = mergepipe.cli.main(req["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    print(json.dumps({"pid": pid}), flush=True)
"""


class _Zygote:
    _one: "_Zygote | None" = None

    def __init__(self) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _ZYGOTE], cwd=REPO, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert json.loads(self.p.stdout.readline()) == {"ready": True}

    @classmethod
    def get(cls) -> "_Zygote":
        if cls._one is None or cls._one.p.poll() is not None:
            cls._one = cls()
        return cls._one

    def ask(self, req: dict) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, "the zygote died"
        return json.loads(line)


class Warm:
    """One `mergepipe ARGV` run, started by go() (forked from the zygote)."""

    def __init__(self, argv: list[str], *, fsize: int | None = None) -> None:
        self.argv, self.fsize = argv, fsize
        self.zygote = _Zygote.get()
        self.err = Path(tempfile.mkstemp(prefix="mergepipe-run-", suffix=".err")[1])
        self.pid: int | None = None
        self.rc: int | None = None
        self.t0: float | None = None

    def go(self) -> None:
        self.t0 = time.monotonic()
        self.pid = self.zygote.ask({"op": "run", "argv": self.argv, "err": str(self.err), "fsize": self.fsize})["pid"]

    def kill(self) -> None:
        if self.pid is not None and self.rc is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 300) -> tuple[int, str, float]:
        """(exit code, stderr, seconds since go); a kill reads as -9."""
        if self.rc is None:
            self.rc = self.zygote.ask({"op": "wait", "pid": self.pid})["rc"]
            self.seconds = time.monotonic() - self.t0
        err = self.err.read_text(errors="replace")
        return self.rc, err, self.seconds

    def close(self) -> None:
        if self.pid is not None and self.rc is None:
            self.kill()
            self.wait()
        self.err.unlink(missing_ok=True)


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


@pytest.fixture(scope="session")
def tiny_cache(tiny_family, tmp_path_factory) -> Path:
    """A cache with the tiny family indexed at 16 KiB blocks (tests that use it empty merges/ first)."""
    root = Path(tiny_family["root"])
    cache = tmp_path_factory.getbasetemp() / "tiny-cache"
    if not (cache / ".done").exists():
        store = Store(cache)
        base, base_index = store.model_index(root / "base", block_bytes=16 << 10)
        for k in range(len(tiny_family["experts"])):
            expert, index = store.model_index(root / f"expert_{k}", block_bytes=16 << 10)
            store.delta_index(base, base_index, expert, index)
        (cache / ".done").touch()
    return cache
