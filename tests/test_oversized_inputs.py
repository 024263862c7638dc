"""A model file or /dev/zero given where a config or a plan goes is a one-line error without being
read whole (a config is read up to 16 MiB, a JSON file only past its first bytes if it starts
like an object)."""
from __future__ import annotations

import pytest

from mergepipe.cli import main
from tests.helpers import file_tree, one_line_error


@pytest.mark.parametrize("argv, want", [
    (["run", "BIG"], "not a config file"),
    (["import-mergekit", "BIG", "-o", "OUT/params.yaml"], "not a config file"),
    (["merge", "BIG", "-o", "OUT/m"], "not a JSON object"),
    (["gc", "--cache-dir", "OUT/cache", "--keep", "BIG"], "not a JSON object"),
    (["explain", "BIG"], "not a JSON object"),
])
def test_a_model_file_or_dev_zero_given_as_config_or_plan_is_not_read_whole(argv, want, tmp_path, capsys):
    """`mergepipe run /dev/zero` was killed by the OOM killer after 20 GB, and a model file
    given as params.yaml or plan.json was read whole into memory before the error. A config is
    read up to 16 MiB, a plan only past its first bytes if it starts like a JSON object."""
    big = tmp_path / "model.safetensors"
    with open(big, "wb") as f:  # sparse: 17 MiB of zero bytes, like /dev/zero or a header's length
        f.truncate(17 << 20)
    argv = [a.replace("BIG", str(big)).replace("OUT", str(tmp_path)) for a in argv]
    before = file_tree(tmp_path)
    capsys.readouterr()
    assert main([*argv, "-q"]) == 2
    one_line_error(capsys, str(big), want)
    assert file_tree(tmp_path) == before
