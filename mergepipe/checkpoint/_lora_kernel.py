"""The C build of a LoRA module's Δ rows (checkpoint/_lorac.c, the extension module `_lorac`),
loaded with ctypes: the same fp32 products and sums, in the same order, as the torch loop of
`Delta.rows`, so the bytes are the same (tests/test_lora_kernel.py); and task arithmetic over
adapter experts in one pass over the base rows (engine/adapter_sums.py, the same bytes as the
adapters' experts merged by methods/_bf16c.c: tests/test_adapter_sums.py). ctypes releases the
GIL during a call, so the engine's reader threads compute blocks in parallel. Compiled when the
package is installed, once per x86-64 level (setup.py; util/cpu.py picks the build); where it
was not built, `load()` and `load_sum()` return None (Delta.rows then runs the torch loop, and
adapters are merged as their virtual experts).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

from mergepipe.util import cpu

MODULE = "mergepipe.checkpoint._lorac"
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_loaded: dict[str, Callable | None] = {}  # "rows", "sum" -> the bound function (None: not built)


def _bound(which: str) -> Callable | None:
    if not _loaded:
        build = cpu.best_build(MODULE)
        lib = None if build is None else ctypes.CDLL(str(build[0]))
        # a build older than the one-pass loop has no mp_lora_task_arithmetic_bf16: Δ rows only
        summed = lib is not None and hasattr(lib, "mp_lora_task_arithmetic_bf16")
        _loaded.update(rows=lib and _bind(lib), sum=_bind_sum(lib) if summed else None)
    return _loaded[which]


def load() -> Callable | None:
    """`rows_f32(left, right, scale, out)` on contiguous fp32 CPU tensors, or None when not built."""
    return _bound("rows")


def load_sum() -> Callable | None:
    """`task_arithmetic_bf16(base, rows, cols, terms, weights, divisor, normalize, lambda_,
    apply_lambda, out)`, or None when not built (see `_bind_sum`)."""
    return _bound("sum")


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


def _bind_sum(lib: ctypes.CDLL) -> Callable:
    lib.mp_lora_task_arithmetic_bf16.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _F32, _INT, _F32,
                                                 _INT, _P]
    lib.mp_lora_task_arithmetic_bf16.restype = _INT

    def task_arithmetic_bf16(base, rows: int, cols: int, terms: Sequence[tuple], weights: Sequence[float],
                             divisor: float, normalize: bool, lambda_: float, apply_lambda: bool, out) -> None:
        """base, out: numpy uint16 arrays of rows·cols bf16 elements; terms[k] = (left, right,
        scale) of adapter k, left (rows, r) and right (r, cols) contiguous fp32 tensors, or None
        where adapter k leaves the tensor as the base's; weights[k] its fp32 weight."""
        import numpy as np
        p = len(terms)
        if p < 1 or len(weights) != p or base.dtype != np.uint16 or out.dtype != np.uint16 \
                or base.size != rows * cols or out.size != rows * cols or not out.flags.c_contiguous \
                or not base.flags.c_contiguous:
            raise ValueError("task_arithmetic_bf16: base and out rows x cols uint16, one weight per term")
        lefts, rights = (_P * p)(), (_P * p)()
        ranks, scales = (_I64 * p)(), (_F32 * p)()
        for k, term in enumerate(terms):
            if term is None:
                continue
            left, right, scale = term
            # The C loop indexes dense row-major fp32 factors of exactly these shapes.
            fp32 = str(left.dtype) == str(right.dtype) == "torch.float32"
            if not (fp32 and left.is_contiguous() and right.is_contiguous() and left.shape[0] == rows
                    and right.shape == (left.shape[1], cols)):
                raise ValueError(f"task_arithmetic_bf16: term {k}: left (rows, r), right (r, cols), contiguous fp32")
            lefts[k], rights[k], ranks[k], scales[k] = left.data_ptr(), right.data_ptr(), left.shape[1], scale
        ws = (_F32 * p)(*weights)
        if lib.mp_lora_task_arithmetic_bf16(base.ctypes.data, rows, cols, p, lefts, rights, ranks, scales, ws,
                                            divisor, int(normalize), lambda_, int(apply_lambda), out.ctypes.data):
            raise MemoryError("task_arithmetic_bf16: no memory for the column tiles")

    return task_arithmetic_bf16
