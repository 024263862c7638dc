"""PEFT's dense combinations of LoRA adapters (add_weighted_adapter's `ties_svd`,
`dare_linear_svd`, `dare_ties_svd`, `magnitude_prune_svd`; docs/design.md, "Adapters out"),
deterministic.

For one module, with Δ_k = s_k · B_k·A_k of adapter k in the weight's layout (fp32, the fixed
order of `Delta.rows`) and w_k its merge coefficient rounded to fp32 (PEFT's weight tensor):
- sparsify each Δ_k alone, unweighted, at `density` (≥ 1: untouched): `magnitude` keeps the
  k = int(density·numel) largest |Δ_k| (ties: the lower flat index), `random` (DARE) keeps an
  element where its seeded uniform is below density and divides the kept ones by density;
- `linear` sum: Σ_k w_k Δ'_k; `ties` sum: elect +1 where Σ_k Δ'_k ≥ 0 (`total`) or Σ_k sign Δ'_k
  ≥ 0 (`frequency`), else -1, on the UNWEIGHTED Δ'_k as PEFT does; then Σ_k [sign Δ'_k = elected]
  w_k Δ'_k / max(1, #agreeing). A zero element never agrees. Sums run over k in the given order.
The merged Δ is factored to `rank` by `lora_factor` (the Gram matrix's eigh, one thread): the
dense Δ of a sparsified sum has full rank, so the small-core SVD of lora_combine does not apply.
No I/O; torch imported on use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mergepipe.checkpoint.lora_combine import Combined

if TYPE_CHECKING:
    import torch

# combination -> (how each Δ_k is sparsified, how they are summed)
DENSE_COMBINATIONS = {
    "ties_svd": ("magnitude", "ties"),
    "magnitude_prune_svd": ("magnitude", "linear"),
    "dare_linear_svd": ("random", "linear"),
    "dare_ties_svd": ("random", "ties"),
}
SIGN_METHODS = ("total", "frequency")


@dataclass(frozen=True, slots=True)
class DenseTerm:
    """One adapter's module: Δ in the weight's layout (fp32, scale applied), its coefficient, and
    the generator of its DARE mask (None unless the combination is random)."""

    delta: torch.Tensor
    coefficient: float
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class DenseSpec:
    combination: str
    rank: int
    density: float
    majority_sign_method: str = "total"


def magnitude_prune(delta: torch.Tensor, density: float) -> torch.Tensor:
    """delta with all but its int(density·numel) largest magnitudes zeroed (ties: lower index)."""
    import torch
    if density >= 1:
        return delta
    flat = delta.reshape(-1)
    keep = int(density * flat.numel())
    order = torch.sort(flat.abs(), descending=True, stable=True).indices[:keep]
    mask = torch.zeros_like(flat)
    mask[order] = 1
    return delta * mask.reshape(delta.shape)


def random_prune(delta: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: each element kept where its uniform (methods/_common.dare_mask) is below density,
    the kept ones divided by density."""
    if density >= 1:
        return delta
    from mergepipe.methods._common import dare_mask
    return delta * dare_mask(delta.shape, density, generator).to(delta.dtype) / density


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ in list order, one rounding per add."""
    acc = tensors[0]
    for t in tensors[1:]:
        acc = acc + t
    return acc


def merge_dense(terms: list[DenseTerm], spec: DenseSpec) -> torch.Tensor:
    """The combined Δ (fp32, the weight's layout) of PEFT's definition (module docstring)."""
    import torch
    sparsify, summing = DENSE_COMBINATIONS[spec.combination]
    pruned = [magnitude_prune(t.delta, spec.density) if sparsify == "magnitude"
              else random_prune(t.delta, spec.density, t.generator) for t in terms]
    weights = torch.tensor([t.coefficient for t in terms], dtype=torch.float32)
    weighted = [p * weights[k] for k, p in enumerate(pruned)]
    if summing == "linear":
        return _sum(weighted)
    signs = [p.sign() for p in pruned]
    votes = _sum(pruned) if spec.majority_sign_method == "total" else _sum(signs)
    elected = torch.where(votes >= 0, 1.0, -1.0).to(torch.float32)
    agree = [s == elected for s in signs]
    mixed = _sum([w * a for w, a in zip(weighted, agree)])
    count = _sum([a.to(torch.int64) for a in agree])
    return mixed / torch.clamp(count, min=1).to(torch.float32)


def combine_dense(terms: list[DenseTerm], spec: DenseSpec, *, transposed: bool) -> Combined:
    """The module's output factors: the merged Δ (as B·A: transposed back where the layout is
    PEFT's (B·A)ᵀ) truncated to spec.rank (fewer where Δ has fewer rows or columns), with the
    relative truncation error sqrt(Σ_{i≥k} λ_i / Σ λ_i) (0 for a zero Δ)."""
    from mergepipe.checkpoint.lora_extract import one_thread
    from mergepipe.checkpoint.lora_factor import factors, spectrum
    merged = merge_dense(terms, spec).double()
    delta = merged.T.contiguous() if transposed else merged
    with one_thread():
        spec_ = spectrum(delta)
        k = min(spec.rank, spec_.full_rank)
        b, a = factors(delta, spec_, k)
    total = float(spec_.values.sum())
    error = math.sqrt(float(spec_.values[k:].sum()) / total) if total > 0 else 0.0
    return Combined(a, b, error)
