"""`nonfinite: allow`: every method merges an expert holding NaN or ±Inf without an exception;
arcee_fusion's quartiles sort non-finite importances as mergekit's torch.sort does."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.cuts import run_method
from tests.helpers.joint import run_joint

from mergepipe.methods import METHODS
from mergepipe.methods.arcee_fusion import importance_bits, key_value, order_keys

NEG_NAN = float(np.array([0xFFC00000], np.uint32).view(np.float32)[0])  # x86's inf - inf
NONFINITE = {"nan": float("nan"), "-nan": NEG_NAN, "inf": float("inf"), "-inf": float("-inf")}


# parameters a method needs, or that switch on its whole-tensor selection
PARAMS = {"slerp": {"t": 0.3}, "nearswap": {"t": 0.05}, "sce": {"select_topk": 0.4}, "breadcrumbs": {"gamma": 0.1},
          "breadcrumbs_ties": {"gamma": 0.1}}


def _family(method: str) -> tuple[torch.Tensor, list[dict]]:
    """A (9, 16) base and as many experts as the method takes (up to 3), densities 0.5 where it
    has them."""
    m = METHODS[method]
    extras = {"density": 0.5} if "density" in m.params.model_fields else {}
    g = torch.Generator().manual_seed(0)
    base = torch.randn(9, 16, generator=g)
    return base, [{"name": f"e{i}", "hash": f"{i:02d}" + "ab" * 31, "weight": [0.5, 1.0, 0.3][i],
                   "delta": torch.randn(9, 16, generator=g) * 0.1, **extras}
                  for i in range(min(3, m.max_experts or 3))]


def _poisoned(delta: torch.Tensor, value: float, rows: int) -> torch.Tensor:
    delta = delta.clone()
    delta[:rows, 5] = value
    return delta


@pytest.mark.parametrize("rows", [1, 3, 8], ids=["one", "a-third", "most"])
@pytest.mark.parametrize("value", list(NONFINITE.values()), ids=list(NONFINITE))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_merges_a_nonfinite_expert(method, value, rows):
    """One expert's column 5 non-finite in `rows` of 9 rows (a third or more puts a quartile of
    arcee_fusion's importance on a NaN): the merge runs and keeps shape and dtype."""
    base, experts = _family(method)
    experts[0]["delta"] = _poisoned(experts[0]["delta"], value, rows)
    with np.errstate(all="ignore"):
        out = run_method(method, PARAMS.get(method, {}), base, experts, boundaries=[4])
    assert out.shape == base.shape and out.dtype == torch.float32


def _sorted_reference(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """arcee_fusion by mergekit's definition on the whole tensor: quartiles from a sort that puts
    NaN last (numpy's, like torch.sort), threshold in fp32, theta = W0 + d * [importance >= t]."""
    importance = importance_bits(base.numpy(), delta.numpy(), tuple(base.shape)).view(np.float32)
    ordered = np.sort(importance)
    n = ordered.size
    q1, median, q3 = (ordered[int(np.float32(q) * np.float32(n - 1))] for q in (0.25, 0.5, 0.75))
    with np.errstate(all="ignore"):
        threshold = median + np.float32(1.5) * (q3 - q1)
        mask = (importance >= threshold).astype(np.float32)
    return base + delta * torch.from_numpy(mask).reshape(base.shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (NaN payloads may differ)."""
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]))


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
@pytest.mark.parametrize("value", list(NONFINITE.values()), ids=list(NONFINITE))
def test_arcee_fusion_nonfinite_matches_the_sorted_reference(value, rows):
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(9, 16, generator=g)
    delta = _poisoned(torch.randn(9, 16, generator=g) * 0.1, value, rows)
    out = run_joint("arcee_fusion", {}, base, [{"name": "e0", "hash": "00", "weight": 1.0, "delta": delta}],
                    boundaries=[4])
    assert _same(out, _sorted_reference(base, delta))


def test_arcee_fusion_finite_merge_is_unchanged_by_the_order_keys():
    """Finite, non-negative importances: the same quartiles as a plain sort (what the bit
    histogram gave before the keys)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(33, 40, generator=g)
    delta = torch.randn(33, 40, generator=g) * 0.05
    out = run_joint("arcee_fusion", {}, base, [{"name": "e0", "hash": "00", "weight": 1.0, "delta": delta}],
                    boundaries=[7, 20])
    assert torch.equal(out, _sorted_reference(base, delta))


def test_order_keys_sort_as_torch_sorts():
    """Every class of fp32 pattern: negatives, both zeros, subnormals, ±Inf, NaNs of either sign
    and any payload; sorting by key gives torch.sort's values, and a key maps back to its value."""
    rng = np.random.default_rng(0)
    patterns = np.concatenate([rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32),
                               np.array([0, 0x80000000, 1, 0x80000001, 0x7F800000, 0xFF800000, 0x7FC00000,
                                         0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x3F800000, 0xBF800000],
                                        np.uint32)])
    values = patterns.view(np.float32)
    keys = order_keys(patterns.view(np.int32))
    by_key = values[np.argsort(keys, kind="stable")]
    theirs = torch.sort(torch.from_numpy(values.copy()), stable=True).values.numpy()
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(by_key), nan)
    assert np.array_equal(by_key[~nan], theirs[~nan])  # -0.0 == 0.0 as torch compares them
    for key, v in zip(keys.tolist(), values.tolist()):
        back = key_value(key)
        assert (np.isnan(back) and np.isnan(v)) or back == v
