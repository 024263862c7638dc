"""Contract and property tests for every registered merge method (no index needed:
rank cuts come from tests/helpers/cuts.py)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from tests.helpers.cuts import bits, cuts_for, run_method, top_rank_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import mergepipe.methods
from mergepipe.errors import MethodError
from mergepipe.methods import METHODS, get_method
from mergepipe.methods._common import (
    breadcrumbs_ranks,
    dare_mask,
    magnitude_rank,
    top_rank_mask,
)
from mergepipe.methods.base import BlockInputs, ExpertBlock, RankCut, block_rng
from mergepipe.methods.slerp import cosine_from_sums, whole_tensor_cosine

HYPOTHESIS = settings(max_examples=25, deadline=None)  # derandomized by the "ci" profile in conftest

# (method, params, per-expert extras, number of experts): the cases every
# contract runs on; each registered method needs at least one.
CASES = [
    ("linear", {}, {}, 3),
    ("linear", {"base_weight": 0.5}, {}, 2),
    ("linear", {"normalize": False}, {}, 2),
    ("task_arithmetic", {"lambda": 0.7}, {}, 3),
    ("task_arithmetic", {"normalize": True}, {}, 5),
    ("ties", {}, {"density": 0.4}, 3),
    ("ties", {"lambda": 0.8, "normalize": False}, {"density": 0.25}, 3),
    ("ties", {}, {"density": 0.5}, 5),  # five terms: torch's sum(0) would reorder them by shape
    ("dare_linear", {}, {"density": 0.5}, 3),
    ("dare_ties", {"normalize": True}, {"density": 0.3}, 3),
    ("breadcrumbs", {}, {"density": 0.5, "gamma": 0.1}, 3),
    ("breadcrumbs_ties", {"lambda": 1.5}, {"density": 0.6, "gamma": 0.05}, 3),
    ("slerp", {"t": 0.3}, {}, 1),
    ("passthrough", {}, {}, 1),
    ("passthrough", {"scale": 0.6}, {}, 1),
    ("nearswap", {"t": 0.05}, {}, 1),
    ("ram", {}, {}, 3),
    ("ram", {"epsilon": 0.05}, {}, 5),
    ("ramplus_tl", {"epsilon": 0.05, "r": 0.5, "alpha": 0.9}, {}, 3),
    ("nuslerp", {}, {}, 2),
    ("nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True, "base_weight": 0.7}, {}, 1),
    ("della", {"rescale_mode": "keep_probability"}, {"density": 0.5}, 3),
    ("della", {"rescale_mode": "l1", "lambda": 0.9}, {"density": 0.6}, 3),
    ("della_linear", {"epsilon": 0.1, "normalize": True}, {"density": 0.4}, 3),
    ("nuslerp", {"nuslerp_flatten": False}, {}, 2),
    ("nuslerp", {"nuslerp_flatten": False, "base_weight": 0.4}, {}, 1),
    ("model_stock", {}, {}, 3),
    ("model_stock", {"filter_wise": True}, {}, 2),
    ("karcher", {}, {}, 3),
    ("karcher", {"max_iter": 3, "tol": 1e-3, "include_base": False}, {}, 2),
    ("multislerp", {}, {}, 3),
    ("multislerp", {"normalize_weights": False, "eps": 1e-6}, {}, 2),
    ("sce", {}, {}, 3),
    ("sce", {"select_topk": 0.4}, {}, 3),
    ("arcee_fusion", {}, {}, 1),
]
CASE_IDS = [f"{m}-{i}" for i, (m, *_) in enumerate(CASES)]
# Output equals the base when no expert changes anything (not true of
# unnormalized linear: it returns (sum of weights) * W0).
IDENTITY_CASES = [c for c in CASES if not (c[0] == "linear" and c[1].get("normalize") is False)
                  and not (METHODS[c[0]].rewrites_base  # the method declares it: passthrough's scale, ...
                           and METHODS[c[0]].rewrites_base(METHODS[c[0]].params.model_validate(c[1])))]
RANDOM = {"dare_linear", "dare_ties", "della", "della_linear"}


def family(shape: tuple[int, ...], k: int, extras: dict, *, seed: int = 0,
           ties: bool = False) -> tuple[torch.Tensor, list[dict]]:
    """A base and k experts; ties=True draws deltas from few values (bf16-like duplicates)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    experts = []
    for i in range(k):
        if ties:
            delta = torch.randint(-6, 7, shape, generator=g).to(torch.float32) * 0.125
        else:
            delta = torch.randn(shape, generator=g) * 0.1
        experts.append({"name": f"e{i}", "hash": f"{i:02d}" + "ab" * 31, "weight": [0.5, 1.0, 0.3, 0.8][i % 4],
                        "delta": delta, **extras})
    return base, experts


