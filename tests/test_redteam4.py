"""Red-team pass 4 (issue 15): what the third pass left open (gc of the derived cache
folders, a stacked folder whose sources changed, transformers' output under -q) and the
ordinary mistakes this pass tried. Each test used to lose data, publish a stale model,
keep garbage forever or print what -q promises not to; hostile inputs that only need a
one-line error are in tests/corpus/."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mergepipe.cli import main
from tests.helpers import write_config

_CAL = {"strategy": "calibrated", "text": "calib.txt", "max_tokens": 64, "seq_len": 32}


def _calibrated_plan(family, work: Path, cache: Path, text: str) -> Path:
    work.mkdir(exist_ok=True)
    (work / "calib.txt").write_text(text)
    cfg = write_config(work, family, budget="40%", plan=_CAL, cache_dir=str(cache))
    assert main(["plan", str(cfg), "-q", "-o", str(work / "plan.json")]) == 0
    return work / "plan.json"


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
    kept = _calibrated_plan(tiny_family, tmp_path / "a", cache, "the quick brown fox. " * 30)
    _calibrated_plan(tiny_family, tmp_path / "b", cache, "0 1 2 3 4 5 6 7 8 9 zzz " * 30)
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
    assert _calibrated_plan(tiny_family, tmp_path / "a", cache, "the quick brown fox. " * 30).read_bytes() \
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


def _flip_in_place(path: Path) -> None:
    """One byte flipped near the end (tensor data), size and mtime restored."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 10)
        b = f.read(1)
        f.seek(st.st_size - 10)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _replace_with_other(path: Path) -> None:
    other = path.with_name("x.tmp")
    other.write_bytes(path.read_bytes())  # same bytes, another inode and ctime
    os.replace(other, path)


_SOURCE_EDITS = {
    "weights_flipped_mtime_restored": lambda m: _flip_in_place(m / "model.safetensors"),
    "config_replaced_by_a_copy": lambda m: _replace_with_other(m / "config.json"),
    "weights_gone": lambda m: (m / "model.safetensors").unlink(),
}


def _stacked_project(family, tmp_path: Path) -> tuple[Path, Path]:
    """base and expert_1 copied into tmp_path, a slices config stacking them, imported as p.yaml."""
    import shutil
    import yaml
    root = Path(family["root"])
    for m in ("base", "expert_1"):
        shutil.copytree(root / m, tmp_path / m)
    mk = tmp_path / "mk.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "slices": [  # mergekit reads them from the cwd
        {"sources": [{"model": str(tmp_path / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(tmp_path / "expert_1"), "layer_range": [2, 4]}]}]}))
    params = tmp_path / "p.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    return mk, params


