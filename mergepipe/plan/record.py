"""The plan's one description: `PlanRecord`, what `planner.make_plan` builds and every reader
takes; `plan_json(record)` its canonical JSON form (what `plan -o` writes, `plan_hash`
covers and a manifest holds); and its checks as untrusted input.

`plan_hash` has no key, so a hand-edited plan with a recomputed hash is as easy to
make as a typo: `mergepipe merge`, `gather` and `verify --replay` re-validate a
plan completely before a byte of weights is read (plan/load.py reads it back).

1. `validate_plan(plan, where)`: the typed record: schema, method and its parameters
   (through the method registry's params model), per-expert density/gamma, output dtype
   and shard_bytes, block_bytes (and embedding_block_bytes) range, budget and byte counts,
   reads keyed by the plan's experts with sorted, distinct block numbers, the bound's
   numbers finite; and the record dumps back to `plan`, JSON types included.
2. `check_plan_reads(plan, base_index, expert_indexes, deltas, where)`: against
   the inputs' indexes: every (tensor, block) read lies inside its tensor, is a
   float tensor and differs from the base; the bytes of the planned reads,
   recomputed from the index, equal the plan's counts and fit in budget_bytes.

A plan file may also hold `made_from` (`split_plan_file`): the params bytes it was made
from, beside the plan and outside its hash.

Every failure is a ConfigError naming the plan file and the key.
"""
from __future__ import annotations

import json
import math
import sys
from itertools import chain
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

# The limits params.yaml enforces; a plan must not escape them.
from mergepipe.checkpoint.blocks import MAX_BLOCK_BYTES, MIN_BLOCK_BYTES, BlockLayout
from mergepipe.config.fields import MIN_SHARD_BYTES
from mergepipe.errors import ConfigError
from mergepipe.util.gcpause import paused_gc
from mergepipe.index.read_bytes import full_read_bytes, planned_bytes
from mergepipe.methods import get_method
from mergepipe.plan import tensor_params
from mergepipe.plan.strategies.registry import DEFAULT_STRATEGY
from mergepipe.util.canonical import canonical_blake3


