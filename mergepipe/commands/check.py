"""`mergepipe check CONFIG`: what a merge of CONFIG would fail on, found before any weight is
read, and what it would cost.

It reads the recipe (params.yaml, or a mergekit YAML converted as import-mergekit converts
it), each model's safetensors headers, config.json and tokenizer files, and the cache's stat
entries; never a tensor's bytes, except one bandwidth probe of a few MiB of a base shard for
the time estimate (`probe=True`, commands/check_predict.py). Each blocking check is the
merge's own (the same function, in the order the merge meets them: models, each expert's
tensors, tokenizer source, per-tensor settings, method and strategy, budget floor, output),
so the first blocking finding is raised as the error, message and exit code, that the merge
would give; warnings never fail. `preflight` is the blocking part alone, without the output:
plan_config runs it before it indexes anything.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

from mergepipe.checkpoint.blocks import is_vocabulary_tensor
from mergepipe.checkpoint.safetensors import Checkpoint, open_checkpoint
from mergepipe.commands import check_models, check_predict
from mergepipe.commands.stack import check_fresh
from mergepipe.commands.tokenizer_source import plan_tokenizer
from mergepipe.commands.vocabulary import header_views
from mergepipe.config.params import MergeConfig, config_from_dict, load_config, read_yaml
from mergepipe.config.paths import check_expert_kinds, check_models_exist
from mergepipe.config.tensor_params import resolve_tensor_parameters
from mergepipe.errors import CheckpointError, ConfigError, MergepipeError
from mergepipe.index.sketch import sketch_cost
from mergepipe.methods import get_method
from mergepipe.plan import joint_reads, sketch_reads
from mergepipe.plan.budget_floor import check_budget_floor, smallest_read
from mergepipe.plan.strategies.default import default_options
from mergepipe.plan.planner import check_float32_range
from mergepipe.plan.strategies import Candidate, normalized_options, strategy_options
from mergepipe.units import Budget, format_bytes, parse_budget, short_repr

T = TypeVar("T")
MERGEKIT_KEYS = ("merge_method", "slices", "models")  # a mergekit YAML has these, a params.yaml none


@dataclass(slots=True)
class Report:
    """Findings, one line each ("OK", "WARN", "FAIL"), and the first blocking error.
    `stop`: raise at the first blocking finding (preflight)."""

    lines: list[str] = field(default_factory=list)
    error: MergepipeError | None = None
    stop: bool = False

    def ok(self, text: str) -> None:
        self.lines.append(f"OK    {text}")

    def warn(self, text: str) -> None:
        self.lines.append(f"WARN  {text}")

    def fail(self, error: MergepipeError, lines: list[str] | None = None) -> None:
        """Record `error` (the first one is raised) with `lines` saying what it is (default: its message)."""
        self.lines += [f"FAIL  {line}" for line in (lines or [str(error)])]
        if self.error is None:
            self.error = error
        if self.stop:
            raise error

    def attempt(self, step: Callable[[], T]) -> tuple[bool, T | None]:
        """(True, step()), or (False, None) after recording the MergepipeError it raised."""
        try:
            return True, step()
        except MergepipeError as e:
            self.fail(e)
            return False, None

    def text(self) -> str:
        return "\n".join(self.lines)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error


def load_recipe(path: Path, *, budget: str | None = None, output: str | None = None,
                warnings: list[str] | None = None) -> MergeConfig:
    """params.yaml, or a mergekit YAML as import-mergekit reads it (model paths relative to the
    working directory; `warnings` gets its lines for what mergekit never reads, which it drops),
    with the command line's --budget and --output.

    Raises:
        ConfigError: as `load_config` and `import_mergekit` do.
    """
    overrides: dict = {}
    if budget is not None:
        overrides["budget"] = budget
    if output is not None:
        from mergepipe.output.safety import check_output_path
        overrides["output"] = {"dir": str(check_output_path(output))}
    data = read_yaml(path)
    if isinstance(data, dict) and "experts" not in data and any(k in data for k in MERGEKIT_KEYS):
        from mergepipe.config.mergekit import import_mergekit
        params = import_mergekit(path, validate=False, warnings=warnings)
        return config_from_dict(params, source=f"{path} (converted to mergepipe params)", root=Path.cwd(),
                                overrides=overrides or None)
    return load_config(path, overrides=overrides or None)


def check_file(path: Path, *, budget: str | None = None, output: str | None = None, force: bool = False,
               threads: int = 2, probe: bool = True) -> Report:
    """`mergepipe check PATH`: the report of `check`, or of the recipe that does not load."""
    ignored: list[str] = []
    try:
        cfg = load_recipe(path, budget=budget, output=output, warnings=ignored)
    except MergepipeError as e:
        report = Report()
        report.fail(e)
        return report
    report = check(cfg, config_file=path, force=force, threads=threads, probe=probe)
    report.lines[:0] = [f"WARN  {line.removeprefix('warning: ')}" for line in ignored]  # as import-mergekit
    return report


def _check_adapter_output(report: Report, cfg: MergeConfig, config_file: Path | None, force: bool) -> Report:
    from mergepipe.config.adapter_output import check_adapter_output
    try:
        check_adapter_output(cfg)
    except MergepipeError as e:
        report.fail(e)
        return report
    report.ok(f"output.adapter: {cfg.output.adapter.combination} of {len(cfg.experts)} adapter(s); the adapters "
              "are checked against the base's headers when run opens them")
    _check_adapter_folder(report, cfg, config_file, force)
    return report


def _check_adapter_folder(report: Report, cfg: MergeConfig, config_file: Path | None, force: bool) -> None:
    """What run refuses about an adapter output's folder (output/safety.py), before any work."""
    from mergepipe.commands.adapter_run import output_inputs
    from mergepipe.output.safety import check_output_path, check_replace, refuse_overlap

    out = cfg.output.dir
    protect = () if config_file is None else (Path(config_file),)

    def safe() -> None:
        check_output_path(out)
        refuse_overlap(out, output_inputs(cfg, protect))
        check_replace(out, force=force)
    if report.attempt(safe)[0]:
        state = "a mergepipe output, replaced when the adapter is published" if out.is_dir() else "a new folder"
        report.ok(f"output {cfg.normalized()['output']['dir']}: {state}")


