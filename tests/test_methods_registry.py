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


def test_method_facts_live_on_the_registration():
    """What the plan and import-mergekit need comes from each method's registration."""
    from mergepipe.methods.registry import Mergekit, every_method, mergekit_names
    methods = every_method()
    assert {m.name for m in methods if m.sketch_by_default} <= {m.name for m in methods if m.sketchable}
    assert {m.name for m in methods if m.sketchable} == {"linear", "task_arithmetic", "ties", "dare_linear",
                                                          "dare_ties", "breadcrumbs", "breadcrumbs_ties"}
    names = mergekit_names()
    assert names["model_breadcrumbs"] == "breadcrumbs" and names["ties"] == "ties"
    assert set(names.values()) == set(NAMES)
    with pytest.raises(ValueError, match="sketch_by_default needs sketchable"):
        register("ties", params=None, additive=False, paper="", sketch_by_default=True)
    with pytest.raises(ValueError, match="no_base 'last'"):
        register("ties", params=None, additive=False, paper="", mergekit=Mergekit(no_base="last"))


def test_a_sketched_strategy_names_the_methods_that_take_it():
    from mergepipe.plan.sketch_reads import check_method
    check_method("dare_ties", "sketch")
    with pytest.raises(ConfigError, match="method 'slerp' does not merge per-element deltas.*breadcrumbs, "):
        check_method("slerp", "sketch")
