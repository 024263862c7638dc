"""Process and page-cache measurements for the benchmark harness (Linux only).

Owns: running one contender as a child process and collecting its wall time,
user+sys CPU, peak RSS and /proc/<pid>/io counters; evicting files from the page
cache and counting their resident bytes (mincore); and measuring the machine's
sequential read bandwidth. It knows nothing about merges.

/proc/<pid>/io disappears once a child is reaped, so `run_measured` waits with
WNOWAIT (the child is a zombie, its counters final), reads them, then reaps it
with wait4 for the rusage. The counters cover the child's own threads, not its
grandchildren: contenders are exec'd directly, never through a shell.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@dataclass
class Measured:
    """One child process, start to exit."""

    argv: list[str]
    returncode: int
    wall_s: float
    user_s: float
    sys_s: float
    max_rss_bytes: int
    io: dict[str, int] = field(default_factory=dict)  # /proc/<pid>/io at exit
    peak_rss_anon_bytes: int = 0  # sampled every ~20 ms from /proc/<pid>/status
    peak_rss_file_bytes: int = 0  # file-backed pages (mmap'd weights count here)
    loadavg_before: float = 0.0
    stderr_tail: str = ""

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s

    def to_json(self) -> dict:
        d = asdict(self)
        d["cpu_s"] = self.cpu_s
        return d


def _read_io(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def _rss_parts(pid: int) -> tuple[int, int]:
    anon = file = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return anon, file


def run_measured(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 timeout_s: float | None = None, log: Path | None = None) -> Measured:
    """Run argv as a direct child; wall, rusage and /proc io of exactly that process.

    Its ru_maxrss is at least this process's own peak RSS (Popen's vfork shares this
    process's memory map until exec, whose high-water mark the kernel keeps), so keep the
    harness small; the sampled anon + file peaks (every 20 ms) have no such floor."""
    load = os.getloadavg()[0]
    err_path = log or Path(os.devnull)
    with open(err_path, "ab") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=err, stderr=err, stdin=subprocess.DEVNULL)
        deadline = None if timeout_s is None else t0 + timeout_s
        peak_anon = peak_file = 0
        while True:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            if info is not None and info.si_pid == proc.pid:
                break
            if deadline is not None and time.perf_counter() > deadline:
                proc.kill()
            anon, file = _rss_parts(proc.pid)
            peak_anon, peak_file = max(peak_anon, anon), max(peak_file, file)
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        io = _read_io(proc.pid)
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from waiting again
    tail = ""
    if log is not None and proc.returncode != 0:
        tail = log.read_bytes()[-2000:].decode(errors="replace")
    return Measured(list(map(str, argv)), proc.returncode, wall, ru.ru_utime, ru.ru_stime,
                    ru.ru_maxrss * 1024, io, peak_anon, peak_file, load, tail)


# ---------------------------------------------------------------- page cache

def model_files(folder: str | Path) -> list[Path]:
    """The weight files of a model folder (what a merge reads)."""
    return sorted(Path(folder).glob("*.safetensors"))


def evict(paths: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (POSIX_FADV_DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches() -> bool:
    """Global drop_caches when allowed (root); False otherwise. Not needed by default."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def resident_bytes(path: Path) -> int:
    """Bytes of `path` currently in the page cache (mincore over a read-only mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            resident = sum(1 for v in vec if v & 1)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * PAGE)


def resident_total(paths: list[Path]) -> int:
    return sum(resident_bytes(p) for p in paths)


def warm(paths: list[Path], chunk: int = 16 << 20) -> None:
    """Read files fully so that they sit in the page cache."""
    buf = bytearray(chunk)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ---------------------------------------------------------------- the machine's limit

def read_bandwidth(paths: list[Path], *, cold: bool, chunk: int = 8 << 20) -> dict:
    """Sequential read of `paths` (one pass, one thread, preadv into a reused buffer).

    cold: evict the files first, so every byte comes from the device. Returns
    bytes, seconds and GB/s (10^9 bytes per second).
    """
    if cold:
        evict(paths)
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            off = 0
            while True:
                n = os.preadv(fd, [view], off)
                if n == 0:
                    break
                off += n
            total += off
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9, "cold": cold}


def self_rusage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"max_rss_bytes": ru.ru_maxrss * 1024, "user_s": ru.ru_utime, "sys_s": ru.ru_stime}


def first_touch_rate(nbytes: int = 256 << 20) -> dict:
    """GiB/s of filling memory the process has never touched against refilling the same
    memory. On a VM whose host takes freed guest memory back, every first touch of a page is
    a fault in the host: here the two differed 17x (0.5 against 9.4 GiB/s), and each fresh
    page-cache page a buffered write fills pays it. Recorded beside each run's walls.

    Measured in a child process: touching `nbytes` here would raise this process's peak RSS,
    and every later child's ru_maxrss starts from it (see run_measured)."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import measure; "
            "print(json.dumps(measure._touch(int(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, str(nbytes)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _touch(nbytes: int) -> dict:
    """first_touch_rate's measurement, in the process that calls it."""
    m = mmap.mmap(-1, nbytes)
    chunk = b"\1" * (16 << 20)
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        for off in range(0, nbytes, len(chunk)):
            m[off:off + len(chunk)] = chunk
        rates.append(nbytes / 2**30 / (time.perf_counter() - t))
    m.close()
    return {"first_touch_gib_s": rates[0], "reused_gib_s": rates[1]}
