"""Real `mergepipe` processes for the crash and concurrency tests, and their helpers
(params.yaml for a family, leftovers beside a target, what is published at a target).
The fixtures they use (small_family, tiny_cache) are in tests/conftest.py.

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

from mergepipe.output.manifest import MANIFEST, verify_outputs
from mergepipe.output.run_record import record_path

REPO = Path(__file__).resolve().parents[2]
# every run's stderr file lives here, so a run that is never closed leaves nothing in /tmp
_ERR_DIR = tempfile.TemporaryDirectory(prefix="mergepipe-runs-")
_ZYGOTE = """\
import json, os, resource, signal, sys, traceback
import mergepipe.cli, mergepipe.config.params, mergepipe.engine.merge, mergepipe.output.manifest
import mergepipe.commands.pipeline, mergepipe.index.store
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
        fd, err = tempfile.mkstemp(suffix=".err", dir=_ERR_DIR.name)
        os.close(fd)
        self.err = Path(err)
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
    """Temp folders, old versions and locks beside `target` (names starting with .TARGET.),
    not its run record."""
    if not target.parent.is_dir():
        return []
    return sorted(p.name for p in target.parent.iterdir()
                  if p.name.startswith(f".{target.name}.") and p != record_path(target))


def published(target: Path) -> str | None:
    """The plan hash of what is published at target (None: nothing); asserts it is complete."""
    if not os.path.lexists(target):
        return None
    assert target.is_dir()
    man = verify_outputs(target)  # every recorded file present with its hash, nothing extra
    assert {p.name for p in target.iterdir()} == set(man["outputs"]["files"]) | {MANIFEST}
    return man["plan_hash"]