def test_every_method_has_a_case_and_a_module():
    modules = {m.name for m in pkgutil.iter_modules(mergepipe.methods.__path__)
               if not m.name.startswith("_") and m.name not in ("base", "registry", "joint")}
    assert modules == set(METHODS)
    assert {c[0] for c in CASES} == set(METHODS)
    for name, method in METHODS.items():
        assert importlib.import_module(f"mergepipe.methods.{name}").merge is method.fn
        assert method.params.__name__ == "".join(w.capitalize() for w in name.split("_")) + "Params"
        assert any(year in method.paper for year in ("19", "20")), name


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_shape_dtype_and_inputs_untouched(case):
    method, params, extras, k = case
    base, experts = family((9, 16), k, extras)
    before = [base.clone()] + [e["delta"].clone() for e in experts]
    out = run_method(method, params, base, experts, boundaries=[4])
    assert out.shape == base.shape and out.dtype == torch.float32
    after = [base] + [e["delta"] for e in experts]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, after))
    assert torch.isfinite(out).all()
    assert not torch.equal(out, base)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("shape", [(7,), (), (5, 3, 4)], ids=["1d", "0d", "3d"])
def test_other_ranks_of_tensor(case, shape):
    method, params, extras, k = case
    base, experts = family(shape, k, extras, seed=3)
    out = run_method(method, params, base, experts)
    assert out.shape == base.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_same_inputs_same_bits(case):
    method, params, extras, k = case
    base, experts = family((12, 24), k, extras, seed=1)
    a = run_method(method, params, base, experts, boundaries=[5], seed=7)
    b = run_method(method, params, base, experts, boundaries=[5], seed=7)
    assert torch.equal(bits(a), bits(b))
    if method in RANDOM:
        c = run_method(method, params, base, experts, boundaries=[5], seed=8)
        assert not torch.equal(a, c), "the seed must change DARE's masks"


@pytest.mark.parametrize("case", IDENTITY_CASES, ids=[f"{c[0]}" for c in IDENTITY_CASES])
@pytest.mark.parametrize("kind", ["none", "zero"])
def test_identical_inputs_return_base(case, kind):
    method, params, extras, k = case
    base, experts = family((8, 16), k, extras, seed=2)
    for e in experts:
        e["delta"] = None if kind == "none" else torch.zeros_like(base)
    out = run_method(method, params, base, experts, boundaries=[3])
    assert torch.equal(bits(out), bits(base))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] not in RANDOM],
                         ids=[i for c, i in zip(CASES, CASE_IDS) if c[0] not in RANDOM])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "duplicated"])
