"""Equivalence with mergekit 0.1.5's own tensor functions.

A small script runs in a separate virtualenv that has mergekit (its dependency
pins must not leak into ours): it reads tensors from a safetensors file, applies
`mergekit.merge_methods.api.merge_tensors` (dtype float32) and
`mergekit.sparsify.*`, and writes the results back. We run our methods block by
block on the same tensors and compare: at most 1 ulp, except on elements whose
|delta| equals its expert's magnitude threshold, where mergekit keeps an arbitrary
subset (DESIGN.md "Ties at a magnitude threshold"); there we check that both keep
exactly k. Experts get content hashes in config order, so both sum in one order.

Needs `.venv-mergekit` (or MERGEKIT_PYTHON):
    python3 -m venv .venv-mergekit && .venv-mergekit/bin/pip install torch==2.13.0 mergekit==0.1.5
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tests.helpers.cuts import run_method, top_rank_reference, ulp_distance
from safetensors.torch import load_file, save_file

from mergepipe.methods._common import dare_mask, magnitude_rank
from mergepipe.methods.base import block_rng
from mergepipe.methods.slerp import cosine_from_sums
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge, knife_edges, merge_scale


pytestmark = pytest.mark.skipif(
    not MERGEKIT_PYTHON.exists(),
    reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}")

SCRIPT = r'''
import json, sys
import torch
from safetensors.torch import load_file, save_file
import mergekit
from mergekit.merge_methods.api import merge_tensors
from mergekit import sparsify

inputs = load_file(sys.argv[1])
runs = json.loads(open(sys.argv[2]).read())
real_bernoulli = torch.bernoulli
out = {}
for run in runs:
    if run["kind"] == "merge":
        masks = iter([inputs[m] for m in run.get("masks", [])])
        if run.get("masks"):
            torch.bernoulli = lambda p, *a, **k: next(masks).to(p.dtype)
        try:
            out[run["id"]] = merge_tensors([inputs[t] for t in run["tensors"]], run["method"],
                                           parameters=run["parameters"], base_index=run["base_index"],
                                           dtype=torch.float32).contiguous()
        finally:
            torch.bernoulli = real_bernoulli
    else:
        fn = getattr(sparsify, run["kind"])
        out[run["id"]] = fn(inputs[run["tensor"]], **run["parameters"]).contiguous()
save_file(out, sys.argv[3])
print(mergekit.__file__)
'''


def _family(seed: int, kind: str, shape=(48, 64), k: int = 3):
    """A base and k experts whose fp32 deltas are exact (base + (W - base) == W).

    kind "bf16": bf16-rounded weights; "distinct": every |delta| of an expert differs,
    so magnitude thresholds have no ties; "duplicated": 32 magnitudes, many ties.
    """
    g = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    if kind == "bf16":
        base = torch.randn(shape, generator=g).to(torch.bfloat16).float()
        experts = [(base + torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16).float() for _ in range(k)]
    else:
        base = torch.randint(-64, 65, shape, generator=g).float() * 2.0**-4
        experts = []
        for _ in range(k):
            if kind == "distinct":
                magnitudes = (torch.randperm(n, generator=g) + 1).float().reshape(shape) * 2.0**-12
            else:
                magnitudes = torch.randint(1, 33, shape, generator=g).float() * 2.0**-6
            signs = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
            experts.append(base + magnitudes * signs)
    for w in experts:
        assert torch.equal(base + (w - base), w)
    return base, experts


FAMILY_KINDS = {0: "bf16", 1: "distinct", 2: "duplicated", 3: "distinct", 4: "bf16", 5: "bf16"}
WEIGHTS = [0.6, 1.0, 0.35]


class Case:
    def __init__(self, cid, method, params, expert_params, *, family, ours_params=None, masks=None,
                 thresholds=False, base_weight=0.0, boundaries=(5, 17, 30)):
        self.cid, self.method, self.params, self.expert_params = cid, method, params, expert_params
        self.family, self.ours_params = family, params if ours_params is None else ours_params
        self.masks, self.thresholds, self.base_weight = masks, thresholds, base_weight
        self.boundaries = list(boundaries)


CASES = [
    Case("ta", "task_arithmetic", {"lambda": 0.7}, {}, family=0),
    Case("ta_norm", "task_arithmetic", {"normalize": True}, {}, family=0),
    Case("ties", "ties", {}, {"density": [0.4, 0.3, 0.55]}, family=1),
    Case("ties_lambda", "ties", {"lambda": 0.8, "normalize": False}, {"density": [0.2, 0.9, 0.5]}, family=1),
    Case("ties_dup", "ties", {}, {"density": [0.4, 0.3, 0.55]}, family=2, thresholds=True),
    Case("ties_k0", "ties", {}, {"density": [0.0001, 0.3, 1.0]}, family=1),
    Case("bc", "breadcrumbs", {}, {"density": [0.5, 0.7, 0.3], "gamma": [0.1, 0.01, 0.0]}, family=3),
    Case("bc_ties", "breadcrumbs_ties", {"lambda": 1.3}, {"density": [0.5, 0.7, 0.3], "gamma": [0.1, 0.05, 0.2]},
         family=3),
    Case("bc_overlap", "breadcrumbs", {}, {"density": [0.95, 1.0, 0.0], "gamma": [0.1, 0.5, 0.1]}, family=3),
    Case("bc_dup", "breadcrumbs_ties", {}, {"density": [0.5, 0.7, 0.3], "gamma": [0.1, 0.05, 0.2]}, family=2,
         thresholds=True),
    Case("dare_lin", "dare_linear", {"rescale": False}, {"density": [0.5, 0.3, 0.8]}, family=4, masks=True),
    Case("dare_ties", "dare_ties", {"rescale": False, "normalize": True}, {"density": [0.5, 0.3, 0.8]},
         family=4, masks=True),
    Case("dare_full", "dare_ties", {}, {"density": [1.0, 1.0, 1.0]}, family=4),
    Case("linear", "linear", {}, {}, family=5),
    Case("linear_base", "linear", {}, {}, family=5, base_weight=0.4),
    Case("linear_sum", "linear", {"normalize": False}, {}, family=5),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mergekit")
    tensors, runs, ours = {}, [], {}
    families = {}
    for seed in range(6):
        families[seed] = _family(seed, FAMILY_KINDS[seed])
        base, experts = families[seed]
        tensors[f"f{seed}.base"] = base
        for i, w in enumerate(experts):
            tensors[f"f{seed}.e{i}"] = w
    for case in CASES:
        base, experts = families[case.family]
        names = [f"f{case.family}.e{i}" for i in range(len(experts))]
        ours_experts = []
        for i, w in enumerate(experts):
            e = {"name": f"e{i}", "hash": f"{i:02d}", "weight": WEIGHTS[i], "delta": w - base}
            e.update({key: values[i] for key, values in case.expert_params.items()})
            ours_experts.append(e)
        run = {"kind": "merge", "id": case.cid, "method": case.method}
        if case.method == "linear":
            weights = ([case.base_weight] if case.base_weight else []) + WEIGHTS
            run.update(tensors=([f"f{case.family}.base"] if case.base_weight else []) + names,
                       base_index=None, parameters={**case.params, "weight": weights})
            ours_params = {**case.ours_params, "base_weight": case.base_weight}
        else:
            run.update(tensors=[f"f{case.family}.base"] + names, base_index=0,
                       parameters={**case.params, "weight": WEIGHTS, **case.expert_params})
            ours_params = case.ours_params
        if case.masks:
            run["masks"] = []
            for i, e in enumerate(ours_experts):
                mask = dare_mask(base.shape, e["density"], block_rng(0, e["hash"], "w", 0))
                tensors[f"{case.cid}.mask{i}"] = mask.float()
                run["masks"].append(f"{case.cid}.mask{i}")
            boundaries = []  # one block: DARE's masks follow the block layout
        else:
            boundaries = case.boundaries
        runs.append(run)
        ours[case.cid] = run_method(case.method, ours_params, base, ours_experts,
                                    boundaries=boundaries, tensor="w")
    # sparsifiers on their own, on tie-heavy deltas
    base, experts = families[2]
    for i, w in enumerate(experts):
        for density in (0.0005, 0.3, 0.5):
            runs.append({"kind": "magnitude", "id": f"mag{i}_{density}", "tensor": f"f2.e{i}_delta",
                         "parameters": {"density": density}})
        runs.append({"kind": "magnitude_outliers", "id": f"out{i}", "tensor": f"f2.e{i}_delta",
                     "parameters": {"density": 0.4, "gamma": 0.05}})
        tensors[f"f2.e{i}_delta"] = w - base
    # slerp, both branches
    g = torch.Generator().manual_seed(9)
    s_base = torch.randn(40, 24, generator=g).to(torch.bfloat16).float()
    s_far = torch.randn(40, 24, generator=g).to(torch.bfloat16).float()
    s_near = (s_base + torch.randn(40, 24, generator=g) * 1e-3).to(torch.bfloat16).float()
    tensors.update({"s.base": s_base, "s.far": s_far, "s.near": s_near})
    for name in ("far", "near"):
        for t in (0.3, 0.85):
            runs.append({"kind": "merge", "id": f"slerp_{name}_{t}", "method": "slerp",
                         "tensors": ["s.base", f"s.{name}"], "base_index": 0, "parameters": {"t": t}})
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "in.safetensors")
    (tmp / "runs.json").write_text(json.dumps(runs))
    (tmp / "ref.py").write_text(SCRIPT)
    proc = subprocess.run([str(MERGEKIT_PYTHON), str(tmp / "ref.py"), str(tmp / "in.safetensors"),
                           str(tmp / "runs.json"), str(tmp / "out.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"theirs": load_file(tmp / "out.safetensors"), "ours": ours, "families": families,
            "slerp": (s_base, s_far, s_near), "stdout": proc.stdout,
            "masks": {c.cid: [tensors[m] for m in r["masks"]] for c, r in zip(CASES, runs) if r.get("masks")}}


def _threshold_mask(case: Case, base, experts) -> torch.Tensor:
    """Elements where some expert's |delta| equals a magnitude threshold of its own."""
    at = torch.zeros_like(base, dtype=torch.bool)
    n = base.numel()
    for i, w in enumerate(experts):
        magnitudes = (w - base).abs()
        density = case.expert_params["density"][i]
        ranks = []
        if case.method.startswith("breadcrumbs"):
            gamma = case.expert_params["gamma"][i]
            target, n_top = int(density * n), int(gamma * n)
            n_bot = max(0, n - target - n_top)
            ranks = [n - n_bot - target, n - n_bot]
        else:
            ranks = [magnitude_rank(density, n) or 0]
        for r in ranks:
            if 0 < r < n:
                value = magnitudes.reshape(-1).kthvalue(n - r + 1).values
                at |= magnitudes == value
    return at