@pytest.mark.parametrize("command", ["run", "plan", "merge"])
@pytest.mark.parametrize("edit", sorted(_SOURCE_EDITS))
def test_a_stacked_folder_whose_source_changed_is_refused(edit, command, tiny_family, tmp_path, capsys):
    """`import-mergekit` of a slices config builds P.stacked once; a source model changed
    afterwards (retrained, re-downloaded, edited in place with its mtime restored) left the
    stacked folder stale, and `run` said "up to date", `plan`/`merge` merged the old layers:
    a model that is not the config's. Now each refuses (exit 6) naming the changed file and
    the import to rerun, and after the rerun the merge has the new bytes."""
    mk, params = _stacked_project(tiny_family, tmp_path)
    assert main(["run", str(params), "-q"]) == 0
    assert main(["plan", str(params), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    out = tmp_path / "merged-p"  # named after p.yaml
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _SOURCE_EDITS[edit](tmp_path / "expert_1")
    capsys.readouterr()
    argv = {"run": ["run", str(params)], "plan": ["plan", str(params), "-o", str(tmp_path / "plan2.json")],
            "merge": ["merge", str(tmp_path / "plan.json"), "-o", str(out), "--root", str(tmp_path)]}[command]
    assert main([*argv, "-q"]) == 6
    err = capsys.readouterr().err
    assert "stale stacked model" in err and "expert_1" in err and "import-mergekit" in err, err
    assert len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not (tmp_path / "plan2.json").exists()
    if edit != "weights_gone":
        assert main(["import-mergekit", str(mk), "-o", str(params), "--force", "-q"]) == 0
        assert main(["run", str(params), "-q"]) == 0
        assert (out / "model.safetensors").read_bytes() != before["model.safetensors"] or edit.startswith("config")


def _warn_on_load(monkeypatch):
    """transformers warning while loading the base (as it does for unused config keys, a
    deprecated argument...): through its logger and through the warnings module."""
    import warnings
    import transformers
    from transformers.utils import logging as hf_logging
    original = transformers.AutoTokenizer.from_pretrained

    def noisy(*args, **kwargs):
        hf_logging.get_logger("transformers.test").warning("a transformers warning")
        warnings.warn("a library warning", FutureWarning)
        return original(*args, **kwargs)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", noisy)


_NOISE = {
    "text_longer_than_the_context": lambda monkeypatch: None,  # 9000 chars > the tiny tokenizer's 2048
    "library_warning_while_loading": _warn_on_load,
}


@pytest.mark.parametrize("noise", sorted(_NOISE))
def test_calibration_under_q_prints_nothing(noise, tiny_family, tmp_path, capfd, monkeypatch):
    """`mergepipe plan -q` of a calibrated config printed transformers' "Token indices sequence
    length is longer than the specified maximum" (the text is cut into seq_len sequences on
    purpose) and whatever else it logs while loading. -q is quiet now; transformers' own
    verbosity is left as it was."""
    from transformers.utils import logging as hf_logging
    _NOISE[noise](monkeypatch)
    level = hf_logging.get_verbosity()
    capfd.readouterr()
    _calibrated_plan(tiny_family, tmp_path, tmp_path / "cache", "the quick brown fox jumps. " * 340)
    assert capfd.readouterr().err == ""
    assert hf_logging.get_verbosity() == level


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["expert_1", "expert_1/merged", "base/sub/p.yaml"])
@pytest.mark.parametrize("command", ["run", "merge", "import-mergekit"])
def test_nothing_is_written_into_a_source_model_of_a_stacked_input(command, target, tiny_family, tmp_path):
    """The stacked folder's source models are the real inputs, yet only the stacked folder was
    protected: `run p.yaml -o expert_1 --force` (after "not a mergepipe output") replaced the
    user's expert_1 with the merge, and `import-mergekit mk.yml -o base/p.yaml` built p.stacked
    and wrote p.yaml inside the base. Now every one is refused (exit 7), even with --force."""
    mk, params = _stacked_project(tiny_family, tmp_path)
    assert main(["plan", str(params), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    before = {m: _tree(tmp_path / m) for m in ("base", "expert_1")}
    argv = {"run": ["run", str(params), "-o"], "merge": ["merge", str(tmp_path / "plan.json"), "-o"],
            "import-mergekit": ["import-mergekit", str(mk), "-o"]}[command]
    path = tmp_path / target
    if command == "import-mergekit" and not target.endswith(".yaml"):
        path = path / "p.yaml"
    assert main([*argv, str(path), "--force", "-q", *(["--root", str(tmp_path)] if command == "merge" else [])]) == 7
    assert {m: _tree(tmp_path / m) for m in ("base", "expert_1")} == before
    assert not (tmp_path / "base" / "sub").exists() and not (tmp_path / "expert_1" / "merged").exists()


@pytest.mark.parametrize("argv", [["demo", "--", "--help"], ["demo", "--", "-h"]])
def test_demo_help_as_the_cli_help_says_prints_help(argv, tmp_path, monkeypatch, capsys):
    """`mergepipe --help` says "see `mergepipe demo -- --help`": that wrote a demo family into
    a folder named `--help` (argparse kept the `--`, so `--help` became the output folder)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "--preset" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _fsize_limit(nbytes: int):
    def preexec() -> None:
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us; ignored: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return preexec


_CACHE_WRITE_FAILURES = {  # (folder made a file, file-size limit)
    "calibration_folder_is_a_file": ("calibration", None),
    "weighted_folder_is_a_file": ("weighted", None),
    "artifact_over_the_file_size_limit": (None, 50_000),  # the artifact is ~110 KB, the energies ~6 KB
}


@pytest.mark.parametrize("failure", sorted(_CACHE_WRITE_FAILURES))
def test_a_calibration_cache_that_cannot_be_written_is_a_one_line_error(failure, tiny_family, tmp_path):
    """A full disk, a file-size limit or a damaged cache (calibration/ or weighted/ a file)
    while the calibrated strategy stores its artifact or energies: a FileExistsError/OSError
    traceback. Now one line naming the cache file (exit 7, as the index store's)."""
    import subprocess
    import sys
    cache = tmp_path / "cache"
    cfg = write_config(tmp_path, tiny_family, budget="40%", plan=_CAL, cache_dir=str(cache))
    (tmp_path / "calib.txt").write_text("the quick brown fox. " * 30)
    plain = tmp_path / "plain"
    plain.mkdir()
    plain_cfg = write_config(plain, tiny_family, budget="40%", cache_dir=str(cache))
    assert main(["plan", str(plain_cfg), "-q", "-o", str(plain / "p.json")]) == 0  # indexes in the cache
    folder, limit = _CACHE_WRITE_FAILURES[failure]
    if folder is not None:
        cache.mkdir(exist_ok=True)
        (cache / folder).write_text("")
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "plan", str(cfg), "-q", "-o", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=_fsize_limit(limit) if limit else None)
    assert proc.returncode == 7, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot write" in proc.stderr and str(cache) in proc.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("keep", ["output_folder", "its_manifest_json", "plan_json"])
def test_gc_keep_names_the_calibration_of_an_output_however_it_is_given(keep, tiny_family, tmp_path):
    """`gc --keep out/manifest.json` (the file, not the folder) kept the stored merge but not
    the importance artifact its plan names: the plan sits under the manifest's `plan` key."""
    cfg = write_config(tmp_path, tiny_family, budget="40%", plan=_CAL, cache_dir=str(tmp_path / "cache"))
    (tmp_path / "calib.txt").write_text("the quick brown fox. " * 30)
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["plan", str(cfg), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    arg = {"output_folder": tmp_path / "out", "its_manifest_json": tmp_path / "out" / "manifest.json",
           "plan_json": tmp_path / "plan.json"}[keep]
    assert main(["gc", "--cache-dir", str(tmp_path / "cache"), "--keep", str(arg), "-q"]) == 0
    assert len(list((tmp_path / "cache" / "calibration").iterdir())) == 1
    assert len(list((tmp_path / "cache" / "weighted").iterdir())) == 3


def test_a_corpus_sized_calibration_text_is_read_only_as_far_as_max_tokens_needs(tiny_family, tmp_path, monkeypatch):
    """`plan.text` pointing at a whole corpus (an ordinary slip: the training set, not a sample):
    the calibration pass read and tokenized all of it to keep `max_tokens` tokens (a 30 MB
    text took 108 s and 13 GB for 64 tokens; a GB-sized one is killed for memory). Now only
    a prefix that holds `max_tokens` tokens and a margin is tokenized, with the same tokens
    (so the same importance), while the text's hash still covers every byte."""
    import transformers
    seen: list[int] = []
    original = transformers.AutoTokenizer.from_pretrained

    def recording(*args, **kwargs):
        tok = original(*args, **kwargs)
        call = type(tok).__call__
        monkeypatch.setattr(type(tok), "__call__", lambda self, text, *a, **k: (seen.append(len(text)),
                                                                                  call(self, text, *a, **k))[1])
        return tok
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    line = "the quick brown fox jumps over the lazy dog; 0123456789\n"
    big = line * (5_000_000 // len(line))
    plans = {}
    for name, text in (("big", big), ("small", big[:5000])):
        plan_path = _calibrated_plan(tiny_family, tmp_path / name, tmp_path / f"c-{name}", text)
        plans[name] = json.loads(plan_path.read_text())
    assert max(seen) < 1_000_000, seen
    assert plans["big"]["reads"] == plans["small"]["reads"]
    from blake3 import blake3
    assert plans["big"]["strategy"]["calibration"]["text"] == blake3(big.encode()).hexdigest()


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


@pytest.mark.parametrize("damage", ["truncated", "not_a_mapping", "sources_not_a_mapping"])
def test_a_damaged_record_of_a_stacks_sources_is_a_one_line_error(damage, tiny_family, tmp_path, capsys):
    """stack-sources.json half-written or edited: refused in one line (exit 6), never a traceback
    and never taken as "fresh"."""
    _, params = _stacked_project(tiny_family, tmp_path)
    record = tmp_path / "p.stacked" / "stack-sources.json"
    record.write_text({"truncated": '{"sources": ', "not_a_mapping": "[1, 2]",
                       "sources_not_a_mapping": '{"sources": [1], "rerun": "x"}'}[damage])
    capsys.readouterr()
    assert main(["run", str(params), "-q"]) == 6
    err = capsys.readouterr().err
    assert "stack-sources.json" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