def test_blockwise_equals_whole_tensor(case, ties):
    method, params, extras, k = case
    base, experts = family((23, 40), k, extras, seed=4, ties=ties)
    whole = run_method(method, params, base, experts, cosine=True)
    for boundaries in ([1], [5, 6, 17], list(range(1, 23))):
        blockwise = run_method(method, params, base, experts, boundaries=boundaries)
        assert torch.equal(bits(whole), bits(blockwise)), boundaries


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_block_mask_depends_only_on_its_key(method):
    """DARE's masks follow the block layout: each block draws from
    block_rng(seed, expert hash, tensor, row_start) and from nothing else."""
    base = torch.zeros(10, 8)
    delta = torch.ones(10, 8)
    expert = {"name": "e", "hash": "ff" * 32, "weight": 1.0, "delta": delta, "density": 0.5}
    out = run_method(method, {}, base, [expert], boundaries=[4], seed=3, tensor="t")
    for r0, r1 in [(0, 4), (4, 10)]:
        mask = dare_mask((r1 - r0, 8), 0.5, block_rng(3, "ff" * 32, "t", r0))
        assert torch.equal(out[r0:r1], mask.float() / 0.5)
    # an unread neighbour block does not move this block's mask
    partial = run_method(method, {}, base, [expert], boundaries=[4], seed=3, tensor="t",
                         omit={("e", 0)})
    assert torch.equal(partial[4:], out[4:]) and torch.equal(partial[:4], base[:4])


def test_omitted_block_contributes_nothing():
    base, experts = family((10, 8), 2, {"density": 0.5})
    full = run_method("ties", {}, base, experts, boundaries=[5])
    partial = run_method("ties", {}, base, experts, boundaries=[5], omit={("e0", 0)})
    only_e1 = run_method("ties", {}, base, [experts[1]], boundaries=[5])
    assert torch.equal(partial[5:], full[5:])
    assert torch.equal(partial[:5], only_e1[:5])
    # without consensus the omitted expert's weight still divides (D = sum w_k)
    ta = run_method("task_arithmetic", {"normalize": True}, base, experts, boundaries=[5], omit={("e0", 0)})
    expected = base[:5] + (experts[1]["delta"][:5] * torch.tensor(1.0)) / torch.tensor(1.5)
    assert torch.allclose(ta[:5], expected, rtol=0, atol=1e-6)


# --- expert order ---------------------------------------------------------------------

@HYPOTHESIS
@given(case=st.sampled_from([c for c in CASES if c[3] > 1 and METHODS[c[0]].max_experts is None]),
       seed=st.integers(0, 2**16), permutation=st.permutations(range(4)), omit_first=st.booleans())
def test_expert_order_does_not_matter(case, seed, permutation, omit_first):
    method, params, extras, k = case
    k = 4
    base, experts = family((6, 10), k, extras, seed=seed, ties=seed % 2 == 0)
    omit = {("e0", 0)} if omit_first else set()
    a = run_method(method, params, base, experts, boundaries=[2], omit=omit, seed=seed)
    shuffled = [experts[i] for i in permutation]
    b = run_method(method, params, base, shuffled, boundaries=[2], omit=omit, seed=seed)
    assert torch.equal(bits(a), bits(b))


# --- magnitude pruning -----------------------------------------------------------------

def _kept_by_blocks(delta: torch.Tensor, rank: int, boundaries: list[int]) -> torch.Tensor:
    cuts = cuts_for(delta)
    n = delta.numel()
    edges = [0] + boundaries + [delta.shape[0]]
    parts = []
    for r0, r1 in zip(edges[:-1], edges[1:]):
        expert = ExpertBlock("e", "00", 1.0, delta[r0:r1], cut=cuts(r0, r1))
        parts.append(top_rank_mask(delta[r0:r1].abs(), expert, rank, n, "t"))
    return torch.cat(parts)


@HYPOTHESIS
@given(rows=st.integers(1, 40), cols=st.integers(1, 17), levels=st.integers(1, 5),
       density=st.floats(0.0, 1.0), data=st.data())
