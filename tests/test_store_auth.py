"""Stored merges are authenticated with the user's store key (index/store_key.py): an entry a
shared cache's other writers put under this plan's hash is merged again, never published."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergepipe.cli import main
from mergepipe.index.cache import STORE_MAC
from mergepipe.index.store_key import KEY_BYTES, KEY_ENV, entry_mac, key_path, load_key
from mergepipe.output.manifest import MANIFEST, manifest_hash, write_manifest
from mergepipe.output.run_record import record_path
from tests.helpers import write_config


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def _restored(out: Path) -> bool:
    return "restored_from" in json.loads(record_path(out).read_text())


def _run(cfg: Path, out: Path, *extra: str) -> int:
    return main(["run", str(cfg), "-q", "--output", str(out), *extra])


@pytest.fixture
def two_merges(tmp_path, tiny_family):
    """Plan A (30%) and plan B (full) merged and stored in one cache; their outputs."""
    cfg = write_config(tmp_path, tiny_family, budget="30%")
    assert _run(cfg, tmp_path / "a") == 0
    assert _run(cfg, tmp_path / "b", "--budget", "full") == 0
    a, b = _manifest(tmp_path / "a"), _manifest(tmp_path / "b")
    assert a["outputs"] != b["outputs"]
    return cfg, tmp_path / "cache" / "merges", a, b


def _forge(merges: Path, a: dict, b: dict, mac: str) -> Path:
    """What a writer of the shared cache can do: B's files under A's hash with a manifest that
    is A's but for B's outputs (self-consistent: its manifest_hash recomputed), and a MAC that
    is absent, B's own, or made with another user's key."""
    entry = merges / a["plan_hash"]
    shutil.rmtree(entry)
    shutil.copytree(merges / b["plan_hash"], entry)
    forged = {**a, "outputs": b["outputs"]}
    forged["manifest_hash"] = manifest_hash(forged)
    (entry / MANIFEST).unlink()
    write_manifest(entry / MANIFEST, forged)
    if mac == "absent":
        (entry / STORE_MAC).unlink(missing_ok=True)
    return entry


@pytest.mark.parametrize("mac", ["absent", "another entry's"])
def test_a_forged_entry_under_this_plan_hash_is_merged_again(two_merges, tmp_path, mac):
    cfg, merges, a, b = two_merges
    _forge(merges, a, b, mac)
    assert _run(cfg, tmp_path / "again") == 0
    assert not _restored(tmp_path / "again")
    assert _files(tmp_path / "again") == _files(tmp_path / "a")  # plan A's merge, not B's files
    assert main(["verify", str(tmp_path / "again"), "--inputs", "--replay"]) == 0
    # the forged entry was replaced by this run's: the next run restores plan A's own merge
    assert _run(cfg, tmp_path / "third") == 0
    assert _restored(tmp_path / "third") and _files(tmp_path / "third") == _files(tmp_path / "a")


def test_a_forged_entry_with_another_users_valid_mac_is_merged_again(two_merges, tmp_path, monkeypatch):
    cfg, merges, a, b = two_merges
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "mallory" / "store.key"))
    assert _run(cfg, tmp_path / "m", "--budget", "full") == 0  # mallory's own MAC over B's entry...
    entry = _forge(merges, a, b, "mac")
    (entry / STORE_MAC).write_text(entry_mac(load_key(), "merges", entry.name, (entry / MANIFEST).read_bytes()))
    monkeypatch.undo()  # ...and her MAC over the forged one: the victim's key does not verify it
    assert _run(cfg, tmp_path / "again") == 0
    assert not _restored(tmp_path / "again") and _files(tmp_path / "again") == _files(tmp_path / "a")


def test_another_users_entry_is_rebuilt_then_replaced(tmp_path, tiny_family, monkeypatch):
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    assert _run(cfg, tmp_path / "alice") == 0
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "bob" / "store.key"))
    assert _run(cfg, tmp_path / "bob1") == 0
    assert not _restored(tmp_path / "bob1") and _files(tmp_path / "bob1") == _files(tmp_path / "alice")
    assert _run(cfg, tmp_path / "bob2") == 0  # bob's entry now
    assert _restored(tmp_path / "bob2") and _files(tmp_path / "bob2") == _files(tmp_path / "alice")
    assert main(["verify", str(tmp_path / "alice")]) == 0  # alice's published output is untouched


def test_the_same_users_entry_is_restored_and_its_mac_not_published(tmp_path, tiny_family):
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    assert _run(cfg, tmp_path / "one") == 0
    plan_hash = _manifest(tmp_path / "one")["plan_hash"]
    mac = (tmp_path / "cache" / "merges" / plan_hash / STORE_MAC).read_text()
    assert mac.startswith("mergepipe-store-mac-1 ") and len(mac.split()[1]) == 64
    assert _run(cfg, tmp_path / "two") == 0
    assert _restored(tmp_path / "two") and _files(tmp_path / "two") == _files(tmp_path / "one")
    assert STORE_MAC not in _files(tmp_path / "two")
    assert main(["verify", str(tmp_path / "two")]) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's takes root")
def test_a_stored_file_another_user_owns_is_copied_not_linked(tmp_path, tiny_family):
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    assert _run(cfg, tmp_path / "one") == 0
    entry = tmp_path / "cache" / "merges" / _manifest(tmp_path / "one")["plan_hash"]
    os.chown(entry / "model.safetensors", 4321, 4321)  # its owner could rewrite it in place later
    assert _run(cfg, tmp_path / "two") == 0
    published = tmp_path / "two" / "model.safetensors"
    assert _restored(tmp_path / "two") and published.stat().st_uid == os.geteuid()
    assert published.stat().st_ino != (entry / "model.safetensors").stat().st_ino
    assert _files(tmp_path / "two") == _files(tmp_path / "one")


def test_parts_of_a_forged_entry_merge_their_tensors(two_merges, tmp_path):
    cfg, merges, a, b = two_merges
    _forge(merges, a, b, "absent")
    assert main(["plan", str(cfg), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    cache = str(tmp_path / "cache")
    for i in (1, 2):
        assert main(["merge", str(tmp_path / "plan.json"), "--part", f"{i}/2", "-o", str(tmp_path / "parts"),
                     "--cache-dir", cache, "-q"]) == 0
        assert not json.loads((tmp_path / "parts" / f"part-{i}-of-2.json").read_text())["from_store"]
    assert main(["gather", str(tmp_path / "plan.json"), str(tmp_path / "parts"), "--parts", "2", "-o",
                 str(tmp_path / "split"), "--cache-dir", cache, "-q"]) == 0
    weights = lambda out: {n: d for n, d in _files(out).items() if n.endswith(".safetensors")}  # noqa: E731
    assert weights(tmp_path / "split") == weights(tmp_path / "a")  # (the card is the plan's alone)


def test_the_key_is_created_0600_once_and_kept(tmp_path, tiny_family, monkeypatch):
    key = tmp_path / "cfg" / "deeper" / "store.key"
    monkeypatch.setenv(KEY_ENV, str(key))
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    assert _run(cfg, tmp_path / "one") == 0
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == KEY_BYTES
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    first = key.read_bytes()
    assert _run(cfg, tmp_path / "two") == 0
    assert key.read_bytes() == first and _restored(tmp_path / "two")
    assert [p.name for p in key.parent.iterdir()] == ["store.key"]  # no temp file left


def test_the_default_key_is_under_xdg_config_home_or_dot_config(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert key_path() == tmp_path / "xdg" / "mergepipe" / "store.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert key_path() == tmp_path / "home" / ".config" / "mergepipe" / "store.key"


def _folder(p: Path) -> None:
    p.mkdir()


def _short(p: Path) -> None:
    p.write_bytes(b"\0" * (KEY_BYTES - 1))
    p.chmod(0o600)


def _long(p: Path) -> None:
    p.write_bytes(b"\0" * (KEY_BYTES + 1))
    p.chmod(0o600)


def _open_to_others(p: Path) -> None:
    p.write_bytes(os.urandom(KEY_BYTES))
    p.chmod(0o644)


def _dangling(p: Path) -> None:
    p.symlink_to(p.parent / "nowhere")


def _fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


def _unreadable(p: Path) -> None:
    p.write_bytes(os.urandom(KEY_BYTES))
    p.chmod(0o000)


@pytest.mark.parametrize("make, says", [
    (_folder, "not a regular file"), (_short, "not 32 bytes"), (_long, "not 32 bytes"),
    (_open_to_others, "chmod 600"), (_dangling, "link to nothing"), (_fifo, "not a regular file"),
    pytest.param(_unreadable, "cannot read", marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads it")),
])
def test_a_key_file_that_cannot_serve_is_a_one_line_error_and_kept(tmp_path, tiny_family, monkeypatch, capsys,
                                                                   make, says):
    key = tmp_path / "store.key"
    make(key)
    before = os.lstat(key)
    monkeypatch.setenv(KEY_ENV, str(key))
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    capsys.readouterr()
    assert _run(cfg, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(key) in err and says in err, err
    assert not (tmp_path / "out").exists()
    after = os.lstat(key)
    assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)


def test_where_no_key_can_be_made_the_merge_runs_without_the_store(tmp_path, tiny_family, monkeypatch, capsys):
    """A read-only home on a cluster node: nothing stored can be authenticated, so nothing is
    restored or saved, and the merge is still made and published."""
    (tmp_path / "file").write_text("a file where the key's folder would go\n")
    key = tmp_path / "file" / "store.key"
    monkeypatch.setenv(KEY_ENV, str(key))
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    for out in ("out", "again"):
        assert _run(cfg, tmp_path / out) == 0
        assert main(["verify", str(tmp_path / out), "-q"]) == 0
    stored = Path(yaml.safe_load(cfg.read_text())["cache_dir"]) / "merges"
    assert not stored.exists() or not any(stored.iterdir())
    assert not key.exists()


def test_cli_processes_use_the_key_file_the_environment_names(tmp_path, tiny_family):
    key = tmp_path / "sub" / "store.key"
    cfg = write_config(tmp_path, tiny_family, budget="40%")
    env = {**os.environ, KEY_ENV: str(key)}
    proc = subprocess.run([sys.executable, "-m", "mergepipe", "run", str(cfg), "-q"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert key.stat().st_size == KEY_BYTES
    # this session's own key (tests/conftest.py) is what every other test's CLI process inherits
    assert Path(os.environ[KEY_ENV]).is_file() and Path(os.environ[KEY_ENV]) != key
