"""`mergepipe gc`: it removes only the cache entries mergepipe wrote (never a user's file, in a
project folder used as the cache or in the derived folders), prunes what nothing keeps, honours
`--keep`, and two at once on a shared cache agree."""
from __future__ import annotations

from pathlib import Path

from mergepipe.cli import main
from tests.helpers import CALIBRATED, calibrated_plan, file_tree, write_config
import json
import os
import pytest


def test_gc_on_a_project_folder_removes_only_mergepipe_entries(tiny_family, tmp_path):
    """`gc --cache-dir .` (or cache_dir: .) in a project whose models/, parts/ and merges/ are the user's."""
    project = tmp_path / "project"
    for rel, data in {"models/llama/model.safetensors": b"weights", "models/notes.md": b"n",
                      "parts/chapter.tex": b"t", "merges/best/model.safetensors": b"m",
                      "stat/data.csv": b"1,2", "deltas/x.json.gz": b"z"}.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(data)
    before = file_tree(project)
    cfg = write_config(tmp_path, tiny_family, cache_dir=str(project), budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    ours = set(file_tree(project)) - set(before)
    assert any(p.startswith("merges/") for p in ours) and any(p.startswith("models/") for p in ours)
    assert main(["gc", "--cache-dir", str(project), "--indexes", "-q"]) == 0
    after = file_tree(project)
    assert {k: v for k, v in after.items() if k in before} == before  # every file of the user's kept
    assert not set(after) - set(before)  # every cache entry of ours removed


def test_two_gcs_at_once_on_a_shared_cache(tmp_path):
    """Two people run `mergepipe gc` on one shared cache folder: the slower one met entries the
    other had removed mid-walk (a FileNotFoundError traceback from rmtree). Now removed is removed."""
    import subprocess
    import sys
    cache = tmp_path / "cache"
    for _ in range(3):
        for i in range(150):
            entry = cache / "merges" / f"{i:064x}"
            entry.mkdir(parents=True)
            for j in range(20):
                (entry / f"model-{j}.safetensors").write_bytes(b"x")
        argv = [sys.executable, "-m", "mergepipe", "gc", "--cache-dir", str(cache), "-q"]
        procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        for p in procs:
            err = p.communicate(timeout=120)[1]
            assert p.returncode == 0 and err == "", err
        assert list((cache / "merges").iterdir()) == []


def _joint_entry(cache: Path, key: str) -> Path:
    from mergepipe.index.joint import encode
    path = cache / "joint" / f"{key}.stats"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(key, "karcher", {"t": b"\0" * 16}))
    return path


def test_gc_prunes_calibration_weighted_and_joint_entries_nothing_keeps(tiny_family, tmp_path):
    """`gc` pruned merges/ and parts/ only: importance artifacts, their energies and joint
    statistics of every text and family ever tried piled up for good. Now what no `--keep`
    plan or output names goes (a kept plan keeps its artifact, the energies made with it
    and its joint statistics)."""
    cache = tmp_path / "cache"
    kept = calibrated_plan(tiny_family, tmp_path / "a", cache, "the quick brown fox. " * 30)
    calibrated_plan(tiny_family, tmp_path / "b", cache, "0 1 2 3 4 5 6 7 8 9 zzz " * 30)
    assert len(list((cache / "calibration").iterdir())) == 2
    assert len(list((cache / "weighted").iterdir())) == 6  # 3 experts x 2 artifacts
    joint_kept, joint_gone = _joint_entry(cache, "1" * 64), _joint_entry(cache, "2" * 64)
    other = tmp_path / "joint-plan.json"
    other.write_text(json.dumps({"plan_hash": "f" * 64, "joint": {"key": "1" * 64}}))
    assert main(["gc", "--cache-dir", str(cache), "--keep", str(kept), "--keep", str(other), "-q"]) == 0
    artifact = json.loads(kept.read_text())["strategy"]["calibration"]["artifact"]
    from mergepipe.index.weighted import recorded_artifact
    from mergepipe.util.fs import hash_file
    assert [hash_file(p) for p in (cache / "calibration").iterdir()] == [artifact]
    assert {recorded_artifact(p) for p in (cache / "weighted").iterdir()} == {artifact}
    assert len(list((cache / "weighted").iterdir())) == 3
    assert joint_kept.exists() and not joint_gone.exists()
    # the kept plan's entries are reused as they are: same plan, nothing rebuilt
    before = {p: p.stat().st_mtime_ns for p in (cache / "calibration").iterdir()}
    assert calibrated_plan(tiny_family, tmp_path / "a", cache, "the quick brown fox. " * 30).read_bytes() \
        == kept.read_bytes()
    assert {p: p.stat().st_mtime_ns for p in (cache / "calibration").iterdir()} == before
    assert main(["gc", "--cache-dir", str(cache), "-q"]) == 0  # nothing kept: all go
    assert [list((cache / d).iterdir()) for d in ("calibration", "weighted", "joint")] == [[], [], []]


_LOOKALIKE = {"calibration": "a" * 40 + ".safetensors", "weighted": "b" * 40 + ".json", "joint": "c" * 64 + ".stats"}