def _sign_terms(case: Case, base, experts, masks) -> list[torch.Tensor]:
    """w_k * trimmed delta_k: the terms of the case's TIES sign election."""
    terms = []
    for i, w in enumerate(experts):
        delta, n = w - base, base.numel()
        density = case.expert_params.get("density", [1.0] * len(experts))[i]
        if case.method == "ties":
            keep = top_rank_reference(delta, magnitude_rank(density, n) or 0)
        elif case.method == "breadcrumbs_ties":
            target, n_top = int(density * n), int(case.expert_params["gamma"][i] * n)
            keep = top_rank_reference(delta, min(n, n_top + target)) & ~top_rank_reference(delta, n_top)
        else:  # dare_ties: its drop masks, or nothing dropped
            keep = masks[i].bool() if masks else torch.ones_like(delta, dtype=torch.bool)
        terms.append(delta * keep * torch.tensor(WEIGHTS[i], dtype=torch.float32))
    return terms


@pytest.mark.parametrize("case", CASES, ids=[c.cid for c in CASES])
def test_merge_matches_mergekit(reference, case):
    theirs, ours = reference["theirs"][case.cid], reference["ours"][case.cid]
    assert theirs.shape == ours.shape
    base, experts = reference["families"][case.family]
    compare = torch.ones_like(ours, dtype=torch.bool)
    if case.thresholds:
        compare = ~_threshold_mask(case, base, experts)
        assert compare.float().mean() > 0.2, "too few elements off the thresholds to compare"
    lam = case.params.get("lambda", 1.0)
    divisor = (case.base_weight + sum(WEIGHTS)) if case.method == "linear" and case.params.get("normalize", True) \
        else 1.0
    scale = merge_scale(base, experts, WEIGHTS, lam=lam, divisor=divisor)
    knife = None
    if case.method in ("ties", "breadcrumbs_ties", "dare_ties"):
        knife = knife_edges(_sign_terms(case, base, experts, reference["masks"].get(case.cid)))[compare]
    verdict = judge(ours[compare], theirs[compare], scale=scale[compare], knife=knife)
    assert verdict.misses == 0, str(verdict)


