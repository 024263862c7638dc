"""`torch`, imported on first use: `from mergepipe.util.lazy import torch`.

Importing torch costs 1.5-2.5 s; bf16 task arithmetic and TIES merge in compiled kernels
(numpy + numba) and never touch it, nor do the config, the plan or a no-op `run`. The
methods' modules name `torch` at module level only in (string) annotations; their function
bodies reach the real module through this proxy, which imports it the first time an
attribute is asked for (`torch.float32`, `torch.zeros`, ...) and is then a plain forward.
"""
from __future__ import annotations

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