def test_pruning_keeps_exactly_k_with_many_ties(rows, cols, levels, density, data):
    """bf16-like deltas: few distinct |delta|, so most cuts split a run of equal values."""
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    delta = torch.randint(-levels, levels + 1, (rows, cols), generator=g).float() * 2.0**-7
    boundaries = sorted(data.draw(st.sets(st.integers(1, max(1, rows - 1)), max_size=4)))
    boundaries = [b for b in boundaries if 0 < b < rows]
    n = delta.numel()
    k = magnitude_rank(density, n)
    if k is None:
        return
    mask = _kept_by_blocks(delta, k, boundaries)
    assert int(mask.sum()) == k
    assert torch.equal(mask, top_rank_reference(delta, k))


def test_magnitude_rank_edges_match_mergekit():
    assert magnitude_rank(1.0, 10) is None
    assert magnitude_rank(1.5, 10) is None
    assert magnitude_rank(0.0, 10) == 0
    assert magnitude_rank(-0.1, 10) == 0
    assert magnitude_rank(0.05, 10) == 1  # int(0.5) == 0, mergekit keeps max(1, k)
    assert magnitude_rank(0.5, 0) == 0
    assert magnitude_rank(0.3, 10) == int(0.3 * 10)
    assert magnitude_rank(0.29, 100) == 28  # int(0.29 * 100) == 28 in float, as mergekit


def test_breadcrumbs_ranks_match_mergekit_index_arithmetic():
    def mergekit_band(density, gamma, n):  # descending ranks kept by magnitude_outliers
        target, n_top = int(density * n), int(gamma * n)
        n_bot = max(0, n - target - n_top)
        ascending = range(n_bot, n_bot + target)
        return {n - 1 - i for i in ascending}

    for n in (1, 7, 100, 1000):
        for density in (0.0, 0.001, 0.1, 0.5, 0.9, 0.99, 0.995):
            for gamma in (0.0, 0.001, 0.01, 0.05, 0.2):
                r_hi, r_lo = breadcrumbs_ranks(density, gamma, n)
                assert set(range(r_hi, r_lo)) == mergekit_band(density, gamma, n), (n, density, gamma)
    assert breadcrumbs_ranks(1.0, 0.3, 10) is None  # density >= 1: untouched, gamma ignored
    assert breadcrumbs_ranks(0.5, 0.0, 10) == (0, 5)  # n_top == 0 drops nothing
    assert breadcrumbs_ranks(0.9, 0.2, 10) == (1, 10)  # fewer outliers dropped to keep 9


@HYPOTHESIS
@given(rows=st.integers(2, 30), density=st.floats(0.01, 0.99), gamma=st.floats(0.0, 0.3),
       data=st.data())