_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
Hash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$")]
Count = Annotated[int, Field(strict=True, ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class PlanInputRecord(BaseModel):
    model_config = _STRICT
    name: Name
    path: Annotated[str, Field(min_length=1)]
    content_hash: Hash
    weight: float
    density: Annotated[float, Field(gt=0, le=1)] | None = None
    gamma: Annotated[float, Field(ge=0, lt=1)] | None = None


class BaseInputRecord(PlanInputRecord):
    """The base: also the non-weight files the output copies from it (config.json, ...) and
    their blake3 (commands/base_files.py), so the plan hash covers every byte the output takes."""

    files: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$")], Hash]


class TokenizerRecord(BaseModel):
    """output.tokenizer_source (commands/tokenizer_source.py): the folder and its files' blake3."""

    model_config = _STRICT
    path: Annotated[str, Field(min_length=1)]
    files: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$")], Hash]


class LayoutFileRecord(BaseModel):
    """One output weight file of output.layout (engine/layout.py): its name, how many tensors
    of the layout's order it holds, its data start modulo 4 KiB (null: right after its header)."""

    model_config = _STRICT
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")]
    tensors: Count
    data_start: Annotated[int, Field(strict=True, ge=0, lt=4096, multiple_of=8)] | None


class LayoutRecord(BaseModel):
    """output.layout, only where the base's file layout is not the canonical one; `order`
    (every tensor once, checked against the base by engine/layout.py) only where not name order."""

    model_config = _STRICT
    files: Annotated[list[LayoutFileRecord], Field(min_length=1)]
    order: list[StrictStr] | None = None


class AddedTokenRecord(BaseModel):
    """A token the output tokenizer gets, as tokenizer.json's `added_tokens` entry."""

    model_config = _STRICT
    id: Count
    content: StrictStr
    single_word: StrictBool
    lstrip: StrictBool
    rstrip: StrictBool
    normalized: StrictBool
    special: StrictBool


class VocabularyRecord(BaseModel):
    """output.vocabulary (commands/vocabulary.py): the output vocabulary's recipe, the tokenizer
    files it was made from, its tokens' count and rows, the tokens added, each filled token's
    rule ([id, token, rule]) and the digest of every model's row map (checkpoint/vocab_map.py)."""

    model_config = _STRICT
    source: Annotated[str, Field(min_length=1)]
    tokens: dict[StrictStr, dict]
    pad_to_multiple_of: Annotated[int, Field(strict=True, ge=1)] | None
    tokenizers: dict[StrictStr, dict[StrictStr, Hash]]
    size: Count
    rows: Count
    added: list[AddedTokenRecord]
    filled: list[Annotated[list[Count | StrictStr], Field(min_length=3, max_length=3)]]
    digest: Hash


class OutputRecord(BaseModel):
    model_config = _STRICT
    dtype: Literal["bfloat16", "float16", "float32"] | None
    shard_bytes: Annotated[int, Field(strict=True, ge=MIN_SHARD_BYTES)] | None
    tokenizer_source: TokenizerRecord | None = None
    layout: LayoutRecord | None = None
    vocabulary: VocabularyRecord | None = None
    chat_template: Annotated[StrictStr, Field(min_length=1)] | None = None  # output/chat_template.py


class BytesRecord(BaseModel):
    model_config = _STRICT
    total_expert_bytes: Count
    full_read_expert_bytes: Count
    planned_expert_bytes: Count
    planned_by_expert: dict[StrictStr, Count]
    skipped_identical_by_expert: dict[StrictStr, Count]
    candidate_pairs: Count
    planned_pairs: Count
    # strategy `sketch` only (plan/sketch_reads.py): sketch bytes, also within budget_bytes
    planned_sketch_bytes: Count | None = None
    sketch_by_expert: dict[StrictStr, Count] | None = None


class BoundRecord(BaseModel):
    model_config = _STRICT
    kind: Literal["certified", "heuristic"]
    omitted_mass: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    full_update_norm_estimate: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    relative: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class CalibrationRecord(BaseModel):
    """What a calibrated plan's importance came from: the artifact's and the text's blake3."""

    model_config = _STRICT
    artifact: Hash
    text: Hash


class SketchRecord(BaseModel):
    """The sketches a `sketch` plan reads: each expert's sketch header blake3, and its
    sketched blocks per tensor (sorted, distinct; never also in `reads`)."""

    model_config = _STRICT
    artifacts: dict[StrictStr, Hash]
    blocks: dict[StrictStr, dict[StrictStr, list[StrictInt]]]


class StrategyRecord(BaseModel):
    """Present only when the plan strategy is not the default (plan/strategies/)."""

    model_config = _STRICT
    name: StrictStr
    parameters: dict[StrictStr, object]
    scales: dict[StrictStr, dict[StrictStr, Annotated[float, Field(ge=1, allow_inf_nan=False)]]]
    calibration: CalibrationRecord | None = None  # only for a calibrated strategy
    sketch: SketchRecord | None = None  # only for a sketching strategy


class JointRecord(BaseModel):
    """Present exactly for a method with joint statistics (methods/joint.py)."""

    model_config = _STRICT
    reads: Literal["all-or-none"]
    key: Hash | None  # None when the parameters need no statistics


class PlanRecord(BaseModel):
    """The fields of a plan as `planner.make_plan` writes them; nothing else. `plan_json`
    dumps it to the plan's JSON; the properties below are what readers ask of it."""

    model_config = _STRICT
    schema_: Literal[1] = Field(alias="schema")
    mergepipe_version: StrictStr
    method: StrictStr
    parameters: dict[StrictStr, object]
    seed: Annotated[int, Field(strict=True, ge=0, lt=2**63)]
    budget: StrictStr
    budget_bytes: Count
    block_bytes: Annotated[int, Field(strict=True, ge=MIN_BLOCK_BYTES, le=MAX_BLOCK_BYTES)]
    # vocabulary tensors' block size (checkpoint/blocks.py::BlockLayout); absent = block_bytes
    embedding_block_bytes: Annotated[int, Field(strict=True, ge=MIN_BLOCK_BYTES, le=MAX_BLOCK_BYTES)] | None = None
    output: OutputRecord
    nonfinite: Literal["error", "allow"]
    base: BaseInputRecord
    experts: Annotated[list[PlanInputRecord], Field(min_length=1)]
    reads: dict[StrictStr, dict[StrictStr, list[StrictInt]]]
    bytes: BytesRecord
    bound: BoundRecord
    strategy: StrategyRecord | None = None
    joint: JointRecord | None = None  # joint methods only (plan/joint_reads.py)
    tensor_parameters: dict[StrictStr, object] | None = None  # checked by plan/tensor_params.py
    # expert -> blake3 of its exact cuts off the index's grid (commands/cuts.py checks them)
    cuts: dict[StrictStr, Hash] | None = None
    plan_hash: Hash

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.block_bytes, self.embedding_block_bytes)

    @property
    def expert_names(self) -> list[str]:
        """The experts' names in plan order (by content hash)."""
        return [e.name for e in self.experts]

    @property
    def strategy_name(self) -> str:
        return DEFAULT_STRATEGY if self.strategy is None else self.strategy.name

    @property
    def scales(self) -> dict[str, dict[str, float]]:
        """expert -> tensor -> rescale factor; empty unless a rescaling strategy set some."""
        return {} if self.strategy is None else self.strategy.scales

    @property
    def sketch(self) -> SketchRecord | None:
        return None if self.strategy is None else self.strategy.sketch

    @property
    def calibration(self) -> CalibrationRecord | None:
        return None if self.strategy is None else self.strategy.calibration

    def reads_of(self, expert: str) -> dict[str, list[int]]:
        """tensor -> the blocks the plan reads of `expert` in full (empty: none)."""
        return self.reads.get(expert, {})

    def group_of(self, tensor: str) -> int | None:
        """The tensor_parameters group `tensor` is merged with (None: the top-level values)."""
        return tensor_params.group_of(self.tensor_parameters, tensor)

    def view(self, group: int | None) -> tuple[dict, list[dict]]:
        """(parameters, expert entries as JSON) that `group` merges with (plan/tensor_params.py)."""
        return tensor_params.overlay(self.parameters, self.experts_json(), self.tensor_parameters, group)

    def experts_json(self) -> list[dict]:
        """The experts' entries as the plan's JSON has them (statistics keys, the manifest)."""
        return [e.model_dump(exclude_unset=True) for e in self.experts]


def plan_json(rec: PlanRecord) -> dict:
    """The plan's canonical JSON form: its set fields, by their JSON names (`schema`)."""
    out = rec.model_dump(by_alias=True, exclude_unset=True, exclude={"reads"})
    out["reads"] = rec.reads  # built by the planner or checked by validate_plan: pydantic would copy every list
    return out


def plan_hash(plan: dict) -> str:
    """Covers inputs' content hashes (and the base's copied non-weight files), method,
    parameters, budget, block size, version and the access set itself (everything but the
    hash field and a plan file's `made_from`: which bytes of params.yaml it came from)."""
    return canonical_blake3({k: v for k, v in plan.items() if k not in ("plan_hash", MADE_FROM)})


MADE_FROM = "made_from"  # a plan file's key beside the plan's: outside plan_hash


class MadeFromRecord(BaseModel):
    """What `mergepipe plan -o` made a plan file from: the blake3 of the params file's bytes.

    Kept beside the plan, not in it: the plan (and so its hash, the store and the manifest)
    is a function of the config's content, while this names the bytes, so `merge --params`
    can refuse a plan made from an earlier edit of the file (commands/made_from.py)."""

    model_config = _STRICT
    params: Hash
    budget: StrictStr | None = None  # `plan --budget`: the plan's budget is not the file's


def split_plan_file(doc: object, where: str) -> tuple[object, MadeFromRecord | None]:
    """A plan file's plan (without `made_from`) and its made_from record (None when absent)."""
    if not isinstance(doc, dict) or MADE_FROM not in doc:
        return doc, None
    plan = {k: v for k, v in doc.items() if k != MADE_FROM}
    try:
        return plan, MadeFromRecord.model_validate(doc[MADE_FROM])
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in (MADE_FROM, *err["loc"]))
        raise ConfigError(f"{where}: plan key {key}: {err['msg']}; make the plan again with `mergepipe plan`") from None


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err["loc"]).replace("schema_", "schema") or "plan"


