"""Linear algebra whose every bit is fixed by its inputs: fp64 column sums, products, a
Householder QR and a one-sided Jacobi SVD, built only from elementwise torch operations
(add, sub, mul, div, sqrt, abs, where, indexing), each of which rounds one IEEE operation per
element on every CPU and at every thread count. No BLAS or LAPACK call: their reductions and
blockings follow the thread count and the CPU (docs/design.md, "Adapters out"). Sums run in a
fixed pairwise tree (`column_sums`), products term by term in order (`product`).

For the small-core SVD of a low-rank product B·A (checkpoint/lora_combine.py): QRs of the two
tall factors, then the SVD of the r×r core. torch is imported on first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_SWEEPS = 60  # one-sided Jacobi converges quadratically: a few sweeps for the ranks of adapters


def column_sums(x: torch.Tensor) -> torch.Tensor:
    """Σ_i x[i, :] by a fixed pairwise tree: rows [0, h) + [h, 2h), the odd last row carried."""
    import torch
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1:], dtype=x.dtype)
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        head = x[:h] + x[h:2 * h]
        x = head if x.shape[0] == 2 * h else torch.cat([head, x[2 * h:]])
    return x[0]


def product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right as Σ_k left[:, k] ⊗ right[k, :], k in order, each product and sum rounded."""
    import torch
    acc = torch.zeros((left.shape[0], right.shape[1]), dtype=left.dtype)
    for k in range(left.shape[1]):
        acc = acc + left[:, k:k + 1] * right[k:k + 1]
    return acc


@dataclass(frozen=True, slots=True)
class Householder:
    """x = Q·R: `r` (p × m, upper triangular, p = min(n, m)), Q kept as its reflectors
    (H_j = I - factor_j·v_j·v_jᵀ on rows j.., None where column j was already zero)."""

    r: torch.Tensor
    reflectors: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    rows: int

    def apply_q(self, y: torch.Tensor) -> torch.Tensor:
        """Q·y for y of p rows (Q's first p columns times y): n rows."""
        import torch
        out = torch.zeros((self.rows, y.shape[1]), dtype=y.dtype)
        out[:y.shape[0]] = y
        for j in reversed(range(len(self.reflectors))):
            if self.reflectors[j] is not None:
                v, factor = self.reflectors[j]
                out[j:] = _reflect(out[j:], v, factor)
        return out


def _reflect(x: torch.Tensor, v: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """(I - factor·v·vᵀ)·x."""
    w = column_sums(v[:, None] * x) * factor
    return x - v[:, None] * w[None, :]


def householder(x: torch.Tensor) -> Householder:
    """The QR of x (n × m, fp64) by Householder reflections, column by column."""
    import torch
    x = x.clone()
    n, m = x.shape
    reflectors: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for j in range(min(n, m)):
        column = x[j:, j]
        norm = torch.sqrt(column_sums((column * column)[:, None]))[0]
        if norm == 0:
            reflectors.append(None)
            continue
        v = column.clone()
        # v = x - alpha·e_1 with alpha of the sign opposite to x_0: no cancellation in v_0
        v[0] = v[0] + norm if column[0] >= 0 else v[0] - norm
        factor = 2.0 / column_sums((v * v)[:, None])[0]
        x[j:, j:] = _reflect(x[j:, j:], v, factor)
        reflectors.append((v, factor))
    p = min(n, m)
    return Householder(torch.triu(x[:p]), tuple(reflectors), n)


@dataclass(frozen=True, slots=True)
class Svd:
    """x = Σ_j w[:, j]·v[:, j]ᵀ: w = x·v has orthogonal columns of norms `sigma` (descending),
    v (m × m) orthogonal; each column's sign makes its largest-magnitude v entry positive."""

    w: torch.Tensor
    v: torch.Tensor
    sigma: torch.Tensor


def jacobi_svd(x: torch.Tensor) -> Svd:
    """One-sided Jacobi (Hestenes) on x's columns (fp64), in round-robin order: each round
    rotates m/2 disjoint column pairs at once, a pair left alone once it is orthogonal to
    working precision; stops after a sweep that rotates nothing (at most MAX_SWEEPS)."""
    import torch
    n, m = x.shape
    size = m + m % 2  # a zero column pads an odd count, so that every round pairs all columns
    wt = torch.zeros((size, n), dtype=torch.float64)  # columns as rows: pairs gather whole rows
    wt[:m] = x.T
    vt = torch.eye(size, dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    rounds = _rounds(size)
    for _ in range(MAX_SWEEPS):
        rotated = False
        for p, q in rounds:
            rotated |= _rotate(wt, vt, p, q, eps)
        if not rotated:
            break
    # the padding column is zero, so no pair with it is ever rotated: v's last row and column
    # stay those of the identity
    wt, vt = wt[:m], vt[:m, :m]
    sigma = torch.sqrt(row_sums(wt * wt))
    order = sorted(range(m), key=lambda j: (-float(sigma[j]), j))  # stable: ties keep column order
    wt, vt, sigma = wt[order], vt[order], sigma[order]
    peak = vt.abs().argmax(dim=1)  # the first index of the largest magnitude (torch: the first maximum)
    sign = torch.where(vt[torch.arange(m), peak] < 0, -1.0, 1.0).to(torch.float64)[:, None]
    return Svd((wt * sign).T, (vt * sign).T, sigma)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Σ_j x[:, j] by the fixed pairwise tree of `column_sums`, along rows."""
    import torch
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], dtype=x.dtype)
    while x.shape[1] > 1:
        h = x.shape[1] // 2
        head = x[:, :h] + x[:, h:2 * h]
        x = head if x.shape[1] == 2 * h else torch.cat([head, x[:, 2 * h:]], dim=1)
    return x[:, 0]


def _rounds(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The round-robin tournament on `size` columns (even): size-1 rounds of size/2 pairs
    (p < q), every pair once per sweep."""
    import torch
    players = list(range(size))
    rounds = []
    for _ in range(size - 1):
        pairs = [(players[i], players[size - 1 - i]) for i in range(size // 2)]
        rounds.append((torch.tensor([min(a, b) for a, b in pairs]), torch.tensor([max(a, b) for a, b in pairs])))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def _rotate(wt: torch.Tensor, vt: torch.Tensor, p: torch.Tensor, q: torch.Tensor, eps: float) -> bool:
    """Rotate the column pairs (p[i], q[i]) (rows of wt, vt) to orthogonality; whether any moved."""
    import torch
    wp, wq = wt[p], wt[q]
    alpha, beta, gamma = row_sums(wp * wp), row_sums(wq * wq), row_sums(wp * wq)
    active = gamma.abs() > eps * torch.sqrt(alpha * beta)
    if not bool(active.any()):
        return False
    safe = torch.where(active, gamma, torch.ones_like(gamma))
    zeta = (beta - alpha) / (2.0 * safe)
    # the smaller root of t² + 2ζt - 1 = 0 (rotation angle ≤ π/4); ζ² overflowing gives t = 0
    t = torch.where(zeta >= 0, 1.0, -1.0).to(torch.float64) / (zeta.abs() + torch.sqrt(1.0 + zeta * zeta))
    t = torch.where(active, t, torch.zeros_like(t))
    if not bool((t != 0).any()):
        return False
    c = (1.0 / torch.sqrt(1.0 + t * t))[:, None]
    s = c * t[:, None]
    wt[p], wt[q] = c * wp - s * wq, s * wp + c * wq
    vp, vq = vt[p], vt[q]
    vt[p], vt[q] = c * vp - s * vq, s * vp + c * vq
    return True