def test_magnitude_sparsify_keeps_exactly_k_like_mergekit(reference):
    theirs = reference["theirs"]
    base, experts = reference["families"][2]
    for i, w in enumerate(experts):
        delta = w - base
        n = delta.numel()
        for density in (0.0005, 0.3, 0.5):
            k = magnitude_rank(density, n)
            kept_theirs = theirs[f"mag{i}_{density}"] != 0
            ours = top_rank_reference(delta, k)  # what blockwise TIES keeps (tested in test_methods)
            assert int(kept_theirs.sum()) == k == int(ours.sum())
            threshold = delta.abs().reshape(-1).kthvalue(n - k + 1).values
            off = delta.abs() != threshold
            assert torch.equal(kept_theirs[off], ours[off])
        band_theirs = theirs[f"out{i}"] != 0
        target, n_top = int(0.4 * n), int(0.05 * n)
        ours = top_rank_reference(delta, n_top + target) & ~top_rank_reference(delta, n_top)
        assert int(band_theirs.sum()) == target == int(ours.sum())
        lo = delta.abs().reshape(-1).kthvalue(n - (n_top + target) + 1).values
        hi = delta.abs().reshape(-1).kthvalue(n - n_top + 1).values
        off = (delta.abs() != lo) & (delta.abs() != hi)
        assert torch.equal(band_theirs[off], ours[off])