def check(cfg: MergeConfig, *, config_file: Path | None = None, budget: Budget | str | None = None,
          force: bool = False, threads: int = 2, probe: bool = True) -> Report:
    """Every finding on `cfg`, and the prediction when nothing blocks. `config_file`: the file
    the output folder may not hold; `force`: as run's --force (an output folder mergepipe did
    not write may be replaced); `probe`: measure the read bandwidth (else the time is unknown)."""
    report = Report()
    report.ok(f"recipe {cfg.source}: method {cfg.method}, {len(cfg.experts)} expert(s), budget {cfg.budget}")
    if cfg.output.adapter is not None:  # reads only the adapters: run's own checks, nothing to predict
        return _check_adapter_output(report, cfg, config_file, force)
    ctx = _check(report, cfg, budget, detail=True)
    _check_output(report, cfg, config_file, force)
    if report.error is None and ctx is not None:
        _predict(report, cfg, ctx, threads=threads, probe=probe)
    return report


def preflight(cfg: MergeConfig, *, budget: Budget | str | None = None) -> None:
    """Raise the first blocking problem `check` finds in the inputs, settings and budget (not the
    output: plan does not write one), before any weight is read: what run and plan start with.

    Raises:
        MergepipeError: the one the merge would raise (CheckpointError, ConfigError, BudgetError, ...).
    """
    _check(Report(stop=True), cfg, budget, detail=False)


@dataclass(slots=True)
class _Context:
    base: Checkpoint
    experts: dict[str, Checkpoint | None]  # None: a LoRA adapter (the base's tensors)
    budget: Budget
    budget_bytes: int
    full_read: int
    sketched: bool
    sizes: check_predict.Sizes