def plan_object(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook for a plan file: the dict json would make (the last of a
    repeated key wins), with its keys interned (tensor names: one string with the checkpoint's,
    checkpoint/header_scan.py) and each one-block read list `[b]` one list shared by every
    tensor that reads block b (read only: 200k lists at 100k tensors and two experts)."""
    shared: dict[int, list] = {}
    out = {}
    for key, value in pairs:
        if type(value) is list and len(value) == 1 and type(value[0]) is int:
            value = shared.setdefault(value[0], value)
        out[sys.intern(key)] = value
    return out


def loads_plan(text: str):
    """json.loads(text, object_pairs_hook=plan_object)'s value, made from json.loads' own
    dicts in C-speed passes (the hook was a Python call per object, a step per key):
    keys interned, and equal read lists of ints one shared (read-only) list."""
    with paused_gc():  # 100k small lists, no cycles (util/gcpause.py)
        return _shared(json.loads(text), {})


def _shared(o, lists: dict):
    if type(o) is dict:
        values = list(o.values())
        kinds = set(map(type, values))
        if kinds == {list} and set(map(type, chain.from_iterable(values))) <= {int}:  # not bool, not float
            values = list(map(lists.setdefault, map(tuple, values), values))
        elif dict in kinds or list in kinds:  # the rare mixed dict: value by value
            values = [lists.setdefault(tuple(v), v) if type(v) is list and set(map(type, v)) <= {int}
                      else _shared(v, lists) for v in values]
        return dict(zip(map(sys.intern, o), values))
    if type(o) is list and not set(map(type, o)).isdisjoint((dict, list)):
        return [_shared(v, lists) for v in o]
    return o


def _reads_typed(reads: object) -> bool:
    """Whether `reads` is PlanRecord.reads' type (dict[str, dict[str, list[int]]], exact
    types as strict validation wants), checked in C-speed passes."""
    if type(reads) is not dict or not set(map(type, reads)) <= {str} or not set(map(type, reads.values())) <= {dict}:
        return False
    return all(set(map(type, per)) <= {str} and set(map(type, per.values())) <= {list}
               and set(map(type, chain.from_iterable(per.values()))) <= {int} for per in reads.values())


def validate_plan(plan: object, where: str) -> PlanRecord:
    """The typed record of `plan`, or a ConfigError naming `where` and the first bad key.
    The checks run in this order, so a plan with several faults is refused for the first."""
    rec = _typed(plan, where)
    method, params = _method_and_params(rec, where)
    _check_experts(rec, method, params, where)
    _check_embedding_block_bytes(rec, where)
    _check_read_lists(rec, where)
    if rec.strategy is not None:
        _check_strategy(rec, where)
    _check_joint(rec, method, params, where)
    tensor_params.check(rec, method, where)
    from mergepipe.plan.planner import check_float32_range  # (planner imports this module's neighbours)
    check_float32_range(rec.method, params.model_dump(mode="json", by_alias=True), rec.experts,
                        rec.tensor_parameters, f"{where}: plan")
    _check_byte_counts(rec, where)
    _check_round_trip(plan, rec, where)
    return rec


def _typed(plan: object, where: str) -> PlanRecord:
    """The record of `plan`'s fields and their types (pydantic's first error, named)."""
    if not isinstance(plan, dict):
        raise ConfigError(f"{where}: a plan is a JSON object, got {type(plan).__name__}")
    try:
        with paused_gc():  # a list per planned tensor, no cycles (util/gcpause.py)
            if _reads_typed(plan.get("reads")):
                # the reads checked above; pydantic would copy 100k lists per expert to say the same
                return PlanRecord.model_validate({**plan, "reads": {}}).model_copy(update={"reads": plan["reads"]})
            return PlanRecord.model_validate(plan)  # its errors name the bad key
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{where}: plan key {_loc(err)}: {err['msg']}; make the plan again with "
                          "`mergepipe plan`") from None


def _method_and_params(rec: PlanRecord, where: str):
    """The registered method and its parameters, typed by its params model."""
    try:
        method = get_method(rec.method)
    except ConfigError as e:
        raise ConfigError(f"{where}: plan key method: {e}") from None
    try:
        return method, method.params.model_validate(rec.parameters)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: plan key parameters.{key}: {err['msg']}") from None


def _check_experts(rec: PlanRecord, method, params, where: str) -> None:
    """Distinct names (not the base's), at most the method's count, finite weights, and each
    expert's density + gamma (its own, else the method's) at most 1."""
    names = rec.expert_names
    if len(set(names)) != len(names) or rec.base.name in names:
        raise ConfigError(f"{where}: plan key experts: expert names must be distinct (and not the base's)")
    if method.max_experts is not None and len(names) > method.max_experts:
        raise ConfigError(f"{where}: plan key experts: {rec.method} takes at most {method.max_experts} "
                          f"expert(s), the plan has {len(names)}")
    for i, e in enumerate(rec.experts):
        if not math.isfinite(e.weight):
            raise ConfigError(f"{where}: plan key experts.{i}.weight: must be finite")
        density = e.density if e.density is not None else getattr(params, "density", None)
        gamma = e.gamma if e.gamma is not None else getattr(params, "gamma", None)
        if density is not None and gamma is not None and density < 1 and density + gamma > 1 + 1e-12:
            raise ConfigError(f"{where}: plan key experts.{i}: density + gamma must be <= 1, "
                              f"got {density} + {gamma}")


def _check_embedding_block_bytes(rec: PlanRecord, where: str) -> None:
    if rec.embedding_block_bytes is not None and rec.embedding_block_bytes == rec.block_bytes:
        raise ConfigError(f"{where}: plan key embedding_block_bytes: equals block_bytes; a plan then has no "
                          "such key")


def _check_read_lists(rec: PlanRecord, where: str) -> None:
    """Reads keyed by the plan's experts, each tensor's block numbers sorted and distinct."""
    extra = sorted(set(rec.reads) - set(rec.expert_names))
    if extra:
        raise ConfigError(f"{where}: plan key reads.{extra[0]}: not an expert of the plan")
    for name, per_tensor in rec.reads.items():
        # each distinct list once (a loaded plan shares equal ones: loads_plan), then the
        # first tensor in order with a bad one is named
        lists = dict(zip(map(id, per_tensor.values()), per_tensor.values()))
        bad = {i for i, bs in lists.items() if not _sorted_distinct(bs)}
        if bad:
            tensor = next(t for t, bs in per_tensor.items() if id(bs) in bad)
            raise ConfigError(f"{where}: plan key reads.{name}.{tensor}: block numbers must be "
                              "non-negative, sorted and distinct")


def _sorted_distinct(blocks: list[int]) -> bool:
    return min(blocks, default=0) >= 0 and all(a < b for a, b in zip(blocks, blocks[1:]))


def _check_byte_counts(rec: PlanRecord, where: str) -> None:
    """The byte counts name exactly the experts, add up, are present exactly for a sketch plan,
    fit in budget_bytes, and planned_pairs counts the reads."""
    b, names = rec.bytes, sorted(rec.expert_names)
    for key in ("planned_by_expert", "skipped_identical_by_expert"):
        if sorted(getattr(b, key)) != names:
            raise ConfigError(f"{where}: plan key bytes.{key}: must name exactly the plan's experts")
    if b.planned_expert_bytes != sum(b.planned_by_expert.values()):
        raise ConfigError(f"{where}: plan key bytes.planned_expert_bytes: not the sum of planned_by_expert")
    _check_sketch_counts(rec, where)
    if b.planned_expert_bytes + (b.planned_sketch_bytes or 0) > rec.budget_bytes:
        raise ConfigError(f"{where}: plan key bytes.planned_expert_bytes: {b.planned_expert_bytes} (and "
                          f"{b.planned_sketch_bytes or 0} sketch bytes) exceeds budget_bytes {rec.budget_bytes}")
    if b.planned_pairs != sum(sum(map(len, r.values())) for r in rec.reads.values()):
        raise ConfigError(f"{where}: plan key bytes.planned_pairs: does not count the reads")


def _check_sketch_counts(rec: PlanRecord, where: str) -> None:
    b = rec.bytes
    sketched = rec.sketch is not None
    if sketched != (b.planned_sketch_bytes is not None) or sketched != (b.sketch_by_expert is not None):
        raise ConfigError(f"{where}: plan key bytes.planned_sketch_bytes: present exactly for a sketch plan")
    if not sketched:
        return
    if sorted(b.sketch_by_expert) != sorted(rec.expert_names):
        raise ConfigError(f"{where}: plan key bytes.sketch_by_expert: must name exactly the plan's experts")
    if b.planned_sketch_bytes != sum(b.sketch_by_expert.values()):
        raise ConfigError(f"{where}: plan key bytes.planned_sketch_bytes: not the sum of sketch_by_expert")


def _check_round_trip(plan: dict, rec: PlanRecord, where: str) -> None:
    """The record dumps to the plan it was read from (plan_json), value and JSON type alike, so
    what is hashed, stored and put in the manifest is the file's plan: a value of another type
    (an int weight, 1 for 1.0) would change the plan's hash on the way through."""
    dumped = plan_json(rec)
    if not _same(plan, dumped):
        raise ConfigError(f"{where}: plan key {_first_difference(plan, dumped)}: not in the form `mergepipe plan` "
                          "writes (a number's type differs); make the plan again with `mergepipe plan`")


