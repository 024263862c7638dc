import os
import subprocess
import sys

import pytest

from mergepipe.errors import OutputError
from mergepipe.output.publish import Publisher


def test_publish_replaces_atomically(tmp_path):
    target = tmp_path / "out"
    for version in ("one", "two"):
        pub = Publisher(target, force=True)
        with pub as tmp:
            (tmp / "f").write_text(version)
            pub.commit()
        assert (target / "f").read_text() == version
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_before_commit_leaves_target_untouched(tmp_path):
    target = tmp_path / "out"
    pub = Publisher(target, force=True)
    with pub as tmp:
        (tmp / "f").write_text("good")
        pub.commit()
    with pytest.raises(RuntimeError):
        with Publisher(target, force=True) as tmp:
            (tmp / "f").write_text("half")
            raise RuntimeError("crash")
    assert (target / "f").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_lock_blocks_second_writer_and_stale_lock_is_cleaned(tmp_path):
    target = tmp_path / "out"
    with Publisher(target):
        with pytest.raises(OutputError, match="locked"):
            with Publisher(target):
                pass
    # a writer killed with -9 leaves its lock and temp folder behind
    code = ("import os; from mergepipe.output.publish import Publisher; p = Publisher(%r); t = p.__enter__(); "
            "(t / 'x').write_text('partial'); os._exit(0)") % str(target)
    subprocess.run([sys.executable, "-c", code], check=True)
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())
    pub = Publisher(target, force=True)
    with pub as tmp:
        (tmp / "f").write_text("ok")
        pub.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        with Publisher(tmp_path / "out"):
            pass
