"""The plan's side of sketched reads (strategy `sketch`, index/sketch.py): what the strategy
knows about each candidate's sketch, and what the plan records of the blocks it sketched.

A sketched block costs sketch_cost(n) budget bytes (its codes and scale) and leaves out
e_k * ||delta_kb - alpha code||, which the certified bound counts in place of the whole
block's e_k * ||delta_kb||. The plan's `strategy.sketch` is {artifacts: expert -> blake3 of
its sketch header, blocks: expert -> tensor -> [block, ...]}; `bytes` gets
`planned_sketch_bytes` and `sketch_by_expert`, and the budget covers both kinds of reads.
"""
from __future__ import annotations

import math

from mergepipe.checkpoint.safetensors import ITEMSIZE
from mergepipe.errors import ConfigError
from mergepipe.index.sketch import Sketch, residual_sq, sketch_cost
from mergepipe.methods import get_method
from mergepipe.methods.registry import every_method
from mergepipe.plan.strategies.registry import Candidate


def sketch_context(items: list[Candidate], sketches: dict[str, Sketch], dtypes: dict[str, str]
                   ) -> dict[tuple[str, str, int], tuple[float, int]]:
    """(expert, tensor, block) -> (residual energy, sketch bytes) for every candidate with a sketch.
    `dtypes`: tensor -> its dtype (for the block's element count)."""
    out = {}
    for it in items:
        sk = sketches[it.expert]
        if sk.has(it.tensor, it.block):
            alpha, s1, nnz = sk.stats(it.tensor, it.block)
            n = it.cost // ITEMSIZE[dtypes[it.tensor]]
            out[(it.expert, it.tensor, it.block)] = (residual_sq(it.l2, alpha, s1, nnz), sketch_cost(n))
    return out


def check_method(method: str, strategy: str) -> None:
    """A sketched strategy needs a method a sketch can stand in for (Method.sketchable)."""
    if not get_method(method).sketchable:
        names = ", ".join(m.name for m in every_method() if m.sketchable)
        raise ConfigError(f"plan: strategy {strategy!r} feeds sketched deltas to the method; method {method!r} "
                          f"does not merge per-element deltas (use one of {names}, or another strategy)")


def residual_score(it: Candidate, r2: float) -> float:
    """e_k * ||delta - sketch|| (the candidate's score is e_k * ||delta||)."""
    return it.score * math.sqrt(r2) / it.l2 if it.l2 > 0 else 0.0


def check_sketch_blocks(blocks: dict[str, dict[str, list[int]]], names: list[str], expert_indexes: dict,
                        deltas: dict | None, where: str) -> dict[str, int]:
    """Sketch bytes per expert of `names`, recomputed from the plan's sketched blocks (its
    strategy.sketch.blocks) and the indexes; every sketched block inside its tensor and (with
    the deltas) not identical to the base."""
    from mergepipe.checkpoint.blocks import row_bytes
    out = {}
    for name in names:
        total = 0
        for tensor, bs in blocks.get(name, {}).items():
            entry = expert_indexes[name].tensors.get(tensor)
            if entry is None:
                raise ConfigError(f"{where}: plan key strategy.sketch.blocks.{name}.{tensor}: the model has no "
                                  f"tensor {tensor!r}")
            row = row_bytes(entry.shape, ITEMSIZE[entry.dtype]) // ITEMSIZE[entry.dtype]
            # one delta entry per tensor: a columnar index builds an entry at each lookup
            identical = deltas[name].tensors[tensor].identical if deltas is not None else None
            for b in bs:
                if not 0 <= b < len(entry.ranges):
                    raise ConfigError(f"{where}: plan key strategy.sketch.blocks.{name}.{tensor}: block {b} is "
                                      f"outside tensor {tensor!r} ({len(entry.ranges)} blocks)")
                if identical is not None and identical[b]:
                    raise ConfigError(f"{where}: plan key strategy.sketch.blocks.{name}.{tensor}: block {b} is "
                                      "identical to the base; a plan never sketches it")
                r0, r1 = entry.ranges[b]
                total += sketch_cost((r1 - r0) * row)
        out[name] = total
    return out