def _check(report: Report, cfg: MergeConfig, budget: Budget | str | None, *, detail: bool) -> _Context | None:
    """The blocking checks in the merge's order (plan_config, then make_plan's head); `detail`:
    also the warnings (config.json, tokenizers) and what passed."""
    opened = _check_models(report, cfg, detail=detail)
    if opened is None:
        return None
    base, experts = opened
    if cfg.output.tokenizer_dir is not None:
        written = cfg.normalized()["output"]["tokenizer_source"]
        if not report.attempt(lambda: plan_tokenizer(cfg.output.tokenizer_dir, written, cfg.base,
                                                     same_vocabulary=not cfg.output.aligns_vocabulary))[0]:
            return None
        report.ok(f"output.tokenizer_source {written}: tokenizer files there, vocab_size as the base's")
    passed, budget = report.attempt(lambda: parse_budget(cfg.budget if budget is None else budget))
    if not passed:
        return None
    strategy = _check_method(report, cfg, base, budget)
    if strategy is None:
        return None
    sizes = check_predict.header_sizes(base, cfg.block_layout)
    return _check_budget(report, cfg, base, experts, budget, strategy, sizes)


# Branchy: one finding kind per branch, in the merge's own order, so the report and the merge agree.
def _check_models(report: Report, cfg: MergeConfig, *, detail: bool
                  ) -> tuple[Checkpoint, dict[str, Checkpoint | None]] | None:
    """The models exist and are what their keys say, their headers parse, and every expert has
    the base's tensor names, shapes and dtypes (index/build.py check_compatible's rule)."""
    if not report.attempt(lambda: _inputs_exist(cfg))[0]:
        return None
    passed, views = report.attempt(lambda: header_views(cfg))  # None: the base's vocabulary
    if not passed:
        return None
    passed, base = report.attempt(lambda: _opened(views, cfg.base, "base"))
    if not passed:
        return None
    written = cfg.normalized()
    facts = _report_base(report, cfg, written, base, views) if detail else None
    tokenizer_from = "the base's" if cfg.output.tokenizer_dir is None else \
        f"{written['output']['tokenizer_source']}'s"
    experts: dict[str, Checkpoint | None] = {}
    for e, e_written in zip(cfg.experts, written["experts"]):
        where = f"expert {e.name!r} ({e_written.get('path', e_written.get('adapter'))})"
        if getattr(e, "adapter", None) is not None:
            if not _check_adapter_expert(report, e, base, where, detail):
                return None
            experts[e.name] = None
            continue
        passed, ckpt = report.attempt(lambda e=e: _opened(views, e.path, e.name))
        if not passed:
            return None
        experts[e.name] = ckpt
        differences = [] if facts is None or views is not None else check_models.fact_differences(
            e.name, facts, check_models.read_facts(e.path), base_rows=_vocabulary_rows(base),
            tokenizer_from=tokenizer_from)
        _check_expert_tensors(report, base, ckpt, where, differences, detail)
    return (base, experts) if report.error is None else None


def _inputs_exist(cfg: MergeConfig) -> None:
    check_models_exist(cfg)
    for folder in dict.fromkeys([cfg.base, *(e.path for e in cfg.experts)]):
        check_fresh(folder)
    check_expert_kinds(cfg)


def _opened(views: dict[str, Checkpoint] | None, path: Path, name: str) -> Checkpoint:
    """A model as the merge reads it: its own file, or its view in the output vocabulary."""
    return open_checkpoint(path) if views is None else views[name]


def _vocabulary_rows(ckpt: Checkpoint) -> int | None:
    """The embedding's row count, None where the model has no vocabulary tensor."""
    return next((shape[0] for name, shape in zip(ckpt.tensors.names, ckpt.tensors.shapes)
                 if is_vocabulary_tensor(name, shape)), None)


def _report_base(report: Report, cfg: MergeConfig, written: dict, base: Checkpoint,
                 views: dict[str, Checkpoint] | None) -> dict:
    """The base's line (and the output vocabulary's, where the embeddings are rebuilt); its facts."""
    facts = check_models.read_facts(cfg.base)
    report.ok(f"base {written['base']}: {check_models.describe(base, facts)}")
    if views is not None:  # every model seen in the output vocabulary (checkpoint/vocab.py)
        report.ok(f"output vocabulary ({written['output'].get('tokenizer_source', 'base')}): embeddings rebuilt "
                  f"with {_vocabulary_rows(base)} rows")
    return facts


