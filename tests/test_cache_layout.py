"""The cache layout has one owner (mergepipe/index/cache.py): every entry kind's path comes from
it, the names its writers give are the names gc recognises, and no other module joins a kind's
folder onto a path by hand."""
from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

from mergepipe.index import cache as layout
from mergepipe.index.cache import KINDS, CacheLayout, temp_of

PACKAGE = Path(__file__).resolve().parent.parent / "mergepipe"
OWNER = PACKAGE / "index" / "cache.py"
FOLDERS = {k.folder for k in KINDS}
# joins of a kind's word that are not the cache: (module, the join's source text)
NOT_THE_CACHE = {
    ("mergepipe/commands/sweep.py", 'out_dir / "models"'),  # a sweep's output folder, <out>/models/<budget>
    ("mergepipe/cli.py", "out / 'models'"),  # the same folder, named in sweep's last line
}
H32, H40, H64 = "a" * 32, "b" * 40, "c" * 64


def _names_a_kind(text: str) -> bool:
    """A path fragment whose segments include a kind's folder ("sketch", "joint/", "a/merges")."""
    return any(seg in FOLDERS for seg in text.split("/"))


def _fragments(node: ast.AST) -> list[str]:
    """The literal text of a string or f-string node (an f-string's literal pieces)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def _path_arguments(node: ast.AST) -> list[ast.AST]:
    """The operands a node joins into a path: both sides of `/`, and the arguments of
    joinpath(), os.path.join() and Path()."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node.left, node.right]
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("joinpath", "join", "Path", "PurePath"):
            return list(node.args)
    return []


