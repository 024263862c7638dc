"""Red-team of the features that landed after the first two passes (issue 15): the
tokenizer source, layer stacking, the calibrated strategy's and joint methods' cache
entries, per-tensor settings, split merges, sweeps and run's no-op record. Each test is
an ordinary mistake or accident that used to lose data, publish a wrong model, or say
"up to date" about a stale one; hostile inputs that only need a one-line error are in
tests/corpus/ (the section after "red-team of the newer features")."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.cli import main
from tests.helpers import write_config


def _plan_hash(out: Path) -> str:
    return json.loads((out / "manifest.json").read_text())["plan_hash"]


@pytest.mark.parametrize("edit", ["tokenizer_file", "tokenizer_link_target", "calibration_text"])
def test_run_is_not_a_noop_after_an_input_outside_the_models_changed(edit, tiny_family, tmp_path):
    """run's no-op record keyed only the model folders: after an edit of the tokenizer source's
    files (or the blob its HF-style link points at) or of the calibration text, `run` said
    "up to date" and kept the stale output, which verify calls OK."""
    base = Path(tiny_family["root"]) / "base"
    tok, blobs = tmp_path / "tok", tmp_path / "blobs"
    tok.mkdir()
    blobs.mkdir()
    (tok / "config.json").write_bytes((base / "config.json").read_bytes())
    (blobs / "abc").write_bytes((base / "tokenizer.json").read_bytes())
    (tok / "tokenizer.json").symlink_to(blobs / "abc")
    (tok / "tokenizer_config.json").write_bytes((base / "tokenizer_config.json").read_bytes())
    (tmp_path / "calib.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    extra = {"plan": {"strategy": "calibrated", "text": "calib.txt", "max_tokens": 64, "seq_len": 32}} \
        if edit == "calibration_text" else {}
    cfg = write_config(tmp_path, tiny_family, budget="50%", **extra,
                       output={"dir": str(tmp_path / "out"), "tokenizer_source": "tok"})
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-q"]) == 0
    before = _plan_hash(out)
    if edit == "tokenizer_file":
        (tok / "tokenizer_config.json").write_text('{"model_max_length": 7}')
    elif edit == "tokenizer_link_target":
        (blobs / "abc").write_text('{"version": "edited"}')
    else:
        (tmp_path / "calib.txt").write_text("0 1 2 3 4 5 6 7 8 9 zzz qqq xxx " * 20)
    assert main(["run", str(cfg), "-q"]) == 0
    assert _plan_hash(out) != before
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tok / name).read_bytes()
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["plan_hash"] == _plan_hash(out)


def test_two_imports_of_one_stacking_config_at_once(tiny_family, tmp_path):
    """Two `import-mergekit` of a stacking config at once (a shared folder, two terminals): both
    removed and renamed the stacked folder unlocked (a FileNotFoundError/ENOTEMPTY traceback,
    or no folder left). Now one builds, the other waits its turn or is refused by the lock."""
    import subprocess
    import sys
    import yaml
    root = Path(tiny_family["root"])
    mk = tmp_path / "mk.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(root / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(root / "expert_1"), "layer_range": [2, 4]}]}]}))
    argv = [sys.executable, "-m", "mergepipe", "import-mergekit", str(mk), "-o", str(tmp_path / "p.yaml"),
            "--force", "-q"]
    assert main(argv[3:]) == 0

    def files() -> dict:  # stack-sources.json's stats are the written files' own stat keys: new each build
        got = {p.name: p.read_bytes() for p in (tmp_path / "p.stacked").iterdir()}
        record = json.loads(got.pop("stack-sources.json"))
        assert sorted(record.pop("stats")) == sorted(record["files"])
        return {**got, "stack-sources.json": record}
    want = files()
    for _ in range(3):
        procs = [subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for p in procs:
            err = p.communicate(timeout=120)[1]
            assert p.returncode in (0, 7), err
            assert "Traceback" not in err and (p.returncode == 0 or "locked by another" in err), err
        assert files() == want
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mk.yml", "p.stacked", "p.yaml"]


_CAL = {"strategy": "calibrated", "text": "calib.txt", "max_tokens": 64, "seq_len": 32}


def _calibrated_plan(family, work: Path, cache: Path, text: str) -> bytes:
    work.mkdir(exist_ok=True)
    (work / "calib.txt").write_text(text)
    cfg = write_config(work, family, budget="40%", plan=_CAL, cache_dir=str(cache))
    assert main(["plan", str(cfg), "-q", "-o", str(work / "plan.json")]) == 0
    return (work / "plan.json").read_bytes()


def _damage_weighted(path: Path) -> None:
    data = json.loads(path.read_text())
    data["tensors"].pop(sorted(data["tensors"])[0])
    path.write_text(json.dumps(data))


def _reverse_artifact_rows(path: Path) -> None:
    """Every rows vector reversed in place: still well-formed, finite and >= 0, other importance."""
    import numpy as np
    from mergepipe.checkpoint.safetensors import parse_header
    data = bytearray(path.read_bytes())
    for t in parse_header(path).tensors:
        if t.name.endswith("::rows"):
            span = slice(t.begin, t.begin + t.nbytes)
            data[span] = np.frombuffer(bytes(data[span]), "<f4")[::-1].tobytes()
    path.write_bytes(bytes(data))


def _reverse_energies(path: Path) -> None:
    data = json.loads(path.read_text())
    data["tensors"] = {k: v[::-1] for k, v in data["tensors"].items()}
    path.write_text(json.dumps(data))


_CACHE_DAMAGE = {
    "artifact_values_edited_in_place": ("calibration", lambda p, other: _reverse_artifact_rows(p)),
    "energies_values_edited_in_place": ("weighted", lambda p, other: _reverse_energies(p)),
    "artifact_truncated": ("calibration", lambda p, other: p.write_bytes(p.read_bytes()[:1000])),
    "artifact_of_another_text": ("calibration", lambda p, other: p.write_bytes(other.read_bytes())),
    "energies_not_json": ("weighted", lambda p, other: p.write_text('{"format": 1, "tens')),
    "energies_without_tensors": ("weighted", lambda p, other: p.write_text('{"format": 1, "tensors": {}}')),
    "energies_missing_one_tensor": ("weighted", lambda p, other: _damage_weighted(p)),
}


@pytest.mark.parametrize("damage", sorted(_CACHE_DAMAGE))
def test_damaged_calibration_cache_entries_are_rebuilt(damage, tiny_family, tmp_path):
    """The calibrated strategy's cache entries are untrusted like the rest of the store: a
    truncated or unparsable one was a hard error ("delete it"), one made from another text was
    used, and an energies entry missing tensors was taken as "not covered", silently ranking
    those blocks last (another plan). Now each is rebuilt: the plan is the fresh cache's."""
    fresh = _calibrated_plan(tiny_family, tmp_path / "fresh", tmp_path / "c0", "the quick brown fox. " * 30)
    other = tmp_path / "c1"
    _calibrated_plan(tiny_family, tmp_path / "other", other, "0 1 2 3 4 5 6 7 8 9 zzz " * 30)
    folder, edit = _CACHE_DAMAGE[damage]
    cache = tmp_path / "c0"
    for p in sorted((cache / folder).iterdir()):
        edit(p, next((other / folder).iterdir()))
    assert _calibrated_plan(tiny_family, tmp_path / "fresh", cache, "the quick brown fox. " * 30) == fresh


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