def _check_adapter_expert(report: Report, e, base: Checkpoint, where: str, detail: bool) -> bool:
    from mergepipe.checkpoint.lora import check_adapter  # its config and header: no factor read
    if not report.attempt(lambda: check_adapter(e.adapter, base))[0]:
        return False
    if detail:
        report.ok(f"{where}: a LoRA adapter of the base (its tensors are the base's)")
    return True


def _check_expert_tensors(report: Report, base: Checkpoint, ckpt: Checkpoint, where: str,
                          differences: list[str], detail: bool) -> None:
    mismatches = check_models.tensor_mismatches(base, ckpt)
    if mismatches:
        from mergepipe.index.build import check_compatible  # numpy and the scan kernels: only here
        try:
            check_compatible(base, ckpt)
        except CheckpointError as err:  # the merge's own message is the one raised
            report.fail(err, [f"{where}: {m}" for m in mismatches] + differences)
            return
    for line in differences:
        report.warn(line)
    if detail:
        report.ok(f"{where}: the base's tensor names, shapes and dtypes")


def _check_method(report: Report, cfg: MergeConfig, base: Checkpoint, budget: Budget) -> dict | None:
    """Per-tensor settings over the base's tensor names, then what make_plan checks before it
    selects: the strategy's options and its fit with the method, float32 range, the joint
    methods' per-tensor parameters. Returns the strategy options ({} for the default), or None."""
    norm = cfg.normalized()
    passed, tensor_parameters = report.attempt(lambda: resolve_tensor_parameters(cfg, base.tensors.keys()))
    if not passed:
        return None
    strategy = norm.get("plan") if cfg.plan else default_options(norm["method"], budget)
    method = get_method(cfg.method)
    params = cfg.method_params.model_dump(mode="json", by_alias=True)
    # a per-tensor weight is 0 at the plan's top level, as plan_config writes it
    experts = [SimpleNamespace(name=e.name, weight=float(e.weight) if isinstance(e.weight, int | float)
                               else 0.0) for e in cfg.experts]

    def plan_head() -> str:
        try:
            normalized_options(strategy)
            strat, _ = strategy_options(strategy)
        except ValueError as e:
            raise ConfigError(f"plan: {e}") from None
        if method.joint is not None:
            joint_reads.check_strategy(cfg.method, strat.name)
        if strat.sketched:
            sketch_reads.check_method(cfg.method, strat.name)
        check_float32_range(cfg.method, params, experts, tensor_parameters, "plan")
        if method.joint is not None:
            joint_reads.check_tensor_parameters(cfg.method, method, params, tensor_parameters)
        return strat.name
    passed, name = report.attempt(plan_head)
    if not passed:
        return None
    groups = 0 if tensor_parameters is None else len(tensor_parameters["groups"])
    per_tensor = f", per-tensor settings: {groups} group(s) over {len(base.tensors)} tensors" if groups else ""
    given = f" {short_repr(cfg.parameters)}" if cfg.parameters else ""
    report.ok(f"method {cfg.method}{given}{per_tensor}; plan strategy {name}")
    return strategy or {}


def _check_budget(report: Report, cfg: MergeConfig, base: Checkpoint, experts: dict[str, Checkpoint | None],
                  budget: Budget, strategy: dict, sizes: check_predict.Sizes) -> _Context | None:
    """The budget floor (plan/budget_floor.py) from the headers: every float block of every expert
    counted as a candidate (the index finds the ones identical to the base, which only lowers
    the full read), and the cheapest block (a lower bound of the plan's floor; for a joint
    method too, whose group of a block holds at least one expert's) as the smallest read."""
    full_read = sizes.float_bytes * len(experts)
    budget_bytes = budget.resolve(full_read)
    sketched = strategy.get("strategy") == "sketch"
    # one candidate per distinct smallest block; its sketch as sketch_reads.sketch_context gives
    # one, keeping some of the block's energy (l2 1, residual 0)
    blocks = sorted(sizes.smallest_blocks)
    items = [Candidate(0.0, str(i), 0, "", "", 0, nbytes, 0.0, 1.0) for i, (nbytes, _) in enumerate(blocks)]
    sketch = {("", str(i), 0): (0.0, sketch_cost(n)) for i, (_, n) in enumerate(blocks)} if sketched else None
    smallest = smallest_read(items, sketch=sketch)
    try:
        check_budget_floor(budget, budget_bytes, full_read, smallest)
    except MergepipeError as e:
        report.fail(e)
        return None
    capped = min(budget_bytes, full_read)
    floor = f"; the smallest read is {format_bytes(smallest[0])} ({smallest[1]})" if smallest[0] else ""
    report.ok(f"budget {budget}: reads at most {format_bytes(capped)} of {format_bytes(full_read)} "
              f"expert bytes{floor}")
    return _Context(base, experts, budget, budget_bytes, full_read, sketched, sizes)