@pytest.mark.parametrize("name", ["far", "near"])
@pytest.mark.parametrize("t", [0.3, 0.85])
def test_slerp_matches_mergekit(reference, name, t):
    base, far, near = reference["slerp"]
    other = far if name == "far" else near
    theirs = reference["theirs"][f"slerp_{name}_{t}"]
    expert = {"name": "e", "hash": "00", "weight": 1.0, "delta": other - base}
    whole = run_method("slerp", {"t": t}, base, [expert], cosine=False)  # angle computed as mergekit
    assert torch.equal(whole, theirs) if name == "far" else int(ulp_distance(whole, theirs).max()) <= 1
    # blockwise, with the cosine the engine would give from fp64 whole-tensor sums
    b64, o64 = base.double(), other.double()
    cos = cosine_from_sums(float((b64 * b64).sum()), float((o64 * o64).sum()), float((b64 * o64).sum()))
    blocks = []
    for r0, r1 in [(0, 7), (7, 33), (33, 40)]:
        from mergepipe.methods import get_method
        from mergepipe.methods.base import BlockInputs, ExpertBlock
        eb = ExpertBlock("e", "00", 1.0, (other - base)[r0:r1], cosine=cos)
        blocks.append(get_method("slerp").fn(
            BlockInputs("w", r0, r1, tuple(base.shape), base[r0:r1], (eb,)), get_method("slerp").params(t=t)))
    blockwise = torch.cat(blocks)
    assert int(ulp_distance(blockwise, theirs).max()) <= 2


def test_reference_is_mergekit_0_1_5():
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", "import importlib.metadata as m, torch;"
                           "print(m.version('mergekit'), torch.__version__)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[0] == "0.1.5", proc.stdout + proc.stderr
    assert sys.version_info >= (3, 11)
