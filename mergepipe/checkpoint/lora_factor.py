"""LoRA factors of one Δ matrix by a deterministic truncated SVD (docs/design.md, "LoRA
extraction"). Pure math on one tensor: no I/O, no threads of its own.

For Δ (m×n) let D = Δ if m ≤ n, else Δᵀ (so D is k×l with k ≤ l). In fp64:
  G = D·Dᵀ (k×k), G = U Λ Uᵀ (eigh), λ descending, each column of U signed so that its
  entry of largest magnitude (the first, on ties) is positive;
  for rank r: P = U_rᵀ D (r×l, row i has norm σ_i), s = √σ, L = U_r·diag(s), R = diag(1/s)·P
  (a row with σ_i = 0 is zero in both), so L·R = U_r U_rᵀ D, the projection of D on its top r
  left singular vectors: the best rank-r approximation (Eckart–Young), exactly D at full rank
  up to U's orthogonality, without dividing by small singular values. √σ on both sides is
  mergekit-extract-lora's `distribute_scale`. Then B·A = Δ: (B, A) = (L, R), or (Rᵀ, Lᵀ) when
  D = Δᵀ. Both are rounded once to fp32.
Retained energy of rank r: Σ_{i<r} λ_i / Σ λ_i (λ clamped at 0), = ‖Δ_r‖²/‖Δ‖².

The results are a function of the fp64 BLAS and LAPACK calls (matmul, eigh): the caller runs
them with one intra-op thread, so they do not depend on thread counts; across CPUs and
library builds LAPACK's last bits may differ (see the design doc).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Spectrum:
    """The eigen-decomposition of D·Dᵀ for Δ (docs above)."""

    vectors: torch.Tensor  # U, k×k fp64, columns by descending eigenvalue, signs fixed
    values: torch.Tensor   # λ, k fp64, descending, clamped at 0
    transposed: bool       # D = Δᵀ (Δ has more rows than columns)

    @property
    def full_rank(self) -> int:
        return int(self.values.shape[0])

    def energy(self, rank: int) -> float:
        """‖Δ_r‖² / ‖Δ‖² for rank r (1.0 for a zero Δ)."""
        total = float(self.values.sum())
        return 1.0 if total == 0.0 else float(self.values[:rank].sum()) / total

    def rank_for_energy(self, fraction: float) -> int:
        """The smallest r (≥ 1) whose retained energy reaches `fraction` (0 < fraction ≤ 1)."""
        import torch
        cumulative = torch.cumsum(self.values, 0)
        total = float(cumulative[-1])
        if total == 0.0:
            return 1
        reached = torch.nonzero(cumulative >= fraction * total)
        # fraction 1.0 reaches the total at the last non-zero eigenvalue at the latest
        rank = int(reached[0]) + 1 if reached.numel() else self.full_rank
        return max(1, rank)


def spectrum(delta: torch.Tensor) -> Spectrum:
    """The spectrum of fp64 matrix `delta` (m×n)."""
    import torch
    transposed = delta.shape[0] > delta.shape[1]
    d = delta.T if transposed else delta
    gram = d @ d.T
    gram = (gram + gram.T) * 0.5  # exactly symmetric: eigh reads one triangle, either must do
    values, vectors = torch.linalg.eigh(gram)
    values, vectors = values.flip(0).clamp_min(0.0), vectors.flip(1)
    pivot = vectors.abs().argmax(dim=0)  # first maximum on ties
    signs = torch.sign(vectors.gather(0, pivot.unsqueeze(0))).squeeze(0)
    signs[signs == 0] = 1.0
    return Spectrum(vectors * signs, values, transposed)


def factors(delta: torch.Tensor, spec: Spectrum, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) in fp32, B (m×r) and A (r×n), with B·A the rank-r approximation of fp64 `delta`."""
    import torch
    d = delta.T if spec.transposed else delta
    u = spec.vectors[:, :rank]
    projected = u.T @ d
    sigma = torch.linalg.vector_norm(projected, dim=1)
    root = sigma.sqrt()
    safe = torch.where(root > 0, root, torch.ones_like(root))
    left, right = u * root, projected / safe.unsqueeze(1)
    if spec.transposed:
        left, right = right.T, left.T
    return left.float().contiguous(), right.float().contiguous()