def hand_built_cache_paths(source: str) -> list[tuple[int, str]]:
    """(line, source text) of each place in `source` that joins a cache kind's folder name onto
    a path, or spells one inside a path-like f-string ("{root}/sketch/..."), instead of asking
    index/cache.py."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        joined = any(_names_a_kind(text) for arg in _path_arguments(node) for text in _fragments(arg))
        spelled = isinstance(node, ast.JoinedStr) and any(
            f"/{folder}/" in text or text.startswith(f"{folder}/") for folder in FOLDERS for text in _fragments(node))
        if joined or spelled:
            found.add((node.lineno, ast.get_source_segment(source, node) or ""))
    return sorted(found)


def test_no_module_outside_the_owner_builds_a_cache_path():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        module = path.relative_to(PACKAGE.parent).as_posix()
        for line, text in hand_built_cache_paths(path.read_text()):
            if not any(module == m and snippet in text for m, snippet in NOT_THE_CACHE):
                found.append(f"{module}:{line}: {text}")
    assert found == [], "cache paths built by hand (ask mergepipe/index/cache.py's CacheLayout):\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    'p = root / "sketch" / f"{key}.sk"',
    'p = Path(cache_dir) / "joint" / name',
    'p = store.root / "merges" / plan_hash',
    'p = os.path.join(root, "weighted", name)',
    'p = root.joinpath("calibration/x.safetensors")',
    'p = f"{root}/models/{key}.idx"',
    'p = Path("deltas") / name',
])
def test_the_check_sees_a_path_built_by_hand(source):
    assert [line for line, _ in hand_built_cache_paths(source)] == [1]


@pytest.mark.parametrize("source", [
    'models = data.get("models")',  # a config key of the same word is no path
    'plan["strategy"]["sketch"] = {}',
    'p = out_dir / "manifest.json"',
    'msg = f"{n} merges in the sweep"',
])
def test_the_check_leaves_other_uses_of_the_words_alone(source):
    assert hand_built_cache_paths(source) == []


def _entries(root: Path) -> dict[layout.Kind, list[Path]]:
    """One entry path per layout method, as every writer now gets it."""
    c = CacheLayout(root)
    return {
        layout.STAT: [c.stat(H32)],
        layout.MODELS: [c.model(H40)],
        layout.DELTAS: [c.delta(H64, "d" * 64, 16384, 3), c.delta(H64, "d" * 64, "16384/emb4096", 3)],
        layout.MERGES: [c.merge(H64), c.merge_staging(H64, "0123456789ab")],
        layout.PARTS: [c.folder(layout.PARTS) / (layout.part_stem(2, 7) + ext) for ext in (".safetensors", ".json")],
        layout.CALIBRATION: [c.calibration(H40)],
        layout.WEIGHTED: [c.weighted(H40)],
        layout.JOINT: [c.joint(H64)],
        layout.SKETCH: [c.sketch(H40)],
        layout.GROUPQUANT: [c.groupquant(H40)],
        layout.CUTS: [c.cuts(H40)],
    }


def test_every_kind_names_its_entries_as_gc_recognises_them(tmp_path):
    entries = _entries(tmp_path)
    assert set(entries) == set(KINDS)  # a new kind gets a path method and a line here
    for kind, paths in entries.items():
        for p in paths:
            assert p.parent == tmp_path / kind.folder, p
            assert kind.entry.fullmatch(p.name), (kind.folder, p.name)
            if not kind.folders:  # atomic_write_bytes's temp name beside it
                assert temp_of(kind, f".{p.name}.k2j4_9xq.tmp"), p.name
            other = [k for k in KINDS if k is not kind and k.entry.fullmatch(p.name) and k.folder == kind.folder]
            assert other == []


def test_each_writer_gets_its_path_from_the_layout(tmp_path):
    """The modules that key an entry put it where the layout says, under a name gc recognises."""
    from mergepipe.calibrate.artifact import artifact_path
    from mergepipe.index import extra_cuts, groupquant, sketch, weighted
    from mergepipe.index.store import DELTA_FORMAT, Store
    c = CacheLayout(tmp_path)
    made = {
        layout.SKETCH: sketch.cache_path(tmp_path, H64, "d" * 64, 16384),
        layout.WEIGHTED: weighted.cache_path(tmp_path, H64, "d" * 64, "e" * 64, 16384),
        layout.CALIBRATION: artifact_path(tmp_path, H64, "e" * 64, {"sequences": 4}),
        layout.GROUPQUANT: groupquant.cache_path(tmp_path, H64, "d" * 64, 16384, groupquant.Spec(4, 64)),
        layout.CUTS: extra_cuts.cache_path(tmp_path, H64, "d" * 64, 16384, {"w": (3, 7)}),
    }
    for kind, p in made.items():
        assert p.parent == c.folder(kind) and kind.entry.fullmatch(p.name), (kind.folder, p)
    store = Store(tmp_path)
    assert store.layout.root == store.root == tmp_path
    assert store._model_key({"model.safetensors": H64}, _layout(16384)).parent == c.folder(layout.MODELS)
    stat = store._stat_path(tmp_path / "model.safetensors", _layout(16384))
    assert stat.parent == c.folder(layout.STAT) and layout.STAT.entry.fullmatch(stat.name)
    assert c.delta(H64, "d" * 64, "16384/emb4096", DELTA_FORMAT).name == \
        f"{'c' * 32}-{'d' * 32}-16384-emb4096-v{DELTA_FORMAT}.idx"


def _layout(block_bytes: int):
    from mergepipe.checkpoint.blocks import BlockLayout
    return BlockLayout.of(block_bytes)


def test_every_kind_gc_prunes_has_its_content_and_reference_checks():
    from mergepipe.commands import gc
    derived = {k.folder for k in KINDS if k.derived and k.pruned}
    assert set(gc.WRITTEN_BY_US) == derived
    assert set(gc.REFERENCED) == derived


def test_gc_visits_the_kinds_in_the_layouts_order_and_leaves_unpruned_ones(tmp_path):
    """One removable entry of each kind whose content gc does not inspect: collect lists them in
    KINDS order; an entry of a kind gc does not prune (groupquant/) stays, even a day-old temp."""
    from mergepipe.commands.gc import collect
    c = CacheLayout(tmp_path)
    c.merge(H64).mkdir(parents=True)
    files = [c.model(H40), c.delta(H64, "d" * 64, 16384, 3), c.stat(H32), c.groupquant(H40)]
    old_temp = c.folder(layout.GROUPQUANT) / f".{H40}.gq.abcdefgh.tmp"
    for p in [*files, old_temp]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    day_ago = time.time() - 2 * 86400
    os.utime(old_temp, (day_ago, day_ago))
    removed = [r.path for r in collect(tmp_path, set(), indexes=True)]
    assert removed == [c.merge(H64), *files[:3]]
    assert not layout.GROUPQUANT.pruned


def test_gc_has_no_entry_name_patterns_of_its_own():
    """What gc recognises as an entry is the layout's `Kind.entry`: a second copy of the patterns
    in gc would let a writer's new name and gc's idea of it drift apart."""
    tree = ast.parse((PACKAGE / "commands" / "gc.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "re" not in imported