def test_breadcrumbs_band_is_exact_blockwise(rows, density, gamma, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    delta = torch.randint(-4, 5, (rows, 9), generator=g).float() * 0.5
    r_hi, r_lo = breadcrumbs_ranks(density, gamma, delta.numel())
    base = torch.zeros_like(delta)
    expert = {"name": "e", "hash": "11", "weight": 1.0, "delta": delta, "density": density, "gamma": gamma}
    boundaries = [b for b in data.draw(st.sets(st.integers(1, rows - 1), max_size=3))]
    out = run_method("breadcrumbs", {}, base, [expert], boundaries=boundaries)
    band = top_rank_reference(delta, r_lo) & ~top_rank_reference(delta, r_hi)
    assert int(band.sum()) == min(int(density * delta.numel()), delta.numel())
    assert torch.equal(out, delta * band)


def test_ties_k_zero_keeps_the_largest_and_density_zero_keeps_none():
    base = torch.zeros(4, 5)
    delta = torch.arange(20, dtype=torch.float32).reshape(4, 5) - 7
    e = {"name": "e", "hash": "1", "weight": 1.0, "delta": delta}
    out = run_method("ties", {}, base, [{**e, "density": 0.01}], boundaries=[2])
    assert int((out != 0).sum()) == 1 and out[3, 4] == 12
    out = run_method("ties", {}, base, [{**e, "density": 0.0}], boundaries=[2])
    assert torch.equal(out, base)


def test_magnitude_methods_need_cuts():
    block = BlockInputs("t", 0, 2, (4, 3), torch.zeros(2, 3),
                        (ExpertBlock("e", "1", 1.0, torch.ones(2, 3), density=0.5),))
    with pytest.raises(MethodError, match="rank cut"):
        get_method("ties").fn(block, get_method("ties").params())
    stale = ExpertBlock("e", "1", 1.0, torch.ones(2, 3), density=0.5, cut=lambda r: RankCut(r + 1, 1.0, 0))
    block = BlockInputs("t", 0, 2, (4, 3), torch.zeros(2, 3), (stale,))
    with pytest.raises(MethodError, match="stale"):
        get_method("breadcrumbs").fn(block, get_method("breadcrumbs").params())


# --- TIES sign election -----------------------------------------------------------------

def test_ties_sign_election_by_hand():
    base = torch.tensor([[10.0, 10.0, 10.0, 10.0]])
    d1 = torch.tensor([[1.0, -2.0, 3.0, 0.0]])
    d2 = torch.tensor([[-3.0, 1.0, 3.0, 0.0]])
    experts = [{"name": "a", "hash": "a", "weight": 1.0, "delta": d1},
               {"name": "b", "hash": "b", "weight": 1.0, "delta": d2}]
    out = run_method("ties", {}, base, experts)
    # elected signs: -, -, +, + (sum 0 -> +); agreeing entries averaged by their weight
    assert torch.equal(out, torch.tensor([[7.0, 8.0, 13.0, 10.0]]))
    out = run_method("ties", {"normalize": False, "lambda": 0.5}, base, experts)
    assert torch.equal(out, torch.tensor([[8.5, 9.0, 13.0, 10.0]]))


# --- DARE statistics ------------------------------------------------------------------------

@pytest.mark.parametrize("density", [0.1, 0.5, 0.9])
def test_dare_keep_rate_and_unbiased(density):
    n_rows, n_cols = 400, 500
    base = torch.zeros(n_rows, n_cols)
    delta = torch.full((n_rows, n_cols), 2.0)
    expert = {"name": "e", "hash": "aa", "weight": 1.0, "delta": delta, "density": density}
    out = run_method("dare_linear", {}, base, [expert], boundaries=[100, 250])
    n = delta.numel()
    kept = int((out != 0).sum())
    sigma = (n * density * (1 - density)) ** 0.5
    assert abs(kept - density * n) < 5 * sigma
    assert torch.allclose(out[out != 0], torch.tensor(2.0 / density))
    assert abs(out.mean().item() - 2.0) < 5 * 2.0 * ((1 - density) / density / n) ** 0.5
    # per element, across seeds: E[d] = delta
    small = torch.linspace(-1, 1, 32).reshape(4, 8)
    e2 = {"name": "e", "hash": "bb", "weight": 1.0, "delta": small, "density": density}
    mean = sum(run_method("dare_linear", {}, torch.zeros(4, 8), [e2], seed=s) for s in range(600)) / 600
    spread = small.abs() * ((1 - density) / density / 600) ** 0.5
    assert ((mean - small).abs() <= 5 * spread + 1e-6).all()


def test_dare_rescale_off_keeps_unscaled():
    delta = torch.ones(50, 20)
    e = {"name": "e", "hash": "cc", "weight": 1.0, "delta": delta, "density": 0.3}
    out = run_method("dare_ties", {"rescale": False}, torch.zeros(50, 20), [e])
    assert set(out.unique().tolist()) <= {0.0, 1.0}


# --- linear -------------------------------------------------------------------------------------

@HYPOTHESIS
@given(seed=st.integers(0, 2**16), power=st.integers(-6, 6), scale=st.floats(0.01, 100.0),
       base_weight=st.sampled_from([0.0, 0.25, 1.0]))
def test_normalized_linear_is_scale_invariant(seed, power, scale, base_weight):
    base, experts = family((5, 7), 3, {}, seed=seed)
    ref = run_method("linear", {"base_weight": base_weight}, base, experts)
    exact = [{**e, "weight": e["weight"] * 2.0**power} for e in experts]
    out = run_method("linear", {"base_weight": base_weight * 2.0**power}, base, exact)
    assert torch.equal(bits(out), bits(ref))  # a power of two scales exactly
    scaled = [{**e, "weight": e["weight"] * scale} for e in experts]
    out = run_method("linear", {"base_weight": base_weight * scale}, base, scaled)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_linear_by_hand_and_zero_weight_sum():
    base = torch.tensor([[1.0, 2.0]])
    experts = [{"name": "a", "hash": "a", "weight": 1.0, "delta": torch.tensor([[2.0, 2.0]])},
               {"name": "b", "hash": "b", "weight": 3.0, "delta": torch.tensor([[-2.0, 0.0]])}]
    assert torch.equal(run_method("linear", {}, base, experts), torch.tensor([[0.0, 2.5]]))
    assert torch.equal(run_method("linear", {"base_weight": 4.0}, base, experts),
                       torch.tensor([[0.5, 2.25]]))
    assert torch.equal(run_method("linear", {"normalize": False}, base, experts),
                       torch.tensor([[0.0, 10.0]]))
    negative = [{**experts[0], "weight": 1.0}, {**experts[1], "weight": -1.0}]
    with pytest.raises(MethodError, match="sum to 0"):
        run_method("linear", {}, base, negative)


# --- slerp -------------------------------------------------------------------------------------

def test_slerp_endpoints_and_branches():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 8, generator=g)
    far = torch.randn(6, 8, generator=g) - base  # roughly orthogonal: slerp branch
    e = {"name": "e", "hash": "1", "weight": 1.0, "delta": far}
    assert torch.equal(run_method("slerp", {"t": 0.0}, base, [e]), base)
    assert torch.allclose(run_method("slerp", {"t": 1.0}, base, [e]), base + far, atol=1e-6)
    mid = run_method("slerp", {"t": 0.5}, base, [e])
    cos = whole_tensor_cosine(base, base + far)
    assert abs(cos) < 0.9  # slerp branch: the midpoint keeps the norm's geometric blend
    assert not torch.allclose(mid, base + 0.5 * far, atol=1e-4)
    near = {"name": "e", "hash": "1", "weight": 1.0, "delta": base * 1e-4}  # lerp branch
    out = run_method("slerp", {"t": 0.25}, base, [near])
    assert torch.allclose(out, base + 0.25 * base * 1e-4, rtol=1e-6)
    # t defaults to the expert's weight
    assert torch.equal(run_method("slerp", {}, base, [{**e, "weight": 0.3}]),
                       run_method("slerp", {"t": 0.3}, base, [e]))


