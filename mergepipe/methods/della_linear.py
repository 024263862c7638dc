"""DELLA-Merging with a plain weighted sum (Deep et al. 2024, arXiv:2406.11617; mergekit's `della_linear`).

Prune each delta with MagPrune (methods/_della.py), then
theta = W0 + lambda * sum_k w_k pruned_k (/ sum_k w_k if normalize).

mergekit 0.1.5's defaults: normalize false, rescale true, epsilon 0.15, density 1, lambda 1; and
its rescale, the whole tensor's L1 ratio (`rescale_mode: l1`, from the joint scan);
`rescale_mode: keep_probability` is the paper's 1/p_i instead (see _della.py, also for the
seeded mask). epsilon is one value for every expert here (per-model in mergekit;
import-mergekit requires them equal).
"""
from __future__ import annotations

from mergepipe.util.lazy import torch

from mergepipe.methods._common import combine
from mergepipe.methods._della import L1_SUMS, MagPruneParams, pruned_deltas
from mergepipe.methods.base import BlockInputs
from mergepipe.methods.registry import GTA_SHARED, Mergekit, register


class DellaLinearParams(MagPruneParams):
    normalize: bool = False


@register("della_linear",
          mergekit=Mergekit(shared_model_keys=("epsilon",),
                            shared=GTA_SHARED,
                            per_input=("weight", "density", "epsilon")),
          params=DellaLinearParams, additive=False, joint=L1_SUMS,
          paper="Deep et al. 2024, DELLA-Merging: Reducing Interference in Model Merging through "
                "Magnitude-Based Sampling, arXiv:2406.11617")
def merge(block: BlockInputs, p: DellaLinearParams) -> torch.Tensor:
    experts, pruned = pruned_deltas(block, p)
    return combine(block, experts, pruned, consensus=False, normalize=p.normalize, lambda_=p.lambda_)
