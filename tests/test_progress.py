"""Progress bars (mergepipe/util/progress.py): a bar per long step on a terminal, reaching
100%; nothing in a pipe or under -q; under MERGEPIPE_PROGRESS=1 (what the Snakemake rules
ask for) the bar on /dev/tty and one end line in the log; outputs the same either way."""
from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import write_config
from tests.helpers.workflow import MODEL, make_workspace, tool_env
from mergepipe.util import progress
from mergepipe.util.progress import Progress

STEPS = ("hashing base", "indexing expert_0 against base", "indexing expert_2 against base", "sketching e0",
         "sketching e2", "merging")
BYTES_OF_TOTAL = re.compile(r"\| (\d+(?:\.\d+)?[kMG]?)/(\d+(?:\.\d+)?[kMG]?) \[")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != progress.ENV}
    return {**env, **extra}


def _drain(fd: int, proc: subprocess.Popen, timeout: float = 300) -> bytes:
    """Everything written to the pty master `fd` until the process exits."""
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            out += data
        elif proc.poll() is not None:
            break
    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return out


def _cli(argv: list[str], *, stderr_tty: bool, env: dict[str, str] | None = None, controlling_tty: bool = False,
         stdout_tty: bool = False, cwd: Path | None = None) -> tuple[int, str, str]:
    """(exit code, what reached the terminal, what reached the stderr pipe). The terminal is a
    pty: the command's stderr when `stderr_tty` (its stdout when `stdout_tty`), its controlling
    terminal (/dev/tty) when `controlling_tty`; the command runs in a session of its own, so it
    never finds the tester's."""
    master, slave = pty.openpty()

    def take_terminal() -> None:
        if controlling_tty:
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave if stdout_tty else subprocess.DEVNULL,
                            stderr=slave if stderr_tty else subprocess.PIPE, env=env or _env(), cwd=cwd,
                            start_new_session=True, preexec_fn=take_terminal, pass_fds=(slave,))
    os.close(slave)
    err: list[bytes] = []
    reader = None
    if not stderr_tty:
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
        reader.start()
    try:
        terminal = _drain(master, proc)
    finally:
        os.close(master)
    if reader is not None:
        reader.join()
    return proc.returncode, terminal.decode(), b"".join(err).decode()


