"""Merge methods, one per module; `METHODS[name]` imports a method's module on first use.

registry.py holds what the plan and the engine know of a method (params model, torch
`fn`, index needs, effective weights, optional compiled kernel); base.py the data a
method sees; modules starting with "_" are shared code: _common.py (trims, sums),
_compiled.py and _kernels.py (the compiled bf16 kernels of task_arithmetic and ties)."""
from mergepipe.index.ranks import requested_ranks  # noqa: F401
from mergepipe.methods.registry import METHODS, Method, get_method, register  # noqa: F401
