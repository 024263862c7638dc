"""The hostile-input promise (issue 5): every input in tests/corpus/ gives a nonzero
exit code, exactly one stderr line naming the file/tensor/key, no traceback, and
leaves nothing at the output path; an output that existed before is untouched.

Each case runs twice in-process through `mergepipe.cli.main`: once with no output,
once with a previous complete merge published at the output path. A few run again
as real subprocesses to check the process exit code and that no traceback escapes.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3

from mergepipe.cli import main
from tests.corpus import CASES, Ctx, write_params

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ctx(tiny_family, tmp_path_factory) -> Ctx:
    root = Path(tiny_family["root"])
    return Ctx(root / "base", tuple(root / f"expert_{k}" for k in range(3)),
               tmp_path_factory.mktemp("corpus-cache"))


@pytest.fixture(scope="module")
def previous(ctx, tmp_path_factory) -> Path:
    """A complete, verified merge (base + expert_2) to place at the output path."""
    work = tmp_path_factory.mktemp("previous")
    params = write_params(work, ctx)
    assert main(["run", str(params), "-q"]) == 0
    return work / "out"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root: kind, size, content hash (files), link target (symlinks)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_size, blake3(p.read_bytes()).hexdigest())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))  # a fifo: never opened here
    return out


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("mergepipe blocked for 60 s on a hostile input")


def _run_case(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        rc = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, capsys.readouterr().err


def _check_error(setup, rc: int, err: str) -> None:
    assert rc == setup.exit_code, (rc, err)
    assert err.count("\n") == 1 and err.startswith("mergepipe: error: "), err
    assert "Traceback" not in err
    for want in setup.expect:
        assert want in err, (want, err)


def test_corpus_is_big_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input(name, ctx, previous, tmp_path, capsys):
    work = tmp_path / "w"
    work.mkdir()
    setup = CASES[name].build(ctx, work)
    for existing in (False, True):
        if existing and setup.existing_ok:
            assert not setup.out.exists()
            shutil.copytree(previous, setup.out)
        before = snapshot(work)
        rc, err = _run_case(setup.argv, capsys)
        _check_error(setup, rc, err)
        # nothing at the output path, an existing output untouched, inputs untouched,
        # no temp folder or lock left beside the target
        assert snapshot(work) == before
        if not existing and setup.existing_ok:
            assert not os.path.lexists(setup.out)
        if setup.marker is not None:
            assert not setup.marker.exists(), "a pickle was unpickled"


def test_debug_shows_the_traceback(ctx, tmp_path):
    setup = CASES["unknown_dtype"].build(ctx, tmp_path)
    from mergepipe.errors import CheckpointError
    with pytest.raises(CheckpointError, match="F128"):
        main([*setup.argv, "--debug"])


@pytest.mark.parametrize("name", ["truncated_in_data", "pickle_only_folder", "expert_nan", "output_is_a_file",
                                  "header_deeply_nested"])
def test_hostile_input_subprocess(name, ctx, tmp_path):
    setup = CASES[name].build(ctx, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "mergepipe", *setup.argv], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    _check_error(setup, proc.returncode, proc.stderr)
    assert proc.stdout == ""
    if setup.existing_ok:
        assert not os.path.lexists(setup.out)
    if setup.marker is not None:
        assert not setup.marker.exists()


def test_nonfinite_allow_merges_anyway(ctx, tmp_path, capsys):
    """The escape hatch: `nonfinite: allow` merges an expert with NaN (and says nothing)."""
    setup = CASES["expert_nan"].build(ctx, tmp_path)
    params = Path(setup.argv[1])
    params.write_text(params.read_text() + "nonfinite: allow\n")
    assert main(setup.argv) == 0
    assert main(["verify", str(setup.out)]) == 0


def test_huge_finite_delta_merges(ctx, tmp_path):
    """|delta| = 1e30 is finite: its square overflows fp32, the plan must still be valid JSON."""
    from tests.corpus import _poison, rewrite_tensors, run
    bad = rewrite_tensors(ctx, tmp_path, _poison(1e30))
    setup = run(tmp_path, ctx, bad, (), 0)
    assert main(setup.argv) == 0
    assert main(["verify", str(setup.out)]) == 0
