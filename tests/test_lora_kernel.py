"""The C build of a LoRA module's Δ rows (checkpoint/_lorac.c) gives the torch loop's bytes:
the same fp32 products and sums in the same order, whatever the rows, rank, columns or scale."""
from __future__ import annotations

import pytest
import torch

from mergepipe.checkpoint import _lora_kernel
from mergepipe.checkpoint.lora import Delta
from mergepipe.util import cpu
from tests.helpers import kernel_build

kernel = _lora_kernel.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="mergepipe.checkpoint._lorac not built")


def _torch_rows(d: Delta, r0: int, r1: int, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(_lora_kernel, "load", lambda: None)
        return d.rows(r0, r1)


@pytest.mark.parametrize(("rows", "rank", "cols", "scale"), [
    (37, 16, 901, 2.0), (5, 1, 64, 0.5), (64, 7, 33, 7 / 3), (300, 64, 128, -1 / 0.3), (1, 3, 1, 1e-3)])
def test_c_rows_are_the_torch_loops_bytes(rows, rank, cols, scale, monkeypatch):
    g = torch.Generator().manual_seed(rows * 1000 + rank)
    left = torch.randn(rows, rank, generator=g) * torch.logspace(-6, 3, rank)  # spread exponents
    right = torch.randn(rank, cols, generator=g)
    d = Delta("m", scale, left=left, right=right)
    for r0, r1 in ((0, rows), (rows // 3, rows), (rows - 1, rows)):
        ours = d.rows(r0, r1)
        assert ours.dtype == torch.float32 and ours.shape == (r1 - r0, cols)
        assert torch.equal(ours.view(torch.int32), _torch_rows(d, r0, r1, monkeypatch).view(torch.int32))


def test_transposed_bf16_factors_and_nonfinite_values(monkeypatch):
    g = torch.Generator().manual_seed(3)
    b, a = torch.randn(40, 8, generator=g), torch.randn(8, 24, generator=g)
    a[2, 5], b[7, 1] = float("inf"), float("nan")
    # fan_in_fan_out: left, right = Aᵀ, Bᵀ are views whose strides are not row-major
    d = Delta("m", 0.25, left=a.T.bfloat16(), right=b.T.bfloat16(), transposed=True)
    ours, theirs = d.rows(3, 20), _torch_rows(d, 3, 20, monkeypatch)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert ours.isnan().any() and ours.isinf().any()


def test_the_kernel_refuses_buffers_of_other_shapes():
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.ones(4, 2), torch.ones(2, 3).T.contiguous().T, 1.0, torch.empty(4, 3))
    with pytest.raises(ValueError, match="cols"):
        kernel(torch.ones(4, 2), torch.ones(2, 3), 1.0, torch.empty(4, 4))


@pytest.mark.parametrize("level", cpu.BUILT, ids=[cpu.NAMES[v] for v in cpu.BUILT])
def test_every_vector_width_gives_the_torch_loops_bytes(level, monkeypatch):
    """Each installed build (SSE2, AVX2, AVX-512), where this CPU runs it (else skipped, naming
    the width), against the torch loop."""
    import ctypes
    build = _lora_kernel._bind(ctypes.CDLL(str(kernel_build(_lora_kernel.MODULE, level))))
    g = torch.Generator().manual_seed(level)
    left = torch.randn(300, 16, generator=g) * torch.logspace(-6, 3, 16)
    right = torch.randn(16, 901, generator=g)
    got = torch.empty(300, 901)
    build(left, right, -1 / 0.3, got)
    want = _torch_rows(Delta("m", -1 / 0.3, left=left, right=right), 0, 300, monkeypatch)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
