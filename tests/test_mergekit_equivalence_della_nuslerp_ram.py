"""Equivalence with mergekit 0.1.5 of the methods added for issue 14 that need no whole-tensor
statistics: passthrough, nearswap, ram, della, della_linear, nuslerp (row mode); and those that take
whole-tensor statistics from the joint scan (here computed on the whole tensor as one block):
ramplus_tl (per-expert shared/unique counts) and nuslerp's flatten and column modes.

As tests/test_mergekit_equivalence.py: a script in the mergekit virtualenv applies
`mergekit.merge_methods.api.merge_tensors` (dtype float32) to tensors from a safetensors
file; we run our methods block by block on the same tensors and judge element by element by
the rule of docs/design.md "Equivalence with mergekit" (tests/helpers/equivalence.py). Experts get
content hashes in config order, so both sum in one order.

della is randomized: mergekit draws its mask with torch.bernoulli from the global RNG, ours
from a generator seeded by content. The script replaces torch.bernoulli by one that records
the keep probabilities mergekit asks for and returns our mask, so that with `rescale: false`,
and with `rescale: true` against our `rescale_mode: l1` (mergekit's whole-tensor L1 ratio, from
the joint scan), the merges must agree by the rule and the probabilities must be equal bit for
bit (distinct magnitudes in each row, so no tie is ranked differently). Our default rescale
divides by each keep probability; against mergekit's L1 we compare expectations: the kept count
within 3 sigma of sum p, our L1 norm within 3 sigma of the delta's, which mergekit's equals by
construction.
"""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from tests.helpers.cuts import run_method
from safetensors.torch import load_file, save_file

from mergepipe.methods._della import keep_probabilities
from mergepipe.methods.base import block_rng
from mergepipe.methods.nuslerp import interpolation_t, row_cosines, slerp_rows
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge

pytestmark = pytest.mark.skipif(
    not MERGEKIT_PYTHON.exists(),
    reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}")

SCRIPT = r'''
import json, sys
import torch
from safetensors.torch import load_file, save_file
from mergekit.merge_methods.api import merge_tensors
from mergekit import sparsify

inputs = load_file(sys.argv[1])
runs = json.loads(open(sys.argv[2]).read())
real_bernoulli = torch.bernoulli
out = {}
for run in runs:
    recorded = []
    if run.get("masks") is not None:
        masks = iter([inputs[m] for m in run["masks"]])
        def fake(p, *a, **k):
            recorded.append(p.clone())
            return next(masks).to(p.dtype).reshape(p.shape)
        torch.bernoulli = fake
    try:
        if run["kind"] == "merge":
            out[run["id"]] = merge_tensors([inputs[t] for t in run["tensors"]], run["method"],
                                           parameters=run["parameters"], base_index=run["base_index"],
                                           dtype=torch.float32).contiguous()
        else:
            torch.manual_seed(run["seed"])
            out[run["id"]] = sparsify.della_magprune(inputs[run["tensor"]], **run["parameters"]).contiguous()
    finally:
        torch.bernoulli = real_bernoulli
    for i, p in enumerate(recorded):
        out[f"{run['id']}.probs{i}"] = p.contiguous()
save_file(out, sys.argv[3])
'''

SHAPE = (24, 40)
BOUNDARIES = [5, 11, 19]  # blocks of whole rows, as the engine cuts them
HASHES = [f"{i:02d}" * 32 for i in range(4)]  # content hashes in config order


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _families() -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """Bases and experts whose fp32 deltas are exact (base + (W - base) == W)."""
    g = torch.Generator().manual_seed(14)
    fams = {}
    base = _bf16(torch.randn(SHAPE, generator=g))
    fams["bf16"] = (base, [_bf16(base + torch.randn(SHAPE, generator=g) * 0.05) for _ in range(3)])
    # ram: sparse deltas (about half the elements unchanged per expert, some below epsilon),
    # so 0, 1, 2 and 3 contributors all occur
    experts = []
    for _ in range(3):
        delta = torch.randn(SHAPE, generator=g) * 0.05
        delta = torch.where(torch.rand(SHAPE, generator=g) < 0.5, torch.zeros(()), delta)
        small = torch.rand(SHAPE, generator=g) < 0.1
        delta = torch.where(small, delta * 1e-4, delta)
        experts.append(_bf16(base + delta))
    fams["sparse"] = (base, experts)
    # della: every |delta| of a row distinct (integers times a power of two), signs random
    base_i = torch.randint(-64, 65, SHAPE, generator=g).float() * 2.0**-4
    experts = []
    for _ in range(3):
        magnitudes = torch.stack([torch.randperm(SHAPE[1], generator=g) + 1 for _ in range(SHAPE[0])]).float()
        signs = torch.randint(0, 2, SHAPE, generator=g).float() * 2 - 1
        experts.append(base_i + magnitudes * signs * 2.0**-10)
    fams["distinct"] = (base_i, experts)
    # nuslerp: rows 0-3 of expert 1's delta are 3x expert 0's (colinear), rows 4-7 -2x
    base, (e0, e1, e2) = fams["bf16"]
    d0 = e0 - base
    e1 = e1.clone()
    e1[:4] = base[:4] + 3 * d0[:4]
    e1[4:8] = base[4:8] - 2 * d0[4:8]
    fams["nuslerp"] = (base, [e0, e1, e2])
    for b, ws in fams.values():
        for w in ws:
            assert torch.equal(b + (w - b), w)
    return fams


