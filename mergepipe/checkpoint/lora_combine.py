"""Several LoRA adapters of one base, weighted, as one adapter (docs/design.md, "Adapters out").

For module m with terms (c_k, s_k, A_k, B_k) (c_k the merge's coefficient of expert k's Δ,
s_k its adapter's scale for m), the combined Δ_m = Σ_k c_k s_k B_k A_k:
- `cat`: A' = [fl(fl(A_k·c_k)·s_k)] stacked along the rank axis, B' = [B_k] side by side, in
  fp32 (PEFT's add_weighted_adapter "cat" arithmetic, scale folded into A), written with
  scale 1 (lora_alpha = rank): B'·A' is Δ_m up to the fold's two roundings;
- `svd`: the rank-R truncated SVD of Δ_m = B'·A' (fold in fp64), computed from the factors
  (checkpoint/fixed_linalg.py): B' = Q_B R_B, A'ᵀ = Q_A R_A (Householder), SVD of the small
  core R_B R_Aᵀ = W Vᵀ (one-sided Jacobi), then B = Q_B W[:, :R] (singular values in B, as
  PEFT), A = (Q_A V[:, :R])ᵀ. Its relative truncation error ‖Δ - B·A‖_F / ‖Δ‖_F is
  sqrt(Σ_{j≥R} σ_j² / Σ σ_j²) (0 for a zero Δ), before the factors are rounded to fp32.
Every bit follows from the adapters' bytes and the coefficients: no BLAS, no LAPACK.
Terms come in the caller's order (the rank blocks of `cat`). No I/O; torch imported on use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mergepipe.checkpoint.fixed_linalg import column_sums, householder, jacobi_svd, product

if TYPE_CHECKING:
    import torch

COMBINATIONS = ("cat", "svd")


@dataclass(frozen=True, slots=True)
class Term:
    """One adapter's module in PEFT's terms, weighted: contributes coefficient · scale · B·A."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    scale: float
    coefficient: float


@dataclass(frozen=True, slots=True)
class Combined:
    """One module of the output adapter: Δ ≈ b·a (scale 1), fp32."""

    a: torch.Tensor
    b: torch.Tensor
    relative_error: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def cat(terms: list[Term]) -> Combined:
    import torch
    a = torch.cat([(t.a.float() * t.coefficient) * t.scale for t in terms], dim=0)
    b = torch.cat([t.b.float() for t in terms], dim=1)
    return Combined(a.contiguous(), b.contiguous(), 0.0)


def svd(terms: list[Term], rank: int) -> Combined:
    """The rank-`rank` truncation (fewer where Δ's factors have fewer columns or rows)."""
    import torch
    a = torch.cat([t.a.double() for t in terms], dim=0)
    b = torch.cat([(t.b.double() * t.coefficient) * t.scale for t in terms], dim=1)
    qb, qa = householder(b), householder(a.T.contiguous())
    core = jacobi_svd(product(qb.r, qa.r.T))
    k = min(rank, core.w.shape[0], core.w.shape[1])
    squares = core.sigma * core.sigma
    total = float(column_sums(squares[:, None])[0])
    tail = float(column_sums(squares[k:, None])[0])
    error = math.sqrt(tail / total) if total > 0 else 0.0
    b_out = qb.apply_q(core.w[:, :k])
    a_out = qa.apply_q(core.v[:, :k]).T
    return Combined(a_out.float().contiguous(), b_out.float().contiguous(), error)


def combine(terms: list[Term], combination: str, rank: int | None) -> Combined:
    if combination == "cat":
        return cat(terms)
    if combination == "svd" and rank is not None:
        return svd(terms, rank)
    raise ValueError(f"combination {combination!r} (rank {rank}): not one of {COMBINATIONS} with its rank")
