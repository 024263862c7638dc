"""Reading a plan back as its typed record (plan/record.py PlanRecord): from a plan file, or
from the plan a manifest records. One path for every command that takes a plan: the
plan's hash must match its content, then every field is checked (`validate_plan`), and the
record dumps to the plan it was read from (`plan_json(load(...))` is the file's plan, so
the hash, the store and the manifest see the same bytes).

Every refusal is one line naming the file and the key.
"""
from __future__ import annotations

from pathlib import Path

from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.plan.record import (MadeFromRecord, PlanRecord, loads_plan, plan_hash, split_plan_file,
                                   validate_plan)


def read_plan_file(path: str | Path) -> tuple[PlanRecord, MadeFromRecord | None]:
    """The checked plan of a plan file and its `made_from` record (None: absent).

    Raises:
        ConfigError: the file cannot be read as JSON, its hash does not match its content, or
            a key is not a plan's (named).
    """
    from mergepipe.util.fs import read_json_object_text
    try:
        doc = loads_plan(read_json_object_text(path))  # a model file given as the plan is not read whole
        intact = isinstance(doc, dict) and doc.get("plan_hash") == plan_hash(doc)
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read plan: {e}") from None
    if not intact:  # hand-edited or truncated: its fields cannot be trusted
        raise ConfigError(f"{path}: plan_hash does not match the plan's content (edited, or not made by "
                          "`mergepipe plan`); make it again with `mergepipe plan`")
    plan, made_from = split_plan_file(doc, str(path))  # the plan as hashed, stored and put in the manifest
    # the hash has no key: an edit with a recomputed hash is checked field by field
    return validate_plan(plan, str(path)), made_from


def load_plan(path: str | Path) -> PlanRecord:
    """The checked plan of a plan file (read_plan_file without its made_from)."""
    return read_plan_file(path)[0]


def recorded_plan(man: dict, where: str) -> PlanRecord:
    """The plan a manifest records, its hash (the manifest's plan_hash too) and fields checked.

    Raises:
        IntegrityError: the recorded plan's hash does not match its content or the manifest's.
        ConfigError: a key is not a plan's (named).
    """
    plan = man.get("plan")
    if not isinstance(plan, dict) or plan.get("plan_hash") != plan_hash(plan) \
            or plan["plan_hash"] != man.get("plan_hash"):
        raise IntegrityError(f"{where}: plan_hash does not match the recorded plan")
    return validate_plan(plan, where)
