"""The equivalence rule itself (tests/helpers/equivalence.py) accepts what it should and nothing more."""
from __future__ import annotations

import torch

from tests.helpers.equivalence import judge, knife_edges


def _next_up(x: torch.Tensor, steps: int = 1) -> torch.Tensor:
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[x.dtype]
    return (x.view(as_int) + steps).view(x.dtype)


def test_one_ulp_passes_two_fail():
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.tensor([1.0, -3.5, 1e-3, 700.0], dtype=dtype)
        big = x.double().abs()  # magnitudes summed: the values themselves, no cancellation
        assert judge(x, _next_up(x), scale=big).misses == 0
        v = judge(x, _next_up(x, 2), scale=big)
        assert v.misses == 4 and v.worst > 1


def test_cancellation_residue_is_judged_against_the_inputs():
    ours = torch.zeros(2, dtype=torch.float32)
    theirs = torch.tensor([3e-8, 3e-6], dtype=torch.float32)  # left by another summation order
    v = judge(ours, theirs, scale=torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert (v.residues, v.misses) == (1, 1)  # 3e-8 is within 8 roundings of magnitude-1 terms; 3e-6 is not


def test_knife_edge_only_where_the_sum_is_within_rounding_of_zero():
    terms = [torch.tensor([-0.0256, 0.5]) * 1.0, torch.tensor([-0.0254, 0.1]) * 0.6,
             torch.tensor([0.0256 + 0.0254 * 0.6, 0.2]) * 0.9 / 0.9]
    edge = knife_edges(terms)
    assert edge.tolist() == [True, False]
    ours, theirs = torch.tensor([0.01, 0.7]), torch.tensor([-0.01, 0.7])
    v = judge(ours, theirs, scale=torch.full((2,), 1e-3, dtype=torch.float64), knife=edge)
    assert (v.knife_edges, v.misses) == (1, 0)
    assert judge(ours, theirs, scale=torch.full((2,), 1e-3, dtype=torch.float64)).misses == 1