def test_slerp_cosine_from_sums_agrees_with_mergekit_arithmetic():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(64, 33, generator=g)
    expert = 0.6 * base + torch.randn(64, 33, generator=g)
    b64, e64 = base.double(), expert.double()
    from_sums = cosine_from_sums(float((b64 * b64).sum()), float((e64 * e64).sum()), float((b64 * e64).sum()))
    assert abs(from_sums - whole_tensor_cosine(base, expert)) < 1e-6
    assert cosine_from_sums(0.0, 4.0, 0.0) == 0.0
    assert cosine_from_sums(1.0, 1.0, 1.0000001) == 1.0


def test_slerp_needs_one_expert_and_a_cosine_for_partial_blocks():
    base, experts = family((6, 4), 2, {})
    with pytest.raises(MethodError, match="exactly one"):
        run_method("slerp", {"t": 0.5}, base, experts)
    with pytest.raises(MethodError, match="cosine"):
        run_method("slerp", {"t": 0.5}, base, experts[:1], boundaries=[3], cosine=False)
    assert get_method("slerp").max_experts == 1 and get_method("slerp").cosine


# --- params -------------------------------------------------------------------------------------

FIELDS = {
    "linear": {"normalize", "base_weight"},
    "task_arithmetic": {"lambda_", "normalize", "rescale", "int8_mask"},
    "ties": {"lambda_", "normalize", "density", "rescale", "int8_mask"},
    "dare_linear": {"lambda_", "normalize", "density", "rescale", "int8_mask"},
    "dare_ties": {"lambda_", "normalize", "density", "rescale", "int8_mask"},
    "breadcrumbs": {"lambda_", "normalize", "density", "gamma", "rescale", "int8_mask"},
    "breadcrumbs_ties": {"lambda_", "normalize", "density", "gamma", "rescale", "int8_mask"},
    "slerp": {"t"},
    "passthrough": {"scale"},
    "nearswap": {"t"},
    "ram": {"epsilon"},
    "ramplus_tl": {"r", "alpha", "epsilon"},
    "della": {"lambda_", "normalize", "density", "epsilon", "rescale", "rescale_mode", "int8_mask"},
    "della_linear": {"lambda_", "normalize", "density", "epsilon", "rescale", "rescale_mode", "int8_mask"},
    "nuslerp": {"nuslerp_row_wise", "nuslerp_flatten", "base_weight"},
    "model_stock": {"filter_wise"},
    "karcher": {"max_iter", "tol", "include_base"},
    "multislerp": {"normalize_weights", "eps"},
    "sce": {"select_topk", "int8_mask"},
    "arcee_fusion": set(),
}
DEFAULT_NORMALIZE = {"linear": True, "task_arithmetic": False, "ties": True, "dare_linear": False,
                     "dare_ties": False, "breadcrumbs": False, "breadcrumbs_ties": False,
                     "della": True, "della_linear": False}