class Case:
    def __init__(self, cid, method, params, *, family, n_experts, weights=None, ours_params=None,
                 expert_params=None, masks=False, base_index=0):
        self.cid, self.method, self.params, self.family = cid, method, params, family
        self.n_experts, self.weights = n_experts, weights
        self.ours_params = params if ours_params is None else ours_params
        self.expert_params = expert_params or {}
        self.masks, self.base_index = masks, base_index


ROW = {"nuslerp_flatten": False}
DELLA_DENSITY = {"density": [0.5, 0.3, 0.7]}
CASES = [
    Case("pass", "passthrough", {}, family="bf16", n_experts=1, base_index=None),
    Case("pass_scale", "passthrough", {"scale": 0.37}, family="bf16", n_experts=1, base_index=None),
    Case("near_small", "nearswap", {"t": 1e-7}, family="bf16", n_experts=1),
    Case("near_mid", "nearswap", {"t": 0.01}, family="bf16", n_experts=1),
    Case("near_big", "nearswap", {"t": 0.2}, family="bf16", n_experts=1),
    Case("ram", "ram", {}, family="sparse", n_experts=3),
    Case("ram_eps", "ram", {"epsilon": 0.02}, family="sparse", n_experts=3),
    Case("ram_dense", "ram", {}, family="bf16", n_experts=3),
    Case("ramplus", "ramplus_tl", {}, family="sparse", n_experts=3),
    Case("ramplus_r", "ramplus_tl", {"r": 0.5, "alpha": 0.7, "epsilon": 0.02}, family="sparse", n_experts=3),
    Case("ramplus_dense", "ramplus_tl", {"r": 0.3}, family="bf16", n_experts=3),
    Case("della", "della", {"rescale": False}, family="distinct", n_experts=3, weights=[0.6, 1.0, 0.35],
         expert_params=DELLA_DENSITY, masks=True),
    Case("della_eps", "della", {"rescale": False, "epsilon": 0.05, "lambda": 0.8}, family="distinct",
         n_experts=3, weights=[0.6, 1.0, 0.35], expert_params=DELLA_DENSITY, masks=True),
    Case("della_lin", "della_linear", {"rescale": False}, family="distinct", n_experts=3,
         weights=[0.6, 1.0, 0.35], expert_params=DELLA_DENSITY, masks=True),
    Case("della_lin_norm", "della_linear", {"rescale": False, "normalize": True, "epsilon": 0.2},
         family="distinct", n_experts=3, weights=[0.6, 1.0, 0.35], expert_params=DELLA_DENSITY, masks=True),
    Case("della_full", "della", {}, family="bf16", n_experts=3, weights=[0.6, 1.0, 0.35]),
    # mergekit's L1 rescale (rescale: true there), ours with rescale_mode l1: same masks, same result
    Case("della_l1", "della", {}, family="distinct", n_experts=3, weights=[0.6, 1.0, 0.35],
         ours_params={"rescale_mode": "l1"}, expert_params=DELLA_DENSITY, masks=True),
    Case("della_lin_l1", "della_linear", {"epsilon": 0.05, "lambda": 1.3}, family="distinct", n_experts=3,
         weights=[0.6, 1.0, 0.35], ours_params={"epsilon": 0.05, "lambda": 1.3, "rescale_mode": "l1"},
         expert_params=DELLA_DENSITY, masks=True),
    Case("nuslerp", "nuslerp", ROW, family="nuslerp", n_experts=2, weights=[0.6, 1.0]),
    Case("nuslerp_cancel", "nuslerp", ROW, family="nuslerp", n_experts=2, weights=[0.5, -0.5]),
    Case("nuslerp_nobase", "nuslerp", ROW, family="nuslerp", n_experts=2, weights=[0.3, 0.9], base_index=None,
         ours_params={**ROW, "base_weight": 0.3}),
    Case("nuslerp_flat", "nuslerp", {}, family="bf16", n_experts=2, weights=[0.6, 1.0]),
    Case("nuslerp_flat_nobase", "nuslerp", {}, family="bf16", n_experts=2, weights=[0.3, 0.9], base_index=None,
         ours_params={"base_weight": 0.3}),
    Case("nuslerp_column", "nuslerp", {**ROW, "nuslerp_row_wise": True}, family="nuslerp", n_experts=2,
         weights=[0.6, 1.0]),
    Case("nuslerp_column_nobase", "nuslerp", {**ROW, "nuslerp_row_wise": True}, family="bf16", n_experts=2,
         weights=[0.3, 0.9], base_index=None, ours_params={**ROW, "nuslerp_row_wise": True, "base_weight": 0.3}),
]
WHOLE_TENSOR = {"nuslerp_flat", "nuslerp_flat_nobase", "nuslerp_column", "nuslerp_column_nobase", "ramplus",
                "ramplus_r", "ramplus_dense", "della_l1", "della_lin_l1"}


