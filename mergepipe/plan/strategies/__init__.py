"""Plan strategies, one per module behind a registry (`registry.py`), like the methods:
which (expert, block) pairs a budgeted merge reads and, optionally, how the read deltas
are rescaled. Importing this package registers all of them.

energy.py (greedy by |lambda w|*||delta||/byte; the default at full budget), balanced.py (a budget
share per expert), compensated.py (norm-matching rescale of what is read), calibrated.py (importance from
the base on calibration text), sketch.py (ternary sketches where a full read does not fit);
default.py picks the strategy of a params.yaml without `plan:`."""
from mergepipe.plan.strategies import balanced, calibrated, compensated, energy, sketch  # noqa: F401
from mergepipe.plan.strategies.registry import (  # noqa: F401
    DEFAULT_STRATEGY,
    STRATEGIES,
    Candidate,
    PlanContext,
    Selection,
    Strategy,
    StrategyInputs,
    get_strategy,
    normalized_options,
    strategy_options,
)
