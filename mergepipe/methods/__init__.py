"""Merge methods, one per module; importing this package registers all of them."""
from mergepipe.methods import task_arithmetic  # noqa: F401
from mergepipe.methods.registry import METHODS, Method, get_method, register  # noqa: F401