@pytest.mark.parametrize("ref", ["..", ".", "", "../../x"])
def test_a_damaged_hub_ref_never_names_a_folder_outside_snapshots(ref, tmp_path, monkeypatch):
    """refs/main holding ".." resolved the model to `snapshots/..`, the repo folder itself."""
    from mergepipe.config.hf_cache import hub_snapshot
    from mergepipe.errors import ConfigError
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--m"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(ref)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    assert hub_snapshot("org/m") == repo / "snapshots" / ("a" * 40)  # the only snapshot
    (repo / "snapshots" / ("b" * 40)).mkdir()
    with pytest.raises(ConfigError, match="2 cached snapshots"):
        hub_snapshot("org/m")


@pytest.mark.parametrize("command", ["plan", "import-mergekit"])
@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_an_o_file_inside_an_input_model_is_refused_even_with_force(command, victim, tiny_family, tmp_path,
                                                                   monkeypatch):
    """`plan cfg -o models/base/model.safetensors --force` (a slip of -o; --force to get past
    "not a mergepipe plan") replaced the base's weights with the plan's JSON; `import-mergekit
    ... -o models/base/config.json --force` its config with params.yaml."""
    import shutil
    import yaml
    base = tmp_path / "models" / "base"
    shutil.copytree(Path(tiny_family["root"]) / "base", base)
    expert = Path(tiny_family["root"]) / "expert_1"
    if command == "plan":
        argv = ["plan", str(write_config(tmp_path, tiny_family, base=str(base)))]
    else:
        mk = tmp_path / "mk.yml"
        monkeypatch.chdir(tmp_path)  # where mergekit (and the import) reads models/base from
        mk.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "models/base",
                                      "models": [{"model": str(expert), "parameters": {"weight": 1.0}}]}))
        argv = ["import-mergekit", str(mk)]
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    assert main([*argv, "-o", str(base / victim), "--force", "-q"]) == 7
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert main([*argv, "-o", str(tmp_path / "elsewhere.out"), "--force", "-q"]) == 0


def test_a_rebuilt_calibration_artifact_gives_the_same_plan(tiny_family, tmp_path, monkeypatch):
    """The artifact's blake3 is in the plan: two calibration passes on the same inputs must
    write the same bytes, however long each took (its wall time once went into the file, so a
    rebuilt artifact changed the plan hash)."""
    import itertools
    from mergepipe.calibrate import fisher
    text = "the quick brown fox. " * 30
    plans = []
    for run, step in (("a", 7.3), ("b", 1.1)):  # a slow pass, then a fast one
        clock = itertools.count(0.0, step)
        monkeypatch.setattr(fisher.time, "monotonic", lambda: next(clock))
        plans.append(_calibrated_plan(tiny_family, tmp_path / run, tmp_path / f"c{run}", text))
    first, second = plans
    assert json.loads(first)["strategy"] == json.loads(second)["strategy"]
