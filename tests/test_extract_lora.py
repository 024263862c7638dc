"""LoRA extraction's factorization (checkpoint/lora_factor.py): full rank reproduces Δ, a
truncated rank retains the energy it reports, --energy's rank rule, and fixed signs."""
from __future__ import annotations

import torch

from mergepipe.checkpoint.lora_factor import factors, spectrum


def _delta(shape, seed=0, rank=None):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(shape, generator=g, dtype=torch.float64) * 1e-2
    if rank is not None:
        d = (d[:, :rank] @ torch.randn(rank, shape[1], generator=g, dtype=torch.float64))
    return d


def test_full_rank_factors_reproduce_delta_within_fp32_rounding():
    for shape in [(24, 40), (40, 24)]:
        d = _delta(shape)
        spec = spectrum(d)
        b, a = factors(d, spec, spec.full_rank)
        assert b.shape == (shape[0], min(shape)) and a.shape == (min(shape), shape[1])
        assert b.dtype == a.dtype == torch.float32
        err = (b.double() @ a.double() - d).abs().max()
        assert float(err) < 1e-6 * float(d.abs().max())


def test_a_truncated_rank_retains_the_energy_it_reports():
    d = _delta((30, 50), seed=1)
    spec = spectrum(d)
    b, a = factors(d, spec, 5)
    kept = float((b.double() @ a.double()).square().sum() / d.square().sum())
    assert abs(kept - spec.energy(5)) < 1e-6
    assert 0 < spec.energy(5) < spec.energy(6) < 1


def test_energy_picks_the_smallest_rank_reaching_it():
    d = _delta((20, 30), seed=2, rank=3)  # rank 3: energy 1 at r = 3
    spec = spectrum(d)
    assert spec.rank_for_energy(1.0 - 1e-9) == 3
    r = spec.rank_for_energy(0.8)
    assert spec.energy(r) >= 0.8 and (r == 1 or spec.energy(r - 1) < 0.8)


def test_signs_are_fixed_and_factors_equal_for_a_negated_delta_up_to_sign():
    d = _delta((16, 24), seed=3)
    spec = spectrum(d)
    pivot = spec.vectors.abs().argmax(dim=0)
    assert bool((spec.vectors.gather(0, pivot.unsqueeze(0)) > 0).all())
    b, a = factors(-d, spectrum(-d), 4)
    b0, a0 = factors(d, spec, 4)
    assert torch.equal(b, b0) and torch.equal(a, -a0)
