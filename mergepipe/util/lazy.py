"""`torch`, imported on first use: `from mergepipe.util.lazy import torch`; and `njit`,
numba's decorator applied on a kernel's first call.

Importing torch costs 1.5-2.5 s; bf16 task arithmetic and TIES merge in compiled kernels
(C, or numba where the C library was not built) and never touch it, nor do the config, the plan or a no-op `run`. The
methods' modules name `torch` at module level only in (string) annotations; their function
bodies reach the real module through this proxy, which imports it the first time an
attribute is asked for (`torch.float32`, `torch.zeros`, ...) and is then a plain forward.
"""
from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType


class _LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (imported)' if self._name in sys.modules else ''}>"


def imported(name: str) -> bool:
    """Whether a module has been imported in this process (by anyone)."""
    return name in sys.modules


torch = _LazyModule("torch")


def njit(**options):
    """`numba.njit(**options)`, applied when the function is first called.

    Importing numba and loading a cached kernel costs ~0.7 s per process; the registry imports
    every method's module, so kernels defined at module level with numba's own decorator made
    every command pay it. Only for kernels called from Python: another compiled function cannot
    call this wrapper. Two threads calling first at once may both compile; numba's cache and
    lock make that safe, and the result is the same function.
    """
    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args):
            nonlocal compiled
            if compiled is None:
                from numba import njit as numba_njit
                compiled = numba_njit(**options)(fn)
            return compiled(*args)
        return call
    return decorate