def test_params_fields_and_mergekit_defaults():
    assert {name: set(m.params.model_fields) for name, m in METHODS.items()} == FIELDS
    for name, normalize in DEFAULT_NORMALIZE.items():
        p = METHODS[name].params()
        assert p.normalize is normalize, name
        if "lambda_" in FIELDS[name]:
            assert p.lambda_ == 1.0
            assert METHODS[name].params.model_validate({"lambda": 0.5}).lambda_ == 0.5
    assert METHODS["breadcrumbs"].params().gamma == 0.01
    assert METHODS["dare_ties"].params().rescale is True


@pytest.mark.parametrize("name,bad", [
    ("ties", {"densty": 0.3}), ("ties", {"density": 1.5}), ("ties", {"rescale": True}),
    ("breadcrumbs", {"gamma": -0.1}), ("breadcrumbs_ties", {"rescale": True}),
    ("linear", {"lambda": 2.0}), ("slerp", {"t": float("nan")}), ("task_arithmetic", {"lambda": "x"}),
])
def test_params_reject_bad_values(name, bad):
    with pytest.raises(ValidationError):
        METHODS[name].params.model_validate(bad)


# --- which ranks the index must store -----------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 200, 4099, 11779000, 322604500, 4096 * 4096])
def test_requested_ranks_cover_every_two_decimal_density_and_gamma(n):
    """The index stores cuts at requested_ranks(n); these are all the ranks that
    ties/breadcrumbs(_ties) ask for at two-decimal densities and gammas. (n = 200
    with density 0.01, gamma 0.28 asks for 58 = int(0.29*200) + 1; n = 11779000
    with density 0.35, gamma 0.29 for int(0.64*n) - 2.)"""
    from mergepipe.methods import requested_ranks

    stored = set(requested_ranks(n)) | {0, n}
    for i in range(101):
        density = i / 100
        k = magnitude_rank(density, n)
        assert k is None or k in stored
        for j in range(101):
            ranks = breadcrumbs_ranks(density, j / 100, n)
            assert ranks is None or set(ranks) <= stored, (density, j / 100, ranks)
