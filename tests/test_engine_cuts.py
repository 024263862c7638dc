"""engine/cuts.py: a block's RankCut from the delta index's per-tensor cuts."""
import random
from types import SimpleNamespace

import pytest

from mergepipe.engine.cuts import TensorCuts
from mergepipe.errors import MethodError
from mergepipe.methods.base import RankCut


def _tensor(order):
    # ranks 10, 20, ..., 500 of a 1000-element tensor in 2 blocks; rank 250's cut splits a run
    ranks = [10 * (i + 1) for i in range(50)]
    rows = [(r, 1.0 / r, r - 1, 3) for r in ranks]
    order(rows)
    j_split = next(j for j, row in enumerate(rows) if row[0] == 250)
    return SimpleNamespace(name="t", numel=1000, ranks=tuple(r[0] for r in rows), values=tuple(r[1] for r in rows),
                           count_gt=tuple(r[2] for r in rows), count_eq=tuple(r[3] for r in rows),
                           block_eq={j_split: (1, 2)})


@pytest.mark.parametrize("order", [lambda rows: None, random.Random(0).shuffle, lambda rows: rows.reverse()],
                         ids=["ascending", "shuffled", "descending"])
def test_every_stored_rank_is_found_in_any_order(order):
    cuts = TensorCuts(_tensor(order), "e")
    for block in (0, 1):
        cut = cuts.for_block(block, 500)
        for r in range(10, 501, 10):
            # one equal element kept (r - count_gt): all 3 or none elsewhere (none here), the
            # split run's first one in block 0
            want = (1, True) if block == 0 else (0, False)
            assert cut(r) == RankCut(r, 1.0 / r, *(want if r == 250 else (0, True))), (r, block)
    with pytest.raises(MethodError, match="no exact threshold for rank 15"):
        cuts.for_block(0, 500)(15)
