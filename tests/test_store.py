"""The cache (index/store.py and the derived entries: indexes, sketches, calibration artifacts,
weighted energies) as untrusted input: an entry truncated, edited in place or copied under another
key is rebuilt, never used, and the rebuilt entry gives the same plan as a fresh cache's; a cache
that cannot be written is a one-line error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.cli import main
from tests.helpers import CALIBRATED, calibrated_plan, write_config
import shutil
import struct
from mergepipe.index import binfmt, sketch, trailed
from mergepipe.output.run_record import record_path
from mergepipe.util.fs import canonical_json
from tests.helpers.tiny_llama import calibrated_config as _config


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
    fresh = calibrated_plan(tiny_family, tmp_path / "fresh", tmp_path / "c0", "the quick brown fox. " * 30).read_bytes()
    other = tmp_path / "c1"
    calibrated_plan(tiny_family, tmp_path / "other", other, "0 1 2 3 4 5 6 7 8 9 zzz " * 30)
    folder, edit = _CACHE_DAMAGE[damage]
    cache = tmp_path / "c0"
    for p in sorted((cache / folder).iterdir()):
        edit(p, next((other / folder).iterdir()))
    assert calibrated_plan(tiny_family, tmp_path / "fresh", cache, "the quick brown fox. " * 30).read_bytes() == fresh


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
        plans.append(calibrated_plan(tiny_family, tmp_path / run, tmp_path / f"c{run}", text).read_bytes())
    first, second = plans
    assert json.loads(first)["strategy"] == json.loads(second)["strategy"]


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
    cfg = write_config(tmp_path, tiny_family, budget="40%", plan=CALIBRATED, cache_dir=str(cache))
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


def _merge(cfg: Path, out: Path) -> bytes:
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["verify", str(out)]) == 0
    return (out / "model.safetensors").read_bytes()


def test_another_models_index_copied_under_this_key_is_rebuilt(tiny_family, tmp_path):
    """A model index (.idx) of another expert of the same shapes copied over this expert's
    entry is self-consistent (its block hashes give its content hash): at a budget where
    every block is sketched nothing was read to catch it, and a model of the other
    expert's sketches was published that plain verify called OK. The recorded file
    fingerprints are now checked against the index's block hashes: it is rebuilt."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, tiny_family, budget="3%")
    want = _merge(cfg, out)
    plan = json.loads((out / "manifest.json").read_text())["plan"]
    by_name = {e["name"]: e["content_hash"] for e in plan["experts"]}
    idx = {binfmt.decode_model(p.read_bytes()).content_hash: p for p in (tmp_path / "cache" / "models").glob("*.idx")}
    shutil.copyfile(idx[by_name["e2"]], idx[by_name["e1"]])  # two single-file experts, same shapes
    shutil.rmtree(out)
    shutil.rmtree(tmp_path / "cache" / "merges")
    assert _merge(cfg, out) == want
    assert json.loads(record_path(out).read_text())["index_builds"] >= 1


def test_a_sketch_scale_edited_alone_is_rebuilt(tiny_family, tmp_path):
    """A sketch header's scales (alpha) are not covered by the codes' blake3: halved in place,
    the file passed every check and the merge used them. alpha must be float32(s1 / nnz)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path, tiny_family, budget="3%")
    want = _merge(cfg, out)
    for f in (tmp_path / "cache" / "sketch").glob("*.sk"):
        raw = f.read_bytes()
        with open(f, "rb") as fh:
            off, hlen = trailed.find(fh, len(raw), sketch.MAGIC)
        head = json.loads(raw[off:off + hlen])
        for rows in head["tensors"].values():
            for r in rows:
                if r:
                    r[2] = r[2] / 2
        new = canonical_json(head)
        f.write_bytes(raw[:off] + new + struct.pack("<Q", len(new)) + sketch.MAGIC)
    shutil.rmtree(out)
    shutil.rmtree(tmp_path / "cache" / "merges")
    assert _merge(cfg, out) == want


def test_another_experts_weighted_energies_copied_under_this_key_are_rebuilt(llama, tmp_path):
    """A calibrated plan's weighted/ entry (importance-weighted block energies) of another
    expert of the same shapes, copied over this expert's entry, passed every check (format,
    tensors, block counts, its own blake3): the plan chose blocks by the other expert's
    energies and a model of another plan was published that plain verify called OK. An entry
    now records its own key (expert, base, artifact, layout) and is rebuilt when another's."""
    cfg = _config(tmp_path, llama, "30%")
    out = tmp_path / "out-30"
    assert main(["run", str(cfg), "-q"]) == 0
    want = (out / "model.safetensors").read_bytes()
    plan_hash = json.loads((out / "manifest.json").read_text())["plan_hash"]
    entries = sorted((llama / "cache" / "weighted").glob("*.json"))
    assert len(entries) == 2
    shutil.copyfile(entries[0], entries[1])
    shutil.rmtree(out)
    shutil.rmtree(llama / "cache" / "merges")
    assert main(["run", str(cfg), "-q"]) == 0
    assert main(["verify", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["plan_hash"] == plan_hash
    assert (out / "model.safetensors").read_bytes() == want


def test_an_importance_artifact_of_another_recipe_copied_under_this_key_is_rebuilt(llama, tmp_path):
    """The calibration artifact of the same base and text made with another max_tokens, copied
    over this recipe's file, passed every check (base and text hashes, vectors' blake3): base
    and text do not pin the recipe, and the plan then named the copy, so even --replay agreed.
    The artifact now records its own store key and is rebuilt when it holds another's."""
    arts = llama / "cache" / "calibration"  # (the fixture's cache is shared: other tests' artifacts too)
    shutil.rmtree(arts, ignore_errors=True)
    small = _config(tmp_path / "s", llama, "30%", max_tokens=64)
    assert main(["run", str(small), "-q"]) == 0
    (art_small,) = arts.glob("*.safetensors")
    big = _config(tmp_path / "b", llama, "30%")  # max_tokens 512
    out = tmp_path / "b" / "out-30"
    assert main(["run", str(big), "-q"]) == 0
    want = (out / "model.safetensors").read_bytes()
    plan_hash = json.loads((out / "manifest.json").read_text())["plan_hash"]
    (art_big,) = set(arts.glob("*.safetensors")) - {art_small}
    assert art_big.read_bytes() != art_small.read_bytes()
    shutil.copyfile(art_small, art_big)
    shutil.rmtree(out)
    shutil.rmtree(llama / "cache" / "merges")
    assert main(["run", str(big), "-q"]) == 0
    assert json.loads((out / "manifest.json").read_text())["plan_hash"] == plan_hash
    assert (out / "model.safetensors").read_bytes() == want
