"""The lazy method registry: NAMES lists exactly the modules that register a method, each
under its own name, and a lookup imports only that method's module."""
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mergepipe.methods as methods_pkg
from mergepipe.errors import ConfigError
from mergepipe.methods import METHODS, get_method
from mergepipe.methods.registry import NAMES, register

NOT_METHODS = {"base", "joint", "registry"}  # modules of the package that define no method


def test_names_are_the_method_modules():
    modules = {m.name for m in pkgutil.iter_modules(methods_pkg.__path__)
               if not m.name.startswith("_") and m.name not in NOT_METHODS}
    assert modules == set(NAMES)
    for name in NAMES:
        assert METHODS[name].name == name  # the module registered its own name


def test_unknown_and_duplicate_names():
    assert "nope" not in METHODS
    with pytest.raises(KeyError):
        METHODS["nope"]
    with pytest.raises(ConfigError, match="unknown merge method 'nope'"):
        get_method("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register("ties", params=None, additive=False, paper="")(lambda b, p: None)
    with pytest.raises(ValueError, match="missing from registry.NAMES"):
        register("not_listed", params=None, additive=False, paper="")(lambda b, p: None)


def test_a_lookup_imports_one_method():
    code = ("import sys; from mergepipe.methods import METHODS; METHODS['task_arithmetic']; "
            "print(sorted(m.split('.')[-1] for m in sys.modules if m.startswith('mergepipe.methods.') "
            "and not m.split('.')[-1].startswith('_') and m.split('.')[-1] not in ('base', 'joint', 'registry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "['task_arithmetic']"
