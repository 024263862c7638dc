"""`mergepipe gc`: it removes only the cache entries mergepipe wrote (never a user's file, in a
project folder used as the cache or in the derived folders), prunes what nothing keeps, honours
`--keep`, and two at once on a shared cache agree."""
from __future__ import annotations

from pathlib import Path

from mergepipe.cli import main
from tests.helpers import write_config


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_gc_on_a_project_folder_removes_only_mergepipe_entries(tiny_family, tmp_path):
    """`gc --cache-dir .` (or cache_dir: .) in a project whose models/, parts/ and merges/ are the user's."""
    project = tmp_path / "project"
    for rel, data in {"models/llama/model.safetensors": b"weights", "models/notes.md": b"n",
                      "parts/chapter.tex": b"t", "merges/best/model.safetensors": b"m",
                      "stat/data.csv": b"1,2", "deltas/x.json.gz": b"z"}.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_bytes(data)
    before = _tree(project)
    cfg = write_config(tmp_path, tiny_family, cache_dir=str(project), budget="50%")
    assert main(["run", str(cfg), "-q"]) == 0
    ours = set(_tree(project)) - set(before)
    assert any(p.startswith("merges/") for p in ours) and any(p.startswith("models/") for p in ours)
    assert main(["gc", "--cache-dir", str(project), "--indexes", "-q"]) == 0
    after = _tree(project)
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
