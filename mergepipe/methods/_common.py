"""Pieces shared by the merge methods: canonical expert order, the sparsifiers
(magnitude top-k and the Breadcrumbs band from exact rank cuts, DARE's random
drop), sign election, and the generalized task-arithmetic combine that TIES,
DARE and Breadcrumbs share.

Pure per-block math: no I/O, no logging, no global state, inputs never modified.
Arithmetic follows mergekit 0.1.5's fp32 operation order (weights as fp32
tensors, sums taken expert by expert), so a full-budget merge equals it by the
rule of docs/design.md "Equivalence with mergekit" (bit for bit wherever
mergekit's own reduction order agrees with ours); see also "Methods" and "Ties at
a magnitude threshold" there.
"""
from __future__ import annotations


from collections.abc import Sequence

from mergepipe.util.lazy import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mergepipe.errors import MethodError
from mergepipe.index.ranks import breadcrumbs_ranks, magnitude_rank
from mergepipe.methods.base import BlockInputs, ExpertBlock, RankCut, block_rng


# Every params class: unknown keys rejected, "lambda" accepted by alias or name,
# immutable, no NaN/inf.
PARAMS_CONFIG = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)

DENSITY_DOC = ("default density for experts that set none; the engine resolves it onto each "
               "ExpertBlock.density, which is what the method reads")


class DensityParams(BaseModel):
    """Parameters shared by the sparsifying methods (TIES, Breadcrumbs, DARE)."""

    model_config = PARAMS_CONFIG
    lambda_: float = Field(1.0, alias="lambda")
    normalize: bool = False
    density: float = Field(1.0, ge=0.0, le=1.0, description=DENSITY_DOC)
    int8_mask: bool = False  # accepted for mergekit configs; a memory option there, no effect on values


class MagnitudeParams(DensityParams):
    """Parameters shared by the magnitude-pruning methods (TIES, Breadcrumbs)."""

    rescale: bool = False

    @field_validator("rescale")
    @classmethod
    def _no_l1_rescale(cls, rescale: bool) -> bool:
        if rescale:
            raise ValueError("rescale: true (mergekit's L1 rescaling of the pruned delta) is not supported "
                             "by TIES/Breadcrumbs; remove it or set it to false")
        return rescale


def canonical(experts: Sequence[ExpertBlock]) -> list[ExpertBlock]:
    """Experts sorted by (content hash, name).

    The engine already passes them in this order; sorting again makes every
    method's floating-point summation order independent of its caller, so
    permuting the experts never changes a single bit of the output.
    """
    return sorted(experts, key=lambda e: (e.content_hash, e.name))


