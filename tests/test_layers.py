"""The import-layer contract: imports inside mergepipe/ only go downward.

    errors, units, util -> checkpoint -> index -> methods -> config, plan, calibrate -> engine
    -> output -> commands -> cli

Same-layer imports are allowed; methods may use index.ranks only (not the index
build); index and checkpoint import no torch at module level (Snakemake rules and
the index command stay light). Every import counts, also those inside functions.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mergepipe"

LAYERS = [
    {"mergepipe", "errors", "units", "util"},
    {"checkpoint"},
    {"index"},
    {"methods"},
    {"config", "plan", "calibrate"},
    {"engine"},
    {"output"},
    {"commands"},
    {"cli", "__main__"},
]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}
# (importer's top part, imported module) pairs that go sideways on purpose
METHODS_MAY_USE = {"mergepipe.index.ranks"}
# the one upward import: config's load-time check asks output safety's owner whether output.dir
# overlaps an input (output.safety imports only errors and util at module level:
# test_output_safety.py holds it to that)
UPWARD_ALLOWED = {("mergepipe.config.paths", "mergepipe.output.safety")}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    """The layer key of a mergepipe module: its first component under mergepipe."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mergepipe"


def _imports(source: str, me: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of every mergepipe import in module `me`'s source."""
    tree = ast.parse(source)
    package = me if is_package else me.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "mergepipe" or (node.level and not node.module):
                # `from mergepipe import x` / `from . import x`: x may be a subpackage
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, m) for line, m in found if m == "mergepipe" or m.startswith("mergepipe.")]


def _verdict(me: str, target: str) -> str | None:
    """Why `me` may not import `target`, or None."""
    mine, theirs = _part(me), _part(target)
    if theirs not in LAYER:  # `from mergepipe import __version__` and the like
        return None
    if LAYER[theirs] > LAYER[mine] and (me, target) not in UPWARD_ALLOWED:
        return f"upward: {mine} is below {theirs}"
    if mine == "methods" and theirs == "index" and not any(
            target == m or target.startswith(m + ".") for m in METHODS_MAY_USE):
        return f"methods may use only {', '.join(sorted(METHODS_MAY_USE))} of the index"
    return None


def _violations() -> list[str]:
    bad = []
    for path in _modules():
        me = _name(path)
        assert _part(me) in LAYER, f"{me}: not in any layer; add it to LAYERS in {__file__}"
        for line, target in _imports(path.read_text(encoding="utf-8"), me, is_package=path.name == "__init__.py"):
            why = _verdict(me, target)
            if why:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} imports {target} ({why})")
    return bad


def test_every_module_has_a_layer():
    assert {_part(_name(p)) for p in _modules()} <= set(LAYER)


def test_every_module_says_what_it_owns():
    missing = [str(p.relative_to(PACKAGE.parent)) for p in _modules()
               if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert missing == [], "modules without a docstring"


def test_no_test_module_imports_another():
    """Shared fixtures live in conftest.py, shared helpers in the tests/helpers/ package."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module in ("tests", "tests.corpus") else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(tests)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[-1].startswith("test_") or n.split(".")[-1] == "conftest"]
    assert bad == []


def test_imports_only_go_downward():
    assert _violations() == []


def test_the_checker_sees_what_it_must():
    assert _verdict("mergepipe.index.build", "mergepipe.engine.merge") is not None
    assert _verdict("mergepipe.output.manifest", "mergepipe.commands.pipeline") is not None
    assert _verdict("mergepipe.methods.ties", "mergepipe.index.build") is not None
    assert _verdict("mergepipe.methods.ties", "mergepipe.index.ranks") is None
    assert _verdict("mergepipe.plan.planner", "mergepipe.config.params") is None  # same layer
    assert _verdict("mergepipe.cli", "mergepipe.engine.merge") is None
    source = ("from .ranks import x\nfrom . import build\nimport mergepipe.engine.merge\n"
              "def f():\n    from mergepipe.cli import main\n")
    assert _imports(source, "mergepipe.index.store") == [
        (1, "mergepipe.index.ranks"), (2, "mergepipe.index.build"), (3, "mergepipe.engine.merge"), (5, "mergepipe.cli")]


@pytest.mark.parametrize("module", ["mergepipe.index.store", "mergepipe.index.build",
                                    "mergepipe.checkpoint.safetensors", "mergepipe.checkpoint.blocks"])
def test_index_and_checkpoint_import_no_torch(module):
    code = (f"import {module}, sys; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
