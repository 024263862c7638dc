"""Merge methods, one per module; importing this package registers all of them."""
from mergepipe.methods import (  # noqa: F401
    breadcrumbs,
    breadcrumbs_ties,
    dare_linear,
    dare_ties,
    linear,
    slerp,
    task_arithmetic,
    ties,
)
from mergepipe.index.ranks import requested_ranks  # noqa: F401
from mergepipe.methods.registry import METHODS, Method, get_method, register  # noqa: F401
