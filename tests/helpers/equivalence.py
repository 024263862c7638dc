"""The rule by which a merge equals mergekit's, on any machine (docs/design.md, "Equivalence").

mergekit's fp32 sums are reductions whose order torch picks per CPU (vector width,
vendor), so its last bits move between machines while ours do not. Element by element,
ours equals theirs when one of these holds:
  - |ours - theirs| <= one ulp (of the output dtype) of the larger of the two;
  - cancellation residue: where the terms summed into the element cancel (both results
    below 2**-CANCELLED_BITS of `scale`, a bound on the magnitudes summed: |base| +
    sum_k |w_k| (|x_k| + |base|), times lambda and 1/sum w), an ulp of the result says
    nothing about the sum's accuracy; there both must be within fp32 rounding of the
    exact result: |ours - theirs| <= RESIDUE_ULPS * eps32 * scale;
  - a knife edge: a TIES sign election whose |sum_k w_k trim(delta_k)| is within fp32
    rounding of zero (`knife`), where either sign is a correct election.
Elements at a magnitude threshold (mergekit keeps an arbitrary subset of ties) are
excluded by the caller. Everything else must satisfy the rule: no count of misses is tolerated.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MERGEKIT_PYTHON = Path(os.environ.get("MERGEKIT_PYTHON", ROOT / ".venv-mergekit" / "bin" / "python"))
INSTALL = ("python3 -m venv .venv-mergekit && "
           ".venv-mergekit/bin/pip install torch==2.13.0 mergekit==0.1.5")

EPS32 = 2.0 ** -24  # unit roundoff of fp32
RESIDUE_ULPS = 8  # a handful of fp32 roundings: the sums have at most a few terms
CANCELLED_BITS = 8  # a result this far below its terms' magnitudes has cancelled
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of |x| in `dtype` (fp64 tensor; subnormals rounded up)."""
    x = x.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(x)) - MANTISSA[dtype])


@dataclass
class Verdict:
    compared: int
    identical: int
    within_ulp: int
    residues: int
    knife_edges: int
    misses: int
    worst: float  # the largest |ours - theirs| / allowed among misses (0 if none)

    def __str__(self) -> str:
        return (f"{self.misses} of {self.compared} elements outside the rule (worst {self.worst:.3g}x allowed); "
                f"{self.identical} identical, {self.within_ulp} within one ulp, {self.residues} residues, "
                f"{self.knife_edges} knife-edge elections")


def judge(ours: torch.Tensor, theirs: torch.Tensor, *, scale: torch.Tensor,
          knife: torch.Tensor | None = None) -> Verdict:
    """Apply the rule to the elements given (flattened; same dtype, same shape)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape == scale.shape
    a, b = ours.double(), theirs.double()
    diff = (a - b).abs()
    same = (a == b) | (a.isnan() & b.isnan())
    one_ulp = ~same & (diff <= ulp(torch.maximum(a.abs(), b.abs()), ours.dtype))
    residue_limit = RESIDUE_ULPS * EPS32 * scale.double()
    cancelled = torch.maximum(a.abs(), b.abs()) < 2.0 ** -CANCELLED_BITS * scale.double()
    residue = ~same & ~one_ulp & cancelled & (diff <= residue_limit)
    edge = ~same & ~one_ulp & ~residue & (knife if knife is not None else torch.zeros_like(same))
    miss = ~(same | one_ulp | residue | edge)
    allowed = torch.where(cancelled, torch.maximum(ulp(torch.maximum(a.abs(), b.abs()), ours.dtype), residue_limit),
                          ulp(torch.maximum(a.abs(), b.abs()), ours.dtype))
    worst = float((diff[miss] / allowed[miss]).max()) if bool(miss.any()) else 0.0
    return Verdict(int(ours.numel()), int(same.sum()), int(one_ulp.sum()), int(residue.sum()),
                   int(edge.sum()), int(miss.sum()), worst)


def knife_edges(terms: list[torch.Tensor]) -> torch.Tensor:
    """Where a sign election over these fp32 terms (w_k * trimmed delta_k) is within rounding of zero."""
    total = torch.zeros_like(terms[0], dtype=torch.float64)
    magnitude = torch.zeros_like(total)
    for t in terms:
        total += t.double()
        magnitude += t.double().abs()
    return total.abs() <= RESIDUE_ULPS * EPS32 * magnitude


def merge_scale(base: torch.Tensor, experts: list[torch.Tensor], weights: list[float], *,
                lam: float = 1.0, divisor: float = 1.0) -> torch.Tensor:
    """A bound on the magnitudes summed into each element of any of our methods:
    |base| + max(1, |lambda|) / min(1, |divisor|) * sum_k |w_k| (|x_k| + |base|),
    which covers linear (sum of w_k x_k) and every delta method (|delta_k| <= |x_k| + |base|)."""
    b = base.double().abs()
    acc = torch.zeros_like(b)
    for w, x in zip(weights, experts):
        acc += abs(w) * (x.double().abs() + b)
    return b + max(1.0, abs(lam)) / min(1.0, max(abs(divisor), 1e-8)) * acc