def _run(tmp_path: Path, family, *extra: str, **kw) -> tuple[int, str, str, Path]:
    """`mergepipe run` at a sketch budget (index, sketch scans, merge) in a fresh cache."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = write_config(tmp_path, family, budget="30%")
    rc, terminal, err = _cli([sys.executable, "-m", "mergepipe", "run", str(cfg), *extra], **kw)
    return rc, terminal, err, tmp_path / "out"


def _last_bar(text: str, label: str) -> str:
    frames = [f for f in re.split(r"[\r\n]", text) if f.startswith(f"{label}: ")]
    assert frames, f"no bar for {label!r} in {text!r}"
    return frames[-1]


def _outputs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_terminal_shows_a_bar_per_step_with_bytes_of_total_reaching_100_percent(tmp_path, tiny_family):
    rc, terminal, _, _ = _run(tmp_path, tiny_family, stderr_tty=True)
    assert rc == 0, terminal
    assert "\r" in terminal
    for label in STEPS:
        last = _last_bar(terminal, label)
        assert re.match(rf"{re.escape(label)}: 100%\|", last), last
        done, total = BYTES_OF_TOTAL.search(last).groups()
        assert done == total
        assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, [\d.]+[kMG]?B/s\]", last), last  # elapsed<ETA, rate


def test_calibration_shows_its_sequences_and_each_experts_scoring_scan(llama, tmp_path):
    from tests.helpers.tiny_llama import calibrated_config
    rc, terminal, _ = _cli([sys.executable, "-m", "mergepipe", "run", str(calibrated_config(tmp_path, llama, "30%"))],
                           stderr_tty=True)
    assert rc == 0, terminal
    assert re.match(r"calibrating: 100%\|.*\| (\d+)/\1 \[", _last_bar(terminal, "calibrating"))
    for expert in ("a", "b"):
        last = _last_bar(terminal, f"scoring {expert}")
        assert last.startswith(f"scoring {expert}: 100%|")
        done, total = BYTES_OF_TOTAL.search(last).groups()
        assert done == total


def test_a_pipe_gets_no_bar_and_no_carriage_return(tmp_path, tiny_family):
    rc, terminal, err, _ = _run(tmp_path, tiny_family, stderr_tty=False)
    assert rc == 0, err
    assert terminal == ""
    assert "merged -> " in err  # the summary stays
    assert "\r" not in err and "%|" not in err and not any(f"{label}:" in err for label in STEPS)


def test_quiet_prints_nothing_on_a_terminal(tmp_path, tiny_family):
    rc, terminal, _, out = _run(tmp_path, tiny_family, "-q", stderr_tty=True)
    assert rc == 0 and (out / "manifest.json").is_file()
    assert terminal == ""


def test_requested_progress_draws_on_the_tty_and_logs_one_end_line_per_step(tmp_path, tiny_family):
    """What a Snakemake rule sees: stderr piped to tee, MERGEPIPE_PROGRESS=1 and a terminal."""
    rc, terminal, err, _ = _run(tmp_path, tiny_family, stderr_tty=False, controlling_tty=True,
                                env=_env(MERGEPIPE_PROGRESS="1"))
    assert rc == 0, err
    assert "\r" not in err
    for label in STEPS:
        assert len(re.findall(rf"^{re.escape(label)}: [\d.]+ [KMG]?i?B in [\d.]+ s \(", err, re.M)) == 1, err
    # the terminal got the bars, each erased at its end (a line of spaces), never a log line
    assert terminal.count("\r") >= 2 * len(STEPS) and "merged -> " not in terminal


def test_requested_progress_without_a_terminal_logs_only_the_end_lines(tmp_path, tiny_family):
    rc, terminal, err, _ = _run(tmp_path, tiny_family, stderr_tty=False, env=_env(MERGEPIPE_PROGRESS="1"))
    assert rc == 0, err
    assert terminal == "" and "\r" not in err
    assert re.search(r"^merging: [\d.]+ MiB in [\d.]+ s \(", err, re.M), err


def test_outputs_are_byte_identical_with_and_without_progress(tmp_path, tiny_family):
    rc1, terminal, _, with_bars = _run(tmp_path / "bars", tiny_family, stderr_tty=True)
    rc2, _, _, quiet = _run(tmp_path / "quiet", tiny_family, "-q", stderr_tty=True)
    assert rc1 == rc2 == 0 and "merging: 100%" in terminal
    assert _outputs(with_bars) == _outputs(quiet)  # weights, manifest, config and card


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_workers_count_every_byte_and_redraws_are_at_most_ten_a_second(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.delenv(progress.ENV, raising=False)
    total, threads, steps = 8 * 20_000 * 3, 8, 20_000
    t0 = time.monotonic()
    with Progress(total, "counting", True) as prog:
        def work() -> None:
            for _ in range(steps):
                prog.step(3)
                time.sleep(0)  # yield, so the threads interleave over a few tenths of a second
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        time.sleep(0.35)
    seconds = time.monotonic() - t0
    assert prog.done == total
    frames = term.getvalue().count("\r")
    assert 1 <= frames <= 10 * seconds + 2
    assert term.getvalue().endswith("\n") and "counting: 100%|" in term.getvalue()


def test_disabled_progress_starts_no_thread_and_writes_nothing(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    before = threading.active_count()
    for enabled, request in ((False, ""), (True, "0")):
        monkeypatch.setenv(progress.ENV, request)
        with Progress(100, "off", enabled) as prog:
            assert threading.active_count() == before and not prog.enabled
            prog.step(100)
    assert term.getvalue() == ""


class _GoneTerminal(_Terminal):
    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def test_a_terminal_that_goes_away_ends_the_bar_not_the_step(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _GoneTerminal())
    monkeypatch.delenv(progress.ENV, raising=False)
    with Progress(10, "gone", True) as prog:
        prog.step(4)
        time.sleep(3 * progress.REDRAW_S)
        prog.step(6)
    assert prog.done == 10


@pytest.mark.slow
def test_snakemake_on_a_terminal_asks_for_bars_and_its_logs_hold_only_end_lines(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    env = {k: v for k, v in tool_env().items() if k != progress.ENV}
    exe = str(Path(sys.executable).parent / "snakemake")
    rc, terminal, _ = _cli([exe, MODEL, "--cores", "2"], stderr_tty=True, stdout_tty=True, controlling_tty=True,
                           env=env, cwd=ws)
    assert rc == 0, terminal[-4000:]
    log = (ws / "logs" / "merge.log").read_text()
    assert "\r" not in log
    assert re.search(r"^merging: [\d.]+ [KMG]?i?B in [\d.]+ s \(", log, re.M), log
    for index_log in (ws / "logs" / "index").iterdir():
        text = index_log.read_text()
        assert "\r" not in text and re.search(r"^(hashing|indexing) .+ in [\d.]+ s \(", text, re.M), text