def sequential_sum(terms: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """terms[0] + terms[1] + ... left to right; zeros shaped like `like` if empty.

    torch's `stack(...).sum(0)` changes its reduction order with the shape (for
    five or more terms), which would make a block differ from the same rows of
    the whole tensor. Left to right is what mergekit's `sum(dim=0)` does on
    LLM-shaped tensors.
    """
    if not terms:
        return torch.zeros_like(like)
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def changed_mask(block: BlockInputs) -> torch.Tensor | None:
    """Elements that some expert changes (delta != 0); None when no expert has a
    delta in this block (all unread or byte-identical to the base)."""
    changed = None
    for e in block.experts:
        if e.delta is not None:
            nonzero = e.delta != 0
            changed = nonzero if changed is None else changed | nonzero
    return changed


# --- magnitude sparsification (TIES, Breadcrumbs) ---------------------------------

# magnitude_rank, breadcrumbs_ranks, GRID and requested_ranks live in mergepipe.index.ranks
# (torch-free: the index needs them without importing torch)


def rank_cut_mask(magnitudes: torch.Tensor, cut: RankCut) -> torch.Tensor:
    """This block's share of the top `cut.rank` |delta| of its tensor, as a bool mask.

    Keeps |delta| > value, then the first `eq_keep` elements (flat order) with
    |delta| == value: the order (|delta| desc, flat index asc) of RankCut.
    """
    if cut.eq_keep <= 0:
        return magnitudes > cut.value
    if cut.eq_all:  # every element of this block with |delta| == value is kept: no count, no scan
        return magnitudes >= cut.value
    equal = magnitudes == cut.value
    if int(equal.sum()) > cut.eq_keep:  # the cut splits this block's run of equal values
        flat = equal.reshape(-1)
        equal = (flat & (torch.cumsum(flat, 0) <= cut.eq_keep)).reshape(magnitudes.shape)
    return (magnitudes > cut.value) | equal


def top_rank_mask(magnitudes: torch.Tensor, expert: ExpertBlock, rank: int, n: int,
                  tensor: str) -> torch.Tensor:
    """Mask of the `rank` largest |delta| of the whole tensor within this block.

    Ranks 0 and n need no cut (nothing / everything); any other rank asks the
    expert's `cut`, which the index answers without rereading the tensor.
    """
    if rank <= 0:
        return torch.zeros_like(magnitudes, dtype=torch.bool)
    if rank >= n:
        return torch.ones_like(magnitudes, dtype=torch.bool)
    if expert.cut is None:
        raise MethodError(f"tensor {tensor!r}, expert {expert.name!r}: magnitude pruning needs "
                          f"the index's rank cut at rank {rank}, but none was supplied; "
                          "build the delta index for this expert (mergepipe index)")
    cut = expert.cut(rank)
    if cut.rank != rank:
        raise MethodError(f"tensor {tensor!r}, expert {expert.name!r}: asked for the rank cut "
                          f"at {rank} and got one at {cut.rank}; the delta index is stale, rebuild it")
    return rank_cut_mask(magnitudes, cut)


def sparsify_magnitude(delta: torch.Tensor, expert: ExpertBlock, block: BlockInputs) -> torch.Tensor:
    """TIES trim: keep the k = max(1, int(density*n)) largest |delta| of the tensor (a
    sketched delta as it is: ExpertBlock.sketched)."""
    if expert.sketched:
        return delta
    n = block.tensor_numel
    rank = magnitude_rank(expert.density, n)
    if rank is None:
        return delta
    mask = top_rank_mask(delta.abs(), expert, rank, n, block.tensor)
    return delta * mask.to(torch.float32)


def sparsify_breadcrumbs(delta: torch.Tensor, expert: ExpertBlock, block: BlockInputs) -> torch.Tensor:
    """Breadcrumbs: drop the int(gamma*n) largest |delta|, keep the next int(density*n)
    (a sketched delta as it is)."""
    if expert.sketched:
        return delta
    n = block.tensor_numel
    ranks = breadcrumbs_ranks(expert.density, expert.gamma, n)
    if ranks is None:
        return delta
    r_hi, r_lo = ranks
    magnitudes = delta.abs()
    mask = top_rank_mask(magnitudes, expert, r_lo, n, block.tensor)
    if r_hi > 0:
        mask = mask & ~top_rank_mask(magnitudes, expert, r_hi, n, block.tensor)
    return delta * mask.to(torch.float32)


# --- DARE ------------------------------------------------------------------------------

def dare_mask(shape: torch.Size | tuple[int, ...], density: float,
              generator: torch.Generator) -> torch.Tensor:
    """Keep each element independently with probability `density` (bool mask).

    One fp32 uniform per element from `generator` (torch's CPU Mersenne twister),
    in flat order; kept where u < density.
    """
    return torch.rand(shape, generator=generator, dtype=torch.float32) < density


def sparsify_dare(delta: torch.Tensor, expert: ExpertBlock, block: BlockInputs, *,
                  rescale: bool) -> torch.Tensor:
    """DARE drop-and-rescale with this (expert, block)'s own generator.

    density >= 1 returns delta untouched (as mergekit), density <= 0 drops all;
    kept elements are divided by density when `rescale` (the paper's 1/p).
    """
    density = expert.density
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    generator = block_rng(block.seed, expert.content_hash, block.tensor, block.row_start)
    masked = delta * dare_mask(delta.shape, density, generator).to(torch.float32)
    return masked / density if rescale else masked


# --- generalized task arithmetic ---------------------------------------------------------

def elect_sign(weighted: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """TIES "sum" election: +1 where sum_k w_k*delta_k >= 0, else -1 (fp32)."""
    total = sequential_sum(weighted, like)
    # comparisons written straight into fp32 (out=) avoid a slow bool -> float pass
    majority = torch.ge(total, 0, out=torch.empty_like(total, dtype=torch.float32))
    return majority.mul_(2).sub_(1)


def disjoint_merge(weighted: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                   majority: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_k m_k w_k delta_k, sum_k m_k w_k) with m_k = [sign(w_k delta_k) == majority].

    A zero entry has sign 0 and so never agrees: it adds nothing to the divisor.
    """
    agree = [torch.eq(term.sign(), majority, out=torch.empty_like(majority)) for term in weighted]
    mixed = sequential_sum([term * a for term, a in zip(weighted, agree)], majority)
    divisor = sequential_sum([a * w for a, w in zip(agree, weights)], majority)
    return mixed, divisor


def combine(block: BlockInputs, experts: Sequence[ExpertBlock],
            sparsified: Sequence[torch.Tensor | None], *, consensus: bool, normalize: bool,
            lambda_: float) -> torch.Tensor:
    """W0 + lambda * M, with M the (sign-consensus or plain) weighted sum of the
    sparsified deltas, divided by its weight sum if `normalize`.

    `sparsified[k]` is None for an expert block that was not read (omitted by the
    plan, or byte-identical to the base): it contributes 0 and never agrees in
    the sign election, but without consensus its weight still counts in the
    divisor, as in mergekit where such a block is an all-zero delta. An expert's
    `scale` (a rescaling plan strategy) multiplies its sparsified delta first, so
    TIES/Breadcrumbs cuts still see the delta as stored; scale 1 skips the product.
    """
    base = block.base
    weights = [torch.tensor(e.weight, dtype=torch.float32) for e in experts]
    sparsified = [d if d is None or e.scale == 1.0 else d * torch.tensor(e.scale, dtype=torch.float32)
                  for e, d in zip(experts, sparsified)]
    present = [(w, d * w) for w, d in zip(weights, sparsified) if d is not None]
    weighted = [term for _, term in present]
    if consensus:
        majority = elect_sign(weighted, base)
        mixed, divisor = disjoint_merge(weighted, [w for w, _ in present], majority)
        divisor = divisor.masked_fill(divisor == 0, 1.0)
    else:
        mixed = sequential_sum(weighted, base)
        divisor = sequential_sum(weights, torch.zeros((), dtype=torch.float32))
        if divisor.abs() < 1e-8:
            divisor = torch.ones((), dtype=torch.float32)
    if normalize:
        mixed = mixed / divisor
    if lambda_ != 1:
        mixed = mixed * lambda_
    return base + mixed


# --- per-expert pieces the elementwise methods share (passthrough, nearswap, ram, nuslerp) ---

def scaled_delta(expert: ExpertBlock) -> torch.Tensor | None:
    """The expert's read delta times its plan `scale` (1.0 skips the product); None when unread."""
    if expert.delta is None or expert.scale == 1.0:
        return expert.delta
    return expert.delta * torch.tensor(expert.scale, dtype=torch.float32)