_USER_FILES = {
    "other_name": lambda folder, sub: (folder / "notes.txt", "file"),
    "lookalike_name": lambda folder, sub: (folder / _LOOKALIKE[sub], "file"),
    "lookalike_folder": lambda folder, sub: (folder / _LOOKALIKE[sub], "dir"),
    "lookalike_link": lambda folder, sub: (folder / _LOOKALIKE[sub], "link"),
}


@pytest.mark.parametrize("sub", sorted(_LOOKALIKE))
@pytest.mark.parametrize("kind", sorted(_USER_FILES))
def test_gc_never_removes_a_users_file_in_the_derived_folders(sub, kind, tmp_path, capsys):
    """`--cache-dir` by mistake a project folder with its own calibration/, weighted/ or joint/
    (or a file dropped into the cache): only mergepipe's own entries may go. A file with an
    entry's name but not our content is kept and reported."""
    folder = tmp_path / "cache" / sub
    folder.mkdir(parents=True)
    target = tmp_path / "precious.bin"
    target.write_bytes(b"user data")
    path, what = _USER_FILES[kind](folder, sub)
    if what == "file":
        path.write_bytes(b"user data")
    elif what == "dir":
        path.mkdir()
        (path / "inside.txt").write_bytes(b"user data")
    else:
        path.symlink_to(target)
    assert main(["gc", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert os.path.lexists(path) and target.read_bytes() == b"user data"
    if kind == "lookalike_name":
        assert f"keep {path}" in capsys.readouterr().out


@pytest.mark.parametrize("keep", ["output_folder", "its_manifest_json", "plan_json"])
def test_gc_keep_names_the_calibration_of_an_output_however_it_is_given(keep, tiny_family, tmp_path):
    """`gc --keep out/manifest.json` (the file, not the folder) kept the stored merge but not
    the importance artifact its plan names: the plan sits under the manifest's `plan` key."""
    cfg = write_config(tmp_path, tiny_family, budget="40%", plan=CALIBRATED, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "calib.txt").write_text("the quick brown fox. " * 30)
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    arg = {"output_folder": tmp_path / "out", "its_manifest_json": tmp_path / "out" / "manifest.json",
           "plan_json": tmp_path / "plan.json"}[keep]
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "--keep", str(arg), "-q"]) == 0
    assert len(list((tmp_path / "cache" / "calibration").iterdir())) == 1
    assert len(list((tmp_path / "cache" / "weighted").iterdir())) == 3


_TEMPS = {  # folder -> (temp name a killed writer leaves, a user's hidden file that looks alike but is not ours)
    "calibration": (f".{'a' * 40}.safetensors.{'0' * 32}.tmp", ".notes.safetensors.x.tmp"),
    "weighted": (f".{'b' * 40}.json.k2j4_9xq.tmp", f".{'b' * 39}.json.k2j4_9xq.tmp"),
    "models": (f".{'c' * 40}.idx.abcdefgh.tmp", ".c.idx.abcdefgh.tmp"),
    "stat": (f".{'d' * 32}.json.abcdefgh.tmp", f".{'d' * 32}.json.tmp"),
}


@pytest.mark.parametrize("folder", sorted(_TEMPS))
def test_gc_removes_temp_files_a_killed_writer_left_once_they_are_old(folder, tmp_path):
    """A process killed with -9 while writing a cache entry (an OOM kill in a calibration pass,
    a cluster job's time limit) leaves `.<entry>.<random>.tmp`; nothing ever removed it. Now gc
    removes ours once a day old (a live writer's temp is younger), never a fresh one or a
    hidden file of the user's."""
    cache = tmp_path / "cache"
    (cache / folder).mkdir(parents=True)
    ours, users = _TEMPS[folder]
    old, fresh, mine = cache / folder / ours, cache / folder / ours.replace(".tmp", "1.tmp"), cache / folder / users
    for p in (old, fresh, mine):
        p.write_bytes(b"x")
    day_ago = os.stat(old).st_mtime - 2 * 86400
    for p in (old, mine):
        os.utime(p, (day_ago, day_ago))
    assert main(["gc", "--cache-dir", str(cache), "-q"]) == 0
    assert not old.exists() and fresh.exists() and mine.exists()


def test_gc_keeps_a_users_part_named_files(tiny_family, tmp_path, capsys):
    """`gc --cache-dir` on a project folder removed a user's parts/part-1-of-2.safetensors (any
    file with a part's name). A part file is now removed only beside its sidecar (which
    records the .safetensors' size); the part jobs' own files still go."""
    project = tmp_path / "project"
    (project / "parts").mkdir(parents=True)
    mine = {"part-1-of-2.safetensors": (Path(tiny_family["root"]) / "expert_1" / "model.safetensors").read_bytes(),
            "part-2-of-2.json": b'{"notes": 1}\n', "part-2-of-2.safetensors": b"x"}
    for name, data in mine.items():
        (project / "parts" / name).write_bytes(data)
    assert main(["gc", "--cache-dir", str(project), "-q"]) == 0
    assert {p.name: p.read_bytes() for p in (project / "parts").iterdir()} == mine
    cfg = write_config(tmp_path, tiny_family)
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan)]) == 0
    parts = tmp_path / "cache" / "parts"
    for i in (1, 2):
        assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(parts), "-q"]) == 0
    assert len(list(parts.iterdir())) == 4
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "-q"]) == 0
    assert not list(parts.iterdir())