def _same(a: object, b: object) -> bool:
    """a == b with every value of the same JSON type (1 is not 1.0); the shared reads are one object."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) is list:
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _first_difference(a: object, b: object, path: str = "") -> str:
    """The dotted key of the first place `a` and `b` differ (_same), `plan` when at the top."""
    if type(a) is dict and type(b) is dict:
        k = next((k for k in sorted(set(a) | set(b), key=str) if k not in a or k not in b or not _same(a[k], b[k])),
                 None)
        if k is not None and k in a and k in b:
            return _first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
        if k is not None:
            return f"{path}.{k}" if path else str(k)
    if type(a) is list and type(b) is list and len(a) == len(b):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)), None)
        if i is not None:
            return _first_difference(a[i], b[i], f"{path}.{i}" if path else str(i))
    return path or "plan"


def _check_joint(rec: PlanRecord, method, params, where: str) -> None:
    """A joint method's plan names the statistics key its inputs and parameters give; any
    other plan has no `joint` key."""
    from mergepipe.methods.joint import statistics_key
    if method.joint is None:
        if rec.joint is not None:
            raise ConfigError(f"{where}: plan key joint: method {rec.method!r} has no joint statistics")
        return
    if rec.joint is None:
        raise ConfigError(f"{where}: plan key joint: missing; method {rec.method!r} needs it")
    want = statistics_key(method.joint, method=rec.method, params=rec.parameters,
                          base_hash=rec.base.content_hash, experts=rec.experts_json(), seed=rec.seed,
                          block_bytes=rec.layout.key) if method.joint.active(params) else None
    if rec.joint.key != want:
        raise ConfigError(f"{where}: plan key joint.key: not the statistics key of the plan's inputs and "
                          "parameters; make the plan again with `mergepipe plan`")


def _check_strategy(rec: PlanRecord, where: str) -> None:
    """A registered strategy with valid options, its calibration and sketch present exactly
    when it has them, and its rescale factors (_check_scales)."""
    from mergepipe.plan.strategies import get_strategy, normalized_options
    st = rec.strategy
    try:
        strategy = get_strategy(st.name)
        norm = normalized_options(st.parameters)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{where}: plan key strategy: {e}") from None
    if (st.calibration is not None) != strategy.calibrated:
        raise ConfigError(f"{where}: plan key strategy.calibration: "
                          + ("missing" if strategy.calibrated else f"strategy {st.name!r} is not calibrated"))
    if norm is None or norm != st.parameters or norm.get("strategy") != st.name:
        raise ConfigError(f"{where}: plan key strategy.parameters: not the normalized options of strategy "
                          f"{st.name!r} (the default strategy is never recorded)")
    if (st.sketch is not None) != strategy.sketched:
        raise ConfigError(f"{where}: plan key strategy.sketch: "
                          + ("missing" if strategy.sketched else f"strategy {st.name!r} does not sketch"))
    if st.sketch is not None:
        _check_sketch(rec, where)
    _check_scales(rec, strategy, where)


def _check_scales(rec: PlanRecord, strategy, where: str) -> None:
    """Rescale factors only from a rescaling strategy, within its max_scale, for tensors the
    expert reads."""
    st = rec.strategy
    cap = float(st.parameters.get("max_scale", 1.0))
    for expert, per in st.scales.items():
        if not strategy.rescales:
            raise ConfigError(f"{where}: plan key strategy.scales.{expert}: strategy {st.name!r} does not rescale")
        reads = rec.reads.get(expert)
        if reads is None:
            raise ConfigError(f"{where}: plan key strategy.scales.{expert}: not an expert of the plan")
        for tensor, c in per.items():
            if tensor not in reads:
                raise ConfigError(f"{where}: plan key strategy.scales.{expert}.{tensor}: the plan reads no block "
                                  "of it")
            if c > cap:
                raise ConfigError(f"{where}: plan key strategy.scales.{expert}.{tensor}: {c} exceeds max_scale {cap}")


def _check_sketch(rec: PlanRecord, where: str) -> None:
    """Every expert has one artifact; sketched blocks sorted, distinct and not read in full too."""
    sk = rec.sketch
    names = sorted(rec.expert_names)
    if sorted(sk.artifacts) != names or not set(sk.blocks) <= set(names):
        raise ConfigError(f"{where}: plan key strategy.sketch: must name exactly the plan's experts")
    for expert, per in sk.blocks.items():
        reads = rec.reads_of(expert)
        for tensor, blocks in per.items():
            key = f"strategy.sketch.blocks.{expert}.{tensor}"
            if any(b < 0 for b in blocks) or any(a >= b for a, b in zip(blocks, blocks[1:])):
                raise ConfigError(f"{where}: plan key {key}: block numbers must be non-negative, sorted and distinct")
            if set(blocks) & set(reads.get(tensor, ())):
                raise ConfigError(f"{where}: plan key {key}: a block both sketched and read in full")


def check_plan_reads(plan: PlanRecord, base_index, expert_indexes: dict, deltas: dict | None, where: str) -> None:
    """Every planned (tensor, block) lies inside its tensor, every per-tensor entry names a
    tensor of the base, and the planned reads' bytes, recomputed from the index, are the
    plan's and within its budget (with the deltas: the budget and a joint plan's all-or-none
    reads recomputed too)."""
    _check_index_layout(plan, base_index, where)
    for tensor in (plan.tensor_parameters or {}).get("tensors", {}):
        if tensor not in base_index.tensors:  # a typo would leave the tensor meant on the top-level values
            raise ConfigError(f"{where}: plan key tensor_parameters.tensors.{tensor}: the base has no such tensor")
    total = sum(_expert_read_bytes(plan, e.name, base_index, expert_indexes[e.name],
                                   deltas.get(e.name) if deltas else None, where) for e in plan.experts)
    if plan.sketch is not None:  # strategy sketch (plan/sketch_reads.py)
        total += _sketch_read_bytes(plan, expert_indexes, deltas, where)
    if total > plan.budget_bytes:
        raise ConfigError(f"{where}: plan reads {total} expert bytes, more than its budget_bytes "
                          f"{plan.budget_bytes}")
    if deltas:
        _check_budget(plan, expert_indexes, deltas, where)
        if get_method(plan.method).joint is not None:
            from mergepipe.plan.joint_reads import check_all_or_none
            check_all_or_none(plan, deltas, where)


def _check_index_layout(plan: PlanRecord, base_index, where: str) -> None:
    """The base was indexed with the plan's block sizes (so its block numbers are the plan's)."""
    if plan.block_bytes != base_index.block_bytes:
        raise ConfigError(f"{where}: plan key block_bytes: {plan.block_bytes} but the base was indexed with "
                          f"{base_index.block_bytes}")
    if plan.layout != base_index.layout:
        raise ConfigError(f"{where}: plan key embedding_block_bytes: {plan.embedding_block_bytes} but the "
                          f"base was indexed with {base_index.embedding_block_bytes}")


def _expert_read_bytes(plan: PlanRecord, name: str, base_index, idx, delta, where: str) -> int:
    """The bytes of the blocks the plan reads of expert `name`, which must be its recorded count."""
    reads = plan.reads_of(name)
    # whole columns at once; None (not columnar, or a read to name) takes the tensor-by-tensor check
    nbytes = planned_bytes(reads, idx, base_index, delta)
    if nbytes is None:
        nbytes = sum(_tensor_read_bytes(f"reads.{name}.{tensor}", tensor, blocks, idx, base_index, delta, where)
                     for tensor, blocks in reads.items())
    recorded = plan.bytes.planned_by_expert[name]
    if nbytes != recorded:
        raise ConfigError(f"{where}: plan key bytes.planned_by_expert.{name}: the reads of expert {name!r} "
                          f"are {nbytes} bytes, the plan says {recorded}")
    return nbytes


def _tensor_read_bytes(key: str, tensor: str, blocks: list[int], idx, base_index, delta, where: str) -> int:
    """The bytes of `blocks` of `tensor`, each a block of a float tensor of both models that
    (with `delta`) differs from the base; a ConfigError naming `key` otherwise."""
    from mergepipe.checkpoint.blocks import row_bytes
    from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE
    entry = idx.tensors.get(tensor)
    if entry is None or tensor not in base_index.tensors:
        raise ConfigError(f"{where}: plan key {key}: the model has no tensor {tensor!r}")
    if entry.dtype not in FLOAT_DTYPES:
        raise ConfigError(f"{where}: plan key {key}: tensor {tensor!r} is {entry.dtype}, not merged")
    n = len(entry.ranges)
    if blocks and blocks[-1] >= n:
        raise ConfigError(f"{where}: plan key {key}: block {blocks[-1]} is outside tensor {tensor!r} "
                          f"({n} blocks)")
    if delta is not None:
        same = delta.tensors[tensor].identical
        bad = next((b for b in blocks if same[b]), None)
        if bad is not None:
            raise ConfigError(f"{where}: plan key {key}: block {bad} of tensor {tensor!r} is identical "
                              "to the base; a plan never reads it")
    row = row_bytes(entry.shape, ITEMSIZE[entry.dtype])
    return sum((entry.ranges[b][1] - entry.ranges[b][0]) * row for b in blocks)


def _sketch_read_bytes(plan: PlanRecord, expert_indexes: dict, deltas: dict | None, where: str) -> int:
    """The sketch bytes of the plan's sketched blocks, which must be its recorded counts."""
    from mergepipe.plan.sketch_reads import check_sketch_blocks
    sketch = check_sketch_blocks(plan.sketch.blocks, plan.expert_names, expert_indexes, deltas, where)
    if sketch != plan.bytes.sketch_by_expert:
        raise ConfigError(f"{where}: plan key bytes.sketch_by_expert: the sketched blocks are {sketch} bytes, "
                          f"the plan says {plan.bytes.sketch_by_expert}")
    return sum(sketch.values())