def _masks(case: Case, base: torch.Tensor, experts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Our della masks for the whole tensor, block by block (what run_method draws)."""
    masks = []
    edges = [0] + ([] if case.cid in WHOLE_TENSOR else BOUNDARIES) + [SHAPE[0]]
    for i, w in enumerate(experts):
        density = case.expert_params["density"][i]
        epsilon = case.ours_params.get("epsilon", 0.15)
        parts = []
        for r0, r1 in zip(edges[:-1], edges[1:]):
            probs = keep_probabilities((w - base)[r0:r1], density, epsilon)
            u = torch.rand(probs.shape, generator=block_rng(0, HASHES[i], "w", r0), dtype=torch.float32)
            parts.append(u < probs)
        masks.append(torch.cat(parts))
    return masks


def _ours(case: Case, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    weights = case.weights or [1.0] * len(experts)
    if case.method == "passthrough":  # the one model is the base; the expert is the base itself
        entries = [{"name": "m", "hash": HASHES[0], "weight": 1.0, "delta": None}]
        return run_method("passthrough", case.ours_params, experts[0], entries, boundaries=BOUNDARIES, tensor="w")
    if case.base_index is None:  # nuslerp without a base model: the first model plays the base
        base, experts, weights = experts[0], experts[1:], weights[1:]
    entries = []
    for i, w in enumerate(experts):
        e = {"name": f"e{i}", "hash": HASHES[i + (1 if case.base_index is None else 0)], "weight": weights[i],
             "delta": w - base}
        e.update({key: values[i] for key, values in case.expert_params.items()})
        entries.append(e)
    # the whole-tensor modes get their sums from the engine's joint scan; one block computes them itself
    boundaries = None if case.cid in WHOLE_TENSOR else BOUNDARIES
    return run_method(case.method, case.ours_params, base, entries, boundaries=boundaries, tensor="w")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mergekit2")
    fams = _families()
    tensors, runs, ours, masks = {}, [], {}, {}
    for fname, (base, experts) in fams.items():
        tensors[f"{fname}.base"] = base
        for i, w in enumerate(experts):
            tensors[f"{fname}.e{i}"] = w
    for case in CASES:
        base, experts = fams[case.family]
        experts = experts[:case.n_experts]
        names = [f"{case.family}.e{i}" for i in range(case.n_experts)]
        run = {"kind": "merge", "id": case.cid, "method": case.method, "parameters": dict(case.params)}
        if case.base_index is None:
            run.update(tensors=names, base_index=None)
        else:
            run.update(tensors=[f"{case.family}.base"] + names, base_index=0)
        if case.weights is not None:
            run["parameters"]["weight"] = case.weights
        run["parameters"].update(case.expert_params)
        if case.masks:
            masks[case.cid] = _masks(case, base, experts)
            run["masks"] = []
            for i, m in enumerate(masks[case.cid]):
                tensors[f"{case.cid}.mask{i}"] = m.float()
                run["masks"].append(f"{case.cid}.mask{i}")
        runs.append(run)
        ours[case.cid] = _ours(case, base, experts)
    # the sparsifier alone on one large delta, mergekit's L1 rescale, a fixed global seed
    g = torch.Generator().manual_seed(15)
    big = torch.randn(256, 512, generator=g) * 0.02
    tensors["big"] = big
    for density, epsilon in ((0.3, 0.1), (0.6, 0.15)):
        runs.append({"kind": "della_magprune", "id": f"prune_{density}", "tensor": "big", "seed": 0,
                     "parameters": {"density": density, "epsilon": epsilon, "rescale_norm": "l1"}})
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, tmp / "in.safetensors")
    (tmp / "runs.json").write_text(json.dumps(runs))
    (tmp / "ref.py").write_text(SCRIPT)
    proc = subprocess.run([str(MERGEKIT_PYTHON), str(tmp / "ref.py"), str(tmp / "in.safetensors"),
                           str(tmp / "runs.json"), str(tmp / "out.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"theirs": load_file(tmp / "out.safetensors"), "ours": ours, "families": fams, "masks": masks,
            "big": big}


def _scale(case: Case, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """A bound on the magnitudes summed into each element (the rule's cancellation residue):
    |base| + sum_k |w_k| (|x_k| + |base|), times 1/sin(theta)-sized factors for nuslerp."""
    weights = [abs(w) for w in (case.weights or [1.0] * len(experts))]
    acc = base.double().abs()
    for w, x in zip(weights, experts):
        acc = acc + max(w, 1.0) * (x.double().abs() + base.double().abs())
    return acc * (4.0 if case.method == "nuslerp" else 1.0)


def _nuslerp_vectors(case: Case, base: torch.Tensor, experts: list[torch.Tensor]):
    """(t, v0, v1, what is added to the result) of a nuslerp case, as mergekit sets them up."""
    w0, w1 = case.weights
    if case.base_index is None:
        return interpolation_t(w0, w1), experts[0], experts[1], torch.zeros_like(base)
    return interpolation_t(w0, w1), experts[0] - base, experts[1] - base, base


def _as_vectors(case: Case, x: torch.Tensor) -> torch.Tensor:
    """x as (vectors, n): its rows, the whole tensor, or its columns, by the case's mode."""
    if case.params.get("nuslerp_flatten", True):
        return x.reshape(1, -1)
    return x.transpose(0, -1) if case.params.get("nuslerp_row_wise") else x  # a view, as mergekit's


def _mergekit_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mergekit's per-row cos: fp32 norms (clamped at 1e-7), normalized rows, fp32 sum."""
    def unit(x):
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=1e-7)
    return torch.sum(unit(a) * unit(b), dim=-1, keepdim=True).clamp(-1, 1)


@pytest.mark.parametrize("case", CASES, ids=[c.cid for c in CASES])
def test_method_matches_mergekit(reference, case):
    theirs, ours = reference["theirs"][case.cid], reference["ours"][case.cid]
    assert theirs.shape == ours.shape
    base, experts = reference["families"][case.family]
    experts = experts[:case.n_experts]
    compare = torch.ones_like(ours, dtype=torch.bool)
    if case.method == "nuslerp":
        # Our per-row cos is the fp64 one rounded to fp32, mergekit's an fp32 reduction; where
        # they differ, mergekit's own formula at its own cos must give its result (all but the
        # reduction is the same arithmetic), and ours is the better angle; then the rule is
        # applied to the rows whose cos agree. The antipodal rows (delta_1 = -2 delta_0) are
        # the knife edge: exactly colinear (lerp), where mergekit's cos -1 + 2^-24 takes the
        # ill-conditioned slerp branch.
        t, v0, v1, added = _nuslerp_vectors(case, base, experts)
        a, b = _as_vectors(case, v0), _as_vectors(case, v1)
        cos_ours, cos_theirs = row_cosines(a, b), _mergekit_cosines(a, b)
        exact = (a.double() * b.double()).sum(1, keepdim=True) / (
            a.double().norm(dim=1, keepdim=True) * b.double().norm(dim=1, keepdim=True))
        assert torch.equal(cos_ours, exact.float().clamp(-1, 1))
        interpolated = slerp_rows(t, a, b, cos_theirs)
        interpolated = interpolated.T if case.params.get("nuslerp_row_wise") else interpolated.reshape(base.shape)
        same_formula = judge((added + interpolated).reshape(-1), theirs.reshape(-1),
                             scale=_scale(case, base, experts).reshape(-1))
        assert same_formula.misses == 0, f"mergekit's formula at mergekit's cos: {same_formula}"
        same_cos = cos_ours == cos_theirs
        compare = (same_cos.T if case.params.get("nuslerp_row_wise") else same_cos).expand_as(ours) \
            if same_cos.numel() > 1 else same_cos.reshape(1, 1).expand_as(ours)
        if same_cos.numel() > 1:
            assert same_cos.float().mean() > 0.25, "too few vectors with the same cos to compare"
    verdict = judge(ours[compare], theirs[compare], scale=_scale(case, base, experts)[compare])
    assert verdict.misses == 0, str(verdict)
    # every case must merge something, and most elements compared must be bit-identical
    assert not torch.equal(ours, base) and verdict.identical >= 0.5 * verdict.compared, str(verdict)


@pytest.mark.parametrize("case", [c for c in CASES if c.masks], ids=[c.cid for c in CASES if c.masks])
def test_della_keep_probabilities_equal_mergekit(reference, case):
    """mergekit's bernoulli was asked for exactly our p_i, row by row of the whole tensor."""
    base, experts = reference["families"][case.family]
    for i, w in enumerate(experts[:case.n_experts]):
        theirs = reference["theirs"][f"{case.cid}.probs{i}"]
        ours = keep_probabilities(w - base, case.expert_params["density"][i], case.ours_params.get("epsilon", 0.15))
        assert torch.equal(ours, theirs.reshape(ours.shape)), i


def test_ram_exercises_every_contributor_count(reference):
    base, experts = reference["families"]["sparse"]
    count = sum(((w - base).abs() > 1e-5).int() for w in experts)
    assert {int(c) for c in count.unique()} == {0, 1, 2, 3}
    # and ramplus_tl's amplification is neither 1 nor capped for every expert
    from mergepipe.methods.ramplus_tl import RamplusTlParams, amplification, shared_unique_counts
    deltas = torch.stack([w - base for w in experts]).numpy()
    lambdas = amplification(shared_unique_counts(deltas, 1e-5), 3, RamplusTlParams(r=0.5, alpha=10.0))
    assert bool((lambdas > 1).all()) and len(set(lambdas.tolist())) == 3


@pytest.mark.parametrize("density,epsilon", [(0.3, 0.1), (0.6, 0.15)])
def test_della_rescale_matches_mergekit_in_expectation(reference, density, epsilon):
    """Ours divides each kept element by p_i, mergekit scales by sum|delta| / sum|kept|: both keep
    sum p_i elements on average and the delta's L1 norm (mergekit's exactly, ours in expectation)."""
    from mergepipe.methods._della import sparsify_della
    from mergepipe.methods.base import BlockInputs, ExpertBlock

    big = reference["big"]
    theirs = reference["theirs"][f"prune_{density}"]
    probs = keep_probabilities(big, density, epsilon).double()
    expected_kept = float(probs.sum())
    sigma_kept = math.sqrt(float((probs * (1 - probs)).sum()))
    l1 = float(big.double().abs().sum())
    # sum |delta_i| m_i / p_i: variance sum delta_i^2 (1 - p_i) / p_i
    sigma_l1 = math.sqrt(float((big.double() ** 2 * (1 - probs) / probs).sum()))
    assert abs(int((theirs != 0).sum()) - expected_kept) <= 3 * sigma_kept
    assert abs(float(theirs.double().abs().sum()) - l1) <= 1e-5 * l1
    expert = ExpertBlock("e", HASHES[0], 1.0, big, density=density)
    ours = sparsify_della(big, expert, BlockInputs("w", 0, big.shape[0], tuple(big.shape), torch.zeros_like(big),
                                                   (expert,)), epsilon=epsilon, rescale=True)
    assert abs(int((ours != 0).sum()) - expected_kept) <= 3 * sigma_kept
    assert abs(float(ours.double().abs().sum()) - l1) <= 3 * sigma_l1
    # kept elements are the delta over its own p_i, exactly
    kept = ours != 0
    assert torch.equal(ours[kept], (big / keep_probabilities(big, density, epsilon))[kept])
