"""`calibrated`: greedy by importance-weighted update energy per byte.

Importance comes from the base model only, on calibration text the user names
(`plan: {strategy: calibrated, text: calib.txt}`): a factored diagonal Fisher
F_ij ~ rows_i * cols_j (mergepipe/calibrate/). A block's score is

    s_kb = |e_k| * sqrt(sum_{i in b} rows_i * sum_j cols_j * delta_kij^2)

(index/weighted.py), the square root of the second-order loss change its delta would
cause alone, so blocks compete by what they do to the base's predictions, not by raw
size: an embedding row of a token the text uses, a channel the activations load.
Candidates are taken by s/c descending (a vocabulary block as its plain-size block with the
same density would rank: registry.per_byte; ties: the energy order); blocks of tensors the
artifact does not cover come after every covered one, in the energy order. With
`vocabulary_share: x` the vocabulary tensors (embeddings, lm_head) get at most x of the
budget in a first pass, every other candidate the rest in the same order, and what is left
after both goes to any candidate in that order. With
`shares: weight | equal` each expert first gets its own share of the budget, as
`balanced` does, greedy by this score inside it.

At a budget of at least the full read every candidate is chosen, so the merge is the
plain one. Deterministic given the artifact, whose hash the plan records.
"""
from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from mergepipe.errors import ConfigError
from mergepipe.plan.strategies.balanced import select_balanced
from mergepipe.plan.strategies.registry import (STRATEGY_CONFIG, Candidate, PlanContext, Selection, StrategyInputs,
                                                greedy, per_byte, register)


class CalibratedParams(BaseModel):
    model_config = STRATEGY_CONFIG
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"vocabulary_share"})  # registry.normalized_options
    strategy: Literal["calibrated"] = "calibrated"
    text: str = Field(min_length=1, description="calibration text file (UTF-8), relative to params.yaml")
    max_tokens: int = Field(16384, ge=2, le=1 << 24, description="tokens of the text used, from its start")
    seq_len: int = Field(256, ge=2, le=1 << 16, description="tokens per calibration sequence")
    shares: Literal["none", "weight", "equal"] = "none"
    vocabulary_share: float | None = Field(
        None, gt=0, le=1,
        description="most of the budget the first pass may spend on vocabulary tensors (embeddings, "
                    "lm_head); what is left after it goes to any candidate (default: no cap; with "
                    "shares: none only)")

    @model_validator(mode="after")
    def _cap_without_shares(self) -> "CalibratedParams":
        if self.vocabulary_share is not None and self.shares != "none":
            raise ValueError("vocabulary_share needs shares: none")
        return self


def calibrated_order(cands: list[Candidate], ctx: PlanContext) -> list[int]:
    """Candidate indices by calibrated score per byte, descending; uncovered ones last (energy order)."""
    scores = ctx.block_scores or {}

    def key(i: int):
        c = cands[i]
        energy = scores.get((c.expert, c.tensor, c.block))
        if energy is None:
            return (1, 0.0, i)
        s = abs(ctx.effective.get(c.expert, 0.0)) * math.sqrt(energy)
        return (0, -per_byte(s, c.cost, ctx.block_scale.get(c.tensor, 1.0)), i)

    return sorted(range(len(cands)), key=key)


def calibration_inputs(request, cands: list[Candidate]) -> StrategyInputs:
    """The block scores of the request's calibration artifact (commands/calibration.py:
    {artifact, text, energies: expert -> tensor -> [per block]}); the plan records the
    artifact's and the text's blake3."""
    cal = request.calibration
    if cal is None:
        raise ConfigError("plan: strategy 'calibrated' needs a calibration artifact (mergepipe run makes it)")
    scores = {(name, t, b): v for name, per in cal["energies"].items()
              for t, vs in per.items() for b, v in enumerate(vs)}
    return StrategyInputs(block_scores=scores, recorded={"calibration": {k: cal[k] for k in ("artifact", "text")}})


@register("calibrated", params=CalibratedParams, calibrated=True, inputs=calibration_inputs)
def select(cands: list[Candidate], budget_bytes: int, ctx: PlanContext, p: CalibratedParams) -> Selection:
    """Greedy by base-Fisher-weighted update energy per byte (importance from calibration text)."""
    if ctx.block_scores is None:
        raise ValueError("strategy calibrated needs block scores from a calibration artifact")
    order = calibrated_order(cands, ctx)
    chosen = [False] * len(cands)
    if p.vocabulary_share is not None:
        # the Fisher ranks rows of frequent tokens far above dense blocks; at a mid budget that
        # bought embedding rows with attention blocks (EVAL.md): the cap keeps them to a share,
        # then leftovers go to any candidate, so a full budget still reads everything
        cap = math.floor(p.vocabulary_share * budget_bytes)
        vocab = [i for i in order if cands[i].tensor in ctx.vocabulary]
        used = greedy(cands, vocab, chosen, cap)
        used += greedy(cands, [i for i in order if cands[i].tensor not in ctx.vocabulary], chosen,
                       budget_bytes - used)
        greedy(cands, order, chosen, budget_bytes - used)  # leftovers: any candidate
        return Selection(chosen)
    if p.shares == "none":
        greedy(cands, order, chosen, budget_bytes)
        return Selection(chosen)
    reordered = [cands[i] for i in order]
    picked = select_balanced(reordered, budget_bytes, ctx, p.shares)
    for j, i in enumerate(order):
        chosen[i] = picked[j]
    return Selection(chosen)
