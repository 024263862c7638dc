"""Split merges (`merge --part` + `gather`) against the one-job merge, and `mergepipe gc`."""
import json
from pathlib import Path

import pytest

from mergepipe.cli import main
from mergepipe.output.run_record import record_path
from mergepipe.commands.parts import parse_part, partition
from mergepipe.errors import ConfigError
from mergepipe.checkpoint.safetensors import open_checkpoint
from tests.helpers import write_config


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _plan(tmp_path: Path, family: dict, **overrides) -> Path:
    cfg = write_config(tmp_path, family, **{"block_bytes": "64KiB", **overrides})
    assert main(["plan", str(cfg), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    return tmp_path / "plan.json"


@pytest.mark.parametrize("n, overrides", [
    (3, {"method": "ties", "parameters": {"density": 0.5}, "budget": "40%"}),
    # 8 parts of the tiny base: the embedding spans two groups' bytes, so part 3 is empty
    (8, {"method": "dare_ties", "parameters": {"density": 0.6}, "budget": "60%",
         "output": {"shard_bytes": "1MiB", "dtype": "float32"}}),
])
def test_split_merge_is_byte_identical_to_one_job(tmp_path, tiny_family, n, overrides):
    plan = _plan(tmp_path, tiny_family, **overrides)
    assert n < 8 or not partition(open_checkpoint(tiny_family["base"]), n)[2]
    cache = str(tmp_path / "cache")  # the plan's: its indexes are reused
    assert main(["merge", str(plan), "-o", str(tmp_path / "single"), "--cache-dir", cache, "-q"]) == 0
    assert main(["gc", "--cache-dir", cache, "-q"]) == 0  # else the parts find the merge in the store
    for i in range(n, 0, -1):  # any order: the parts are independent
        assert main(["merge", str(plan), "--part", f"{i}/{n}", "-o", str(tmp_path / "parts"), "--cache-dir", cache,
                     "-q"]) == 0
    assert not json.loads((tmp_path / "parts" / f"part-1-of-{n}.json").read_text())["from_store"]
    assert main(["gather", str(plan), str(tmp_path / "parts"), "--parts", str(n), "-o", str(tmp_path / "split"),
                 "--cache-dir", cache, "-q"]) == 0
    single, split = _files(tmp_path / "single"), _files(tmp_path / "split")
    assert single.keys() == split.keys() and len(single) > 3
    assert single == split
    # the split result went to the store like any merge: a second gather restores it
    assert main(["gather", str(plan), str(tmp_path / "parts"), "--parts", str(n), "-o", str(tmp_path / "again"),
                 "--cache-dir", cache, "-q"]) == 0
    assert _files(tmp_path / "again") == single
    assert "restored_from" in json.loads(record_path(tmp_path / "again").read_text())


def test_parts_of_a_stored_plan_merge_nothing_and_gather_restores(tmp_path, tiny_family):
    plan = _plan(tmp_path, tiny_family, budget="30%")
    cache = str(tmp_path / "cache")
    assert main(["merge", str(plan), "-o", str(tmp_path / "single"), "--cache-dir", cache, "-q"]) == 0
    for i in (1, 2):
        assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(tmp_path / "parts"), "--cache-dir", cache,
                     "-q"]) == 0
        info = json.loads((tmp_path / "parts" / f"part-{i}-of-2.json").read_text())
        assert info["from_store"] and info["tensors"] == {}
    assert main(["gather", str(plan), str(tmp_path / "parts"), "--parts", "2", "-o", str(tmp_path / "out"),
                 "--cache-dir", cache, "-q"]) == 0
    assert _files(tmp_path / "out") == _files(tmp_path / "single")
    # the store entry vanishes between the parts and the gather: a clear error, nothing published
    assert main(["gc", "--cache-dir", cache, "-q"]) == 0
    assert main(["gather", str(plan), str(tmp_path / "parts"), "--parts", "2", "-o", str(tmp_path / "out2"),
                 "--cache-dir", cache, "-q"]) == 6
    assert not (tmp_path / "out2").exists()


def test_gather_refuses_parts_of_another_plan_or_tampered_parts(tmp_path, tiny_family, capsys):
    plan_a = _plan(tmp_path, tiny_family, budget="30%")
    (tmp_path / "a.json").write_bytes(plan_a.read_bytes())
    plan_b = _plan(tmp_path, tiny_family, budget="60%")
    cache = str(tmp_path / "cache")
    for i in (1, 2):
        assert main(["merge", str(tmp_path / "a.json"), "--part", f"{i}/2", "-o", str(tmp_path / "parts"),
                     "--cache-dir", cache, "-q"]) == 0
    capsys.readouterr()
    assert main(["gather", str(plan_b), str(tmp_path / "parts"), "--parts", "2", "-o", str(tmp_path / "out"),
                 "--cache-dir", cache, "-q"]) == 6
    assert "part of another plan" in capsys.readouterr().err
    part = tmp_path / "parts" / "part-2-of-2.safetensors"
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    assert main(["gather", str(tmp_path / "a.json"), str(tmp_path / "parts"), "--parts", "2", "-o",
                 str(tmp_path / "out"), "--cache-dir", cache, "-q"]) == 6
    assert "rerun part 2/2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_partition_is_contiguous_balanced_and_complete(tiny_family):
    base = open_checkpoint(tiny_family["base"])
    for n in (1, 2, 5, 8, 100):
        groups = partition(base, n)
        assert len(groups) == n
        assert [name for g in groups for name in g] == list(base.tensors)
    assert parse_part("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "x", "1/0"):
        with pytest.raises(ConfigError):
            parse_part(bad)


def test_gc_keeps_referenced_merges_and_drops_the_rest(tmp_path, tiny_family, capsys):
    cfg = write_config(tmp_path, tiny_family, budget="30%")
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["run", str(cfg), "-q", "--budget", "60%", "-o", str(tmp_path / "other")]) == 0
    merges = tmp_path / "cache" / "merges"
    assert len(list(merges.iterdir())) == 2
    capsys.readouterr()
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "--keep", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out
    assert len(list(merges.iterdir())) == 2
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "--keep", str(tmp_path / "out"), "-q"]) == 0
    kept = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan_hash"]
    assert [p.name for p in merges.iterdir()] == [kept]
    assert main(["verify", str(tmp_path / "other"), "-q"]) == 0  # published outputs are untouched
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "--keep", str(tmp_path / "nope")]) == 2