def _check_budget(plan: PlanRecord, expert_indexes: dict, deltas: dict, where: str) -> None:
    """budget_bytes is the plan's budget resolved against the bytes a full merge reads (expert
    blocks that differ from the base), recomputed here: raising it by hand to fit more reads fails."""
    from mergepipe.units import UnitError, parse_budget
    full = sum(_full_read_bytes(expert_indexes[e.name], deltas[e.name]) for e in plan.experts)
    if full != plan.bytes.full_read_expert_bytes:
        raise ConfigError(f"{where}: plan key bytes.full_read_expert_bytes: the inputs' full read is {full} "
                          f"bytes, the plan says {plan.bytes.full_read_expert_bytes}")
    try:
        want = parse_budget(plan.budget).resolve(full)
    except (UnitError, ValueError) as e:
        raise ConfigError(f"{where}: plan key budget: {e}") from None
    if want != plan.budget_bytes:
        raise ConfigError(f"{where}: plan key budget_bytes: budget {plan.budget} of these inputs is {want} "
                          f"bytes, the plan says {plan.budget_bytes}")


def _full_read_bytes(idx, delta) -> int:
    """Bytes of every block of the expert's float tensors that differs from the base."""
    from mergepipe.checkpoint.blocks import row_bytes
    from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, ITEMSIZE
    columns = full_read_bytes(idx, delta)  # whole columns at once, where both are in one tensor order
    if columns is not None:
        return columns
    full = 0
    for name, entry in idx.tensors.items():
        if entry.dtype not in FLOAT_DTYPES:
            continue
        row = row_bytes(entry.shape, ITEMSIZE[entry.dtype])
        same = delta.tensors[name].identical
        full += sum((r1 - r0) * row for (r0, r1), s in zip(entry.ranges, same) if not s)
    return full
