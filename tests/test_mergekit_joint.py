"""The joint-statistics methods (model_stock, karcher, multislerp) against mergekit 0.1.5.

mergekit runs in its own virtualenv (tests/helpers/equivalence.py) on whole tensors; ours run
block by block with the whole-tensor statistics computed over the same blocks
(tests/helpers/joint.py, as the engine does). Two checks per case:
- output in the base's dtype (bf16, what a merge writes by default): equal to mergekit's
  fp32 result rounded to bf16 by the rule of docs/design.md "Equivalence" (one ulp);
- fp32: within two fp32 roundings (max of one ulp and 2^-24 of the magnitudes summed into
  the element) of mergekit's own algorithm run in fp64. mergekit's fp32 result itself is
  only within ~4 of them (its norms and iterations are fp32 reductions), so an ulp check
  against it would test mergekit's rounding, not ours.
Experts get content hashes in config order, so both sum the experts in one order.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.equivalence import EPS32, INSTALL, MERGEKIT_PYTHON, judge, merge_scale, ulp
from tests.helpers.joint import run_joint

pytestmark = pytest.mark.skipif(
    not MERGEKIT_PYTHON.exists(),
    reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}")

SCRIPT = r'''
import json, sys, torch
from safetensors.torch import load_file, save_file
from mergekit.merge_methods.api import merge_tensors
inputs = load_file(sys.argv[1])
out = {}
for run in json.loads(open(sys.argv[2]).read()):
    if run["method"] == "fusion_threshold":  # arcee_fusion's threshold, exact below 1M elements
        from mergekit.merge_methods.arcee_fusion import DynamicThresholdFusion, _compute_importance
        importance = _compute_importance(inputs[run["tensors"][1]], inputs[run["tensors"][0]])
        out[run["id"]] = DynamicThresholdFusion().calculate_dynamic_threshold(importance).reshape(1)
        continue
    if run["method"] == "sce_mask":  # the selection alone (ties at the threshold: arbitrary subset)
        from mergekit.merge_methods.sce import sce_mask
        deltas = torch.stack([inputs[t] - inputs[run["tensors"][0]] for t in run["tensors"][1:]])
        out[run["id"]] = sce_mask(deltas, run["parameters"]["select_topk"], torch.float32).contiguous()
        continue
    for dtype in ("float32", "float64"):
        out[run["id"] + "." + dtype] = merge_tensors(
            [inputs[t] for t in run["tensors"]], run["method"], parameters=run["parameters"],
            base_index=run["base_index"], dtype=getattr(torch, dtype)).contiguous()
save_file(out, sys.argv[3])
'''

WEIGHTS = [0.6, 1.0, 0.35]


def _family(seed: int, shape: tuple[int, ...], k: int = 3, spread: float = 0.05, rounded: bool = True):
    """bf16-valued fp32 base and experts (exact fp32 deltas); `rounded=False`: fp32 experts."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g).to(torch.bfloat16).float()
    experts = [base + torch.randn(shape, generator=g) * spread for _ in range(k)]
    if rounded:
        experts = [w.to(torch.bfloat16).float() for w in experts]
    return base, experts


