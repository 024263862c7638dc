"""rank_cut_mask (methods/_common.py): a block's share of a tensor's top-`rank` |delta|, in the
order (|delta| desc, flat index asc), whichever shortcut the cut allows."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.methods._common import rank_cut_mask
from mergepipe.methods.base import RankCut


def _by_order(magnitudes: torch.Tensor, value: float, eq_keep: int) -> torch.Tensor:
    """Keep |delta| > value, then the first eq_keep elements equal to it, one at a time."""
    flat, keep, seen = magnitudes.reshape(-1).tolist(), [], 0
    for m in flat:
        take = m > value or (m == value and seen < eq_keep)
        seen += m == value
        keep.append(take)
    return torch.tensor(keep).reshape(magnitudes.shape)


@given(st.integers(0, 1000), st.integers(1, 300), st.integers(0, 400))
def test_every_cut_keeps_the_first_equal_elements_in_flat_order(seed, n, eq_keep):
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.randint(0, 6, (n,), generator=g).float() / 4  # many equal values
    value = float(magnitudes[int(torch.randint(0, n, (1,), generator=g))])
    count = int((magnitudes == value).sum())
    want = _by_order(magnitudes, value, eq_keep)
    assert torch.equal(rank_cut_mask(magnitudes, RankCut(1, value, eq_keep)), want)
    # the index says whether this block keeps all its equal elements (engine/cuts.py): same mask
    assert torch.equal(rank_cut_mask(magnitudes, RankCut(1, value, eq_keep, eq_keep >= count)), want)


def test_a_cut_keeping_every_equal_element_neither_counts_nor_scans(monkeypatch):
    """eq_all: |delta| >= value, one comparison (no sum of the equal mask, no running count)."""
    magnitudes = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.25, 1.0]])
    monkeypatch.setattr(torch, "cumsum", None)
    monkeypatch.setattr(torch.Tensor, "sum", None)
    got = rank_cut_mask(magnitudes, RankCut(4, 0.25, 3, True))
    assert got.tolist() == [[True, True, True], [False, True, True]]