def _check_output(report: Report, cfg: MergeConfig, config_file: Path | None, force: bool) -> None:
    """What merge_plan and the publisher refuse about the output folder, before any work
    (output/safety.check_output_folder, the merge's own question)."""
    from mergepipe.commands.stack import stacked_sources
    from mergepipe.output.safety import WriteInputs, check_output_folder

    out = cfg.output.dir
    models = (cfg.base, *(e.path for e in cfg.experts))
    protect = [] if config_file is None else [Path(config_file)]
    text = (cfg.plan_options or {}).get("text")
    if text is not None:
        protect.append(cfg.config_path(text))
    inputs = WriteInputs(models=models, sources=stacked_sources(models), tokenizer=cfg.output.tokenizer_dir,
                         cache=cfg.cache_dir, command=tuple(protect))
    if not report.attempt(lambda: check_output_folder(out, inputs, force=force))[0]:
        return
    state = "a mergepipe output, replaced when the merge is published" if out.is_dir() else "a new folder"
    report.ok(f"output {cfg.normalized()['output']['dir']}: {state}")


def _cut_scans(cfg: MergeConfig, base: Checkpoint) -> bool:
    """A magnitude method with a density or gamma off the index's grid (after per-tensor
    resolution): the merge makes exact cuts by one more scan (commands/cuts.py)."""
    from mergepipe.plan.cut_ranks import off_grid
    if get_method(cfg.method).cut_ranks is None:
        return False
    experts = [{"name": e.name, **{k: v for k in ("density", "gamma") if isinstance(v := getattr(e, k), int | float)}}
               for e in cfg.experts]
    return off_grid({"parameters": cfg.method_params.model_dump(mode="json", by_alias=True), "experts": experts,
                     "tensor_parameters": resolve_tensor_parameters(cfg, base.tensors.keys())})


def _predict(report: Report, cfg: MergeConfig, ctx: _Context, *, threads: int, probe: bool) -> None:
    from mergepipe.index.store import Store
    store = Store(cfg.cache_dir)
    layout = cfg.block_layout
    base_indexed = check_predict.indexed(store, ctx.base, layout)
    new_experts = sum(1 for ck in ctx.experts.values()
                      if ck is None or not check_predict.indexed(store, ck, layout))  # an adapter: unknown
    out_bytes, out_files = check_predict.output_files(ctx.base, cfg.output.dtype, cfg.output.shard_bytes)
    bandwidth = check_predict.probe_bandwidth(ctx.base) if probe else None
    prediction = check_predict.predict(
        sizes=ctx.sizes, out_bytes=out_bytes, out_files=out_files, out_dtype=cfg.output.dtype,
        budget_bytes=ctx.budget_bytes, full_read=ctx.full_read, experts=len(ctx.experts),
        new_models=new_experts + (not base_indexed), new_experts=new_experts, base_indexed=base_indexed,
        sketches=ctx.sketched, threads=threads, out_dir=cfg.output.dir, cache_dir=cfg.cache_dir,
        bandwidth=bandwidth, cut_scans=_cut_scans(cfg, ctx.base))
    if prediction.disk_short is not None:
        report.warn(prediction.disk_short)
    report.lines += [f"  ~   {line}" for line in prediction.lines]
