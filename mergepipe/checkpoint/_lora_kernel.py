"""The C build of a LoRA module's Δ rows (checkpoint/_lorac.c, the extension module `_lorac`),
loaded with ctypes: the same fp32 products and sums, in the same order, as the torch loop of
`Delta.rows`, so the bytes are the same (tests/test_lora_kernel.py). ctypes releases the GIL
during the call, so the engine's reader threads compute Δ blocks in parallel. Compiled when the
package is installed, once per x86-64 level (setup.py; util/cpu.py picks the build); where it
was not built, `load()` returns None and Delta.rows runs the torch loop.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

from mergepipe.util import cpu

MODULE = "mergepipe.checkpoint._lorac"
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_loaded: Callable | None | bool = False


def load() -> Callable | None:
    """`rows_f32(left, right, scale, out)` on contiguous fp32 CPU tensors, or None when not built."""
    global _loaded
    if _loaded is False:
        build = cpu.best_build(MODULE)
        _loaded = None if build is None else _bind(ctypes.CDLL(str(build[0])))
    return _loaded


def _bind(lib: ctypes.CDLL) -> Callable:
    lib.mp_lora_rows_f32.argtypes = [_P, _P, _I64, _I64, _I64, _F32, _P]
    lib.mp_lora_rows_f32.restype = None

    def rows_f32(left, right, scale: float, out) -> None:
        rows, rank = left.shape
        cols = right.shape[1]
        # The C loop indexes dense row-major fp32 buffers of exactly these shapes.
        if not (left.is_contiguous() and right.is_contiguous() and out.is_contiguous()
                and right.shape[0] == rank and tuple(out.shape) == (rows, cols)):
            raise ValueError("rows_f32: left (rows, r), right (r, cols), out (rows, cols), contiguous")
        lib.mp_lora_rows_f32(left.data_ptr(), right.data_ptr(), rows, rank, cols, float(scale), out.data_ptr())

    return rows_f32