def _opposed(seed: int):
    """Two experts with opposite deltas: model_stock's denominator is exactly 0 (singular)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-64, 65, (24, 16), generator=g).float() * 2.0**-4
    d = torch.randint(-8, 9, (24, 16), generator=g).float() * 2.0**-8
    return base, [base + d, base - d]


FAMILIES = {
    "m": lambda: _family(0, (48, 64)),
    "v": lambda: _family(1, (96,)),  # 1-d: one block, one filter
    "c": lambda: _family(2, (12, 4, 16)),  # 3-d: filters along the last axis
    "two": lambda: _family(3, (40, 24), k=2, spread=0.2),
    "one": lambda: _family(4, (30, 8), k=1),
    "opp": lambda: _opposed(5),
    "f32": lambda: _family(6, (48, 64), rounded=False),  # fp32 deltas: no ties in sce's variance
    "c32": lambda: _family(7, (12, 4, 16), rounded=False),
}

# (id, method, params (ours = mergekit's unless noted), family, per-expert weights, include base)
CASES = [
    ("ms", "model_stock", {}, "m", False),
    ("ms_fw", "model_stock", {"filter_wise": True}, "m", False),
    ("ms_fw_1d", "model_stock", {"filter_wise": True}, "v", False),
    ("ms_fw_3d", "model_stock", {"filter_wise": True}, "c", False),
    ("ms_3d", "model_stock", {}, "c", False),
    ("ms_two", "model_stock", {}, "two", False),
    ("ms_singular", "model_stock", {}, "opp", False),
    ("k", "karcher", {}, "m", False),
    ("k_iter", "karcher", {"max_iter": 3, "tol": 1e-3}, "m", False),
    ("k_one_step", "karcher", {"max_iter": 1}, "two", False),
    ("k_1d", "karcher", {}, "v", False),
    ("msl", "multislerp", {}, "m", True),
    ("msl_raw", "multislerp", {"normalize_weights": False}, "m", True),
    ("msl_eps", "multislerp", {"eps": 1e-3}, "c", True),
    ("msl_two", "multislerp", {}, "two", True),
    ("msl_one", "multislerp", {}, "one", True),
    ("msl_opposed", "multislerp", {}, "opp", True),  # |mean| < eps: mergekit's linear fallback
    ("sce", "sce", {}, "m", False),
    ("sce_30", "sce", {"select_topk": 0.3}, "f32", False),
    ("sce_70", "sce", {"select_topk": 0.7}, "f32", False),
    ("sce_70_3d", "sce", {"select_topk": 0.7}, "c32", False),
    ("sce_none", "sce", {"select_topk": 0.0}, "f32", False),
]
# arcee_fusion (base + one expert): family ids
FUSION = ["m", "v", "c", "two"]
# sce's selection alone, on tie-heavy bf16 deltas: (id, family, select_topk)
SCE_MASKS = [("mask_m_30", "m", 0.3), ("mask_m_70", "m", 0.7), ("mask_two_50", "two", 0.5)]
BOUNDARIES = [5, 17, 30]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mergekit-joint")
    families = {name: make() for name, make in FAMILIES.items()}
    tensors, runs = {}, []
    for name, (base, experts) in families.items():
        tensors[f"{name}.base"] = base
        tensors.update({f"{name}.e{i}": w for i, w in enumerate(experts)})
    for cid, method, params, fam, weighted in CASES:
        k = len(families[fam][1])
        parameters = dict(params)
        if weighted:
            parameters["weight"] = WEIGHTS[:k]
        runs.append({"id": cid, "method": method, "parameters": parameters, "base_index": 0,
                     "tensors": [f"{fam}.base"] + [f"{fam}.e{i}" for i in range(k)]})
    for fam in FUSION:
        for kind in ("arcee_fusion", "fusion_threshold"):
            runs.append({"id": f"{kind}_{fam}", "method": kind, "parameters": {}, "base_index": 0,
                         "tensors": [f"{fam}.base", f"{fam}.e0"]})
    for cid, fam, topk in SCE_MASKS:
        k = len(families[fam][1])
        runs.append({"id": cid, "method": "sce_mask", "parameters": {"select_topk": topk},
                     "tensors": [f"{fam}.base"] + [f"{fam}.e{i}" for i in range(k)]})
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "in.safetensors")
    (tmp / "runs.json").write_text(json.dumps(runs))
    (tmp / "ref.py").write_text(SCRIPT)
    proc = subprocess.run([str(MERGEKIT_PYTHON), str(tmp / "ref.py"), str(tmp / "in.safetensors"),
                           str(tmp / "runs.json"), str(tmp / "out.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return families, load_file(tmp / "out.safetensors")


def _ours(case, families) -> torch.Tensor:
    cid, method, params, fam, weighted = case
    base, experts = families[fam]
    ours_experts = [{"name": f"e{i}", "hash": f"{i:02d}", "weight": WEIGHTS[i] if weighted else 1.0,
                     "delta": w - base} for i, w in enumerate(experts)]
    return run_joint(method, params, base, ours_experts, boundaries=BOUNDARIES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_joint_method_matches_mergekit(reference, case):
    families, theirs = reference
    base, experts = families[case[3]]
    ours = _ours(case, families)
    their32, exact = theirs[case[0] + ".float32"], theirs[case[0] + ".float64"]
    assert ours.shape == their32.shape
    scale = merge_scale(base, experts, [1.0] * len(experts))
    # in the base's dtype (bf16): the equivalence rule against mergekit's fp32 result
    verdict = judge(ours.to(torch.bfloat16), their32.to(torch.bfloat16), scale=scale)
    assert verdict.misses == 0, str(verdict)
    # fp32: within two fp32 roundings of mergekit's algorithm in fp64
    allowed = torch.maximum(ulp(exact, torch.float32), EPS32 * scale)
    worst = float(((ours.double() - exact.double()).abs() / allowed).max())
    theirs_worst = float(((their32.double() - exact.double()).abs() / allowed).max())
    assert worst <= 2.0, f"ours {worst:.3g} roundings from exact (mergekit fp32: {theirs_worst:.3g})"


def test_singular_model_stock_keeps_the_base(reference):
    families, theirs = reference
    base, _ = families["opp"]
    ours = _ours(next(c for c in CASES if c[0] == "ms_singular"), families)
    assert torch.equal(ours, base) and torch.equal(theirs["ms_singular.float32"], base)


@pytest.mark.parametrize(("cid", "fam", "topk"), SCE_MASKS, ids=[m[0] for m in SCE_MASKS])
def test_sce_selection_keeps_k_like_mergekit(reference, cid, fam, topk):
    """On bf16 deltas many variances tie at the threshold: mergekit's topk keeps an arbitrary
    subset of them, ours the first in flat order; both keep exactly k, and agree elsewhere."""
    import numpy as np

    from mergepipe.methods import get_method
    from mergepipe.methods.joint import JointExpert, TensorContext, in_memory_statistics
    from mergepipe.methods.sce import block_mask
    from tests.helpers.joint import split
    families, theirs = reference
    base, experts = families[fam]
    deltas = [(w - base).numpy() for w in experts]
    m = get_method("sce")
    p = m.params(select_topk=topk)
    ctx = TensorContext("w", tuple(base.shape), tuple(JointExpert(f"e{i}", f"{i:02d}", 1.0)
                                                      for i in range(len(experts))), p)
    ranges = split(base.shape[0], BOUNDARIES)
    stats = in_memory_statistics(m.joint, ctx, base.numpy(), deltas, ranges)
    ours = np.concatenate([block_mask(np.stack([d[r0:r1].reshape(-1) for d in deltas]), stats, r0)
                           for r0, r1 in ranges])
    mask = theirs[cid].reshape(-1).numpy()
    var = torch.var(torch.stack([torch.from_numpy(d) for d in deltas]), dim=0, unbiased=False).reshape(-1)
    k = int(stats[0])
    assert int(ours.sum()) == int(mask.sum()) == k > 0
    at_threshold = (var == float(np.int32(stats[1]).view(np.float32))).numpy()
    assert at_threshold.sum() > 1  # the case has ties
    assert np.array_equal(ours[~at_threshold], mask[~at_threshold])


def _fusion_statistics(base: torch.Tensor, delta: torch.Tensor):
    import numpy as np

    from mergepipe.methods import get_method
    from mergepipe.methods.joint import JointExpert, TensorContext, in_memory_statistics
    from tests.helpers.joint import split
    m = get_method("arcee_fusion")
    ranges = split(base.shape[0], BOUNDARIES) if base.dim() >= 2 else [(0, base.shape[0])]
    ctx = TensorContext("w", tuple(base.shape), (JointExpert("e0", "00", 1.0),), m.params())
    return np.asarray(in_memory_statistics(m.joint, ctx, base.numpy(), [delta.numpy()], ranges))


@pytest.mark.parametrize("fam", FUSION)
def test_arcee_fusion_matches_mergekit(reference, fam):
    """Same output except where an element's importance lies between the two thresholds (ours
    from an fp64 KL, mergekit's from fp32 softmaxes: they differ in the last bits), where
    either side of the mask is right; such elements are few."""
    from mergepipe.methods.arcee_fusion import importance_bits
    families, theirs = reference
    base, experts = families[fam]
    delta = experts[0] - base
    ours = run_joint("arcee_fusion", {}, base, [{"name": "e0", "hash": "00", "weight": 1.0, "delta": delta}],
                     boundaries=BOUNDARIES)
    ours_threshold = float(_fusion_statistics(base, delta)[0])
    their_threshold = float(theirs[f"fusion_threshold_{fam}"][0])
    assert abs(ours_threshold - their_threshold) <= 1e-3 * abs(their_threshold)
    rows = base.reshape(1, -1) if base.dim() < 2 else base.reshape(base.shape[0], -1)
    importance = torch.from_numpy(importance_bits(rows.numpy(), delta.reshape(rows.shape).numpy(),
                                                  tuple(base.shape)).view("float32").copy()).reshape(base.shape)
    lo, hi = sorted((ours_threshold, their_threshold))
    edge = (importance >= lo * (1 - 1e-3)) & (importance <= hi * (1 + 1e-3))
    assert int(edge.sum()) <= max(2, base.numel() // 100)
    verdict = judge(ours[~edge], theirs[f"arcee_fusion_{fam}.float32"][~edge],
                    scale=merge_scale(base, experts[:1], [1.0])[~edge])
    assert verdict.misses == 0, str(verdict)
    assert bool(((ours == base) | (ours == experts[0]))[~edge].all())


def test_arcee_fusion_quartiles_are_exact_order_statistics_above_a_million():
    """Where mergekit samples 1M elements with an unseeded RNG, ours are the exact order
    statistics at mergekit's indices int(fp32(q) * fp32(n - 1))."""
    import numpy as np

    from mergepipe.methods.arcee_fusion import importance_bits
    g = torch.Generator().manual_seed(11)
    base = torch.randn(1100, 1024, generator=g).to(torch.bfloat16).float()
    delta = (base + torch.randn(1100, 1024, generator=g) * 0.02).to(torch.bfloat16).float() - base
    stats = _fusion_statistics(base, delta)
    importance = np.sort(importance_bits(base.numpy(), delta.numpy(), tuple(base.shape)).view(np.float32))
    n = importance.size
    q = [importance[int(np.float32(x) * np.float32(n - 1))] for x in (0.25, 0.5, 0.75)]
    assert list(stats[1:]) == [float(v) for v in q]
    assert np.float32(stats[0]) == q[1] + np.float32(1.5) * (q[2] - q[0])
