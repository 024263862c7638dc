"""`mergepipe explain`: planned/realized bytes and the bound as readable tables, and what
a budget costs: the share of each expert's update energy the plan keeps
(sum of planned s_kb^2 / sum of all s_kb^2, s_kb = |e_k| ||delta_kb|| from the delta
index), for calibrated plans the share of importance-weighted energy kept (the
store's calibrated energies), and the plan strategy's rescale factors. A params.yaml target is planned first
(at `--budget`), so the cost is shown before anything is merged."""
from __future__ import annotations

import json
import math
from pathlib import Path

from mergepipe.errors import ConfigError, IntegrityError, MergepipeError
from mergepipe.output.adapter_out import refuse_adapter_manifest
from mergepipe.output.manifest import MANIFEST, load_manifest
from mergepipe.plan import joint_reads
from mergepipe.plan.bound_text import bound_line
from mergepipe.plan.record import PlanRecord
from mergepipe.util.fs import read_json_object_text


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def energy_kept(plan: PlanRecord, deltas: dict, expert_indexes: dict | None = None) -> dict[str, tuple[float, float]]:
    """expert -> (kept, kept after rescale): sum over planned blocks of ||delta_kb||^2 (times
    c_kt^2 for the second) over the sum over every non-identical block of a float tensor
    (the candidates; e_k cancels per expert). 1.0 for an expert with no update.
    `expert_indexes` (when given) leave out integer tensors, which are never merged."""
    from mergepipe.checkpoint.safetensors import FLOAT_DTYPES
    scales = plan.scales
    out = {}
    for name in plan.expert_names:
        delta = deltas[name]
        reads = plan.reads_of(name)
        total = kept = rescaled = 0.0
        for tname, td in delta.tensors.items():
            if expert_indexes is not None and expert_indexes[name].tensors[tname].dtype not in FLOAT_DTYPES:
                continue
            read = set(reads.get(tname, ()))
            c = scales.get(name, {}).get(tname, 1.0)
            for b, (l2, same) in enumerate(zip(td.block_l2, td.identical)):
                if same:
                    continue
                sq = l2 * l2
                total += sq
                if b in read:
                    kept += sq
                    rescaled += c * c * sq
        out[name] = (kept / total, rescaled / total) if total > 0 else (1.0, 1.0)
    return out


def _scales_summary(plan: PlanRecord) -> list[str]:
    st = plan.strategy
    if st is None:
        return []
    lines = ["", f"strategy {st.name} ({json.dumps(st.parameters, sort_keys=True)})"]
    if st.scales or st.parameters.get("max_scale") is not None:
        cap = st.parameters.get("max_scale")
        lines += ["", "| expert | rescaled tensors | min rescale | median | max | at max_scale |",
                  "|---|---:|---:|---:|---:|---:|"]
        for n in plan.expert_names:
            cs = sorted(st.scales.get(n, {}).values())
            if cs:
                med = cs[len(cs) // 2] if len(cs) % 2 else (cs[len(cs) // 2 - 1] + cs[len(cs) // 2]) / 2
                lines.append(f"| {n} | {len(cs)} | {cs[0]:.4g} | {med:.4g} | {cs[-1]:.4g} | "
                             f"{sum(1 for c in cs if c == cap)} |")
            else:
                lines.append(f"| {n} | 0 | - | - | - | 0 |")
    return lines


def explain(target: Path, *, cache_dir: Path | str | None = ".mergepipe", root: Path | str = ".",
            budget: str | None = None, threads: int = 2) -> str:
    """Render a plan file, an output folder's manifest, or (planned here first, at `budget`)
    a params.yaml, as markdown tables. The energy-kept column needs the inputs' delta
    indexes: from the store (`cache_dir`; a params.yaml's own cache_dir when None)."""
    target = Path(target)
    if target.suffix in (".yaml", ".yml") and target.is_file():
        from mergepipe.commands.pipeline import plan_config
        from mergepipe.config.params import load_config
        from mergepipe.index.store import Store
        cfg = load_config(target, overrides={"budget": budget} if budget is not None else None)
        store = Store(cache_dir if cache_dir is not None else cfg.cache_dir)
        plan, inputs = plan_config(cfg, store, threads=threads)
        return _render(plan, None, inputs, "", store)
    if budget is not None:
        raise ConfigError(f"{target}: --budget applies to a params.yaml, not to a plan or output")
    plan, man = _load(target)
    inputs, note, store = None, "", None
    try:
        from mergepipe.commands.pipeline import open_inputs
        from mergepipe.index.store import Store
        store = Store(cache_dir if cache_dir is not None else ".mergepipe")
        inputs = open_inputs(plan, store, Path(root).resolve(), threads=threads, where=str(target),
                             check_stacks=False)
    except MergepipeError as e:  # inputs moved or changed: the byte tables still hold
        note = f"(energy kept not shown: the plan's inputs cannot be indexed: {e})"
    return _render(plan, man, inputs, note, store)


def _load(target: Path) -> tuple[PlanRecord, dict | None]:
    """(plan, manifest or None) of a plan file or output folder, the plan checked as merge checks
    one (plan/record.py): the tables read its keys as a valid plan has them.

    Raises:
        ConfigError: not a plan or output folder, or a plan key that is not a plan's (named).
    """
    from mergepipe.plan.record import split_plan_file, validate_plan
    man = None
    if target.is_dir() or target.name == MANIFEST:
        man = load_manifest(target if target.is_dir() else target.parent)
        refuse_adapter_manifest(man, target, "explain")
        plan, where = man.get("plan"), f"{target if target.name == MANIFEST else target / MANIFEST}: plan"
    else:
        try:
            plan, where = json.loads(read_json_object_text(target)), str(target)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{target}: not a plan or output folder: {e}") from None
        plan, _ = split_plan_file(plan, where)  # made_from: the params bytes, beside the plan
    return validate_plan(plan, where), man


def importance_kept(plan: PlanRecord, store, inputs) -> float | None:
    """For a calibrated plan: sum over planned (k, b) of e_k^2 * energy_kb over the sum over
    every covered candidate (index/weighted.py's energies, from the store); None when the
    plan is not calibrated or the energies are not in the store."""
    cal = plan.calibration
    if cal is None or store is None or inputs is None:
        return None
    from mergepipe.index import weighted
    eff = _effective_weights(plan, *plan.view(None))
    base = inputs.base_index
    kept = total = 0.0
    for e in plan.experts:
        path = weighted.cache_path(store.root, e.content_hash, base.content_hash, cal.artifact, base.layout.key)
        try:
            energies = weighted.load_cached(path, base)
        except IntegrityError:  # a damaged entry: no share shown (the next plan rebuilds it)
            energies = None
        if energies is None:
            return None
        reads = plan.reads_of(e.name)
        identical = inputs.deltas[e.name].tensors
        w2 = eff[e.name] ** 2
        for tname, values in energies.items():
            read = set(reads.get(tname, ()))
            for b, v in enumerate(values):
                if not identical[tname].identical[b]:
                    total += w2 * v
                    kept += w2 * v if b in read else 0.0
    return kept / total if total > 0 else 1.0


def sketch_summary(plan: PlanRecord, inputs) -> list[str]:
    """For a sketch plan: the sketch bytes and the update energy kept counting what each
    sketch keeps (l2^2 - residual^2, index/sketch.py), next to the full reads' alone."""
    sk = plan.sketch
    if sk is None or not inputs.sketches:
        return []
    from mergepipe.index.sketch import residual_sq
    eff = _effective_weights(plan, *plan.view(None))
    kept = total = 0.0
    pairs = 0
    for n in plan.expert_names:
        w2 = eff[n] ** 2
        reads, sketched = plan.reads_of(n), sk.blocks.get(n, {})
        for tname, td in inputs.deltas[n].tensors.items():
            read, sks = set(reads.get(tname, ())), set(sketched.get(tname, ()))
            pairs += len(sks)
            for b, l2 in enumerate(td.block_l2):
                total += w2 * l2 * l2
                if b in read:
                    kept += w2 * l2 * l2
                elif b in sks:
                    kept += w2 * (l2 * l2 - residual_sq(l2, *inputs.sketches[n].stats(tname, b)))
    share = kept / total if total > 0 else 1.0
    return [f"sketched {_mib(plan.bytes.planned_sketch_bytes)} MiB ({pairs} (expert, block) pairs read as "
            f"2-bit sketches); update energy kept with the sketches: {share:.2%}"]


def _render(plan: PlanRecord, man: dict | None, inputs, note: str, store=None) -> str:
    """The tables; `inputs` (engine.merge.Inputs, or None) give the energy-kept columns."""
    deltas = inputs.deltas if inputs is not None else None
    kept = energy_kept(plan, deltas, inputs.expert_indexes) if deltas is not None else None
    lines = _expert_table(plan, man, kept)
    if kept is not None:
        full = plan.bound.full_update_norm_estimate
        if full > 0:
            kept_sq = _kept_mass_sq(plan, deltas)
            lines.append(f"update energy kept, all experts (sum of planned s^2 / sum of all s^2): "
                         f"{kept_sq / (full * full):.2%}")
        for line in sketch_summary(plan, inputs):
            lines.append(line)
        imp = importance_kept(plan, store, inputs)
        if imp is not None:
            lines.append(f"importance kept (calibrated: sum of planned e^2 * Fisher-weighted energy / sum of all): "
                         f"{imp:.2%}")
    elif note:
        lines.append(note)
    lines.append(bound_line(plan.bound.model_dump()) or "nothing left out: this plan gives the full merge")
    lines += _scales_summary(plan)
    lines += joint_reads.describe(plan)
    return "\n".join(lines + _tensor_table(plan))


def _expert_table(plan: PlanRecord, man: dict | None, kept: dict | None) -> list[str]:
    """The header lines, the per-expert table and the planned-bytes line."""
    b = plan.bytes
    realized = man["bytes"]["expert_bytes_read_by_expert"] if man else {}
    rescales = bool(plan.scales)
    cols = "" if kept is None else " energy kept |" + (" after rescale |" if rescales else "")
    lines = [f"plan {plan.plan_hash[:16]}  method {plan.method}  budget {plan.budget} "
             f"({_mib(plan.budget_bytes)} MiB)  strategy {plan.strategy_name}",
             f"parameters {json.dumps(plan.parameters, sort_keys=True)}",
             f"base files copied (hashed into the plan): {', '.join(plan.base.files) or 'none'}", "",
             "| expert | weight | planned MiB | realized MiB | identical-to-base MiB (free) | total MiB |" + cols,
             "|---|---:|---:|---:|---:|---:|" + "---:|" * cols.count("|")]
    total_each = b.total_expert_bytes // max(1, len(plan.experts))
    for e in plan.experts:
        n = e.name
        real = _mib(realized[n]) if n in realized else "-"
        extra = ""
        if kept is not None:
            extra = f" {kept[n][0]:.2%} |" + (f" {kept[n][1]:.2%} |" if rescales else "")
        weight = "per tensor" if _per_tensor_weight(plan, n) else e.weight
        lines.append(f"| {n} | {weight} | {_mib(b.planned_by_expert[n])} | {real} | "
                     f"{_mib(b.skipped_identical_by_expert[n])} | {_mib(total_each)} |" + extra)
    return lines + ["", f"planned {_mib(b.planned_expert_bytes)} MiB of {_mib(b.total_expert_bytes)} MiB "
                        f"({b.planned_pairs} of {b.candidate_pairs} non-identical (expert, block) pairs)"]


def _tensor_table(plan: PlanRecord) -> list[str]:
    """Blocks read per tensor and expert (none when the plan reads nothing)."""
    tensors: dict[str, dict[str, int]] = {}
    for ename, per in plan.reads.items():
        for tname, blocks in per.items():
            tensors.setdefault(tname, {})[ename] = len(blocks)
    if not tensors:
        return []
    names = plan.expert_names
    lines = ["", "| tensor | " + " | ".join(f"{n} blocks" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for tname in sorted(tensors):
        lines.append(f"| {tname} | " + " | ".join(str(tensors[tname].get(n, 0)) for n in names) + " |")
    return lines


def _per_tensor_weight(plan: PlanRecord, expert: str) -> bool:
    """Whether the plan gives `expert` a weight per tensor (`tensor_parameters`)."""
    groups = (plan.tensor_parameters or {}).get("groups", [])
    return any("weight" in g["experts"].get(expert, {}) for g in groups)


def _effective_weights(plan: PlanRecord, params: dict, experts: list[dict]) -> dict[str, float]:
    """|scale of delta_k| under `params` (Method.effective_weights); `experts`: the entries of
    a PlanRecord.view."""
    from mergepipe.methods import get_method
    return get_method(plan.method).effective_weights(params, {e["name"]: float(e["weight"]) for e in experts})


def _kept_mass_sq(plan: PlanRecord, deltas: dict) -> float:
    """sum over planned (k, b) of s_kb^2, s_kb = |e_k| ||delta_kb|| (the planner's scores)."""
    effs: dict[int | None, dict[str, float]] = {}  # per group of per-tensor parameters (None: top level)

    def eff_of(tname: str) -> dict[str, float]:
        g = plan.group_of(tname)
        if g not in effs:
            effs[g] = _effective_weights(plan, *plan.view(g))
        return effs[g]
    total = 0.0
    for name, per in plan.reads.items():
        for tname, blocks in per.items():
            l2 = deltas[name].tensors[tname].block_l2
            total += sum((eff_of(tname)[name] * l2[b]) ** 2 for b in blocks)
    return total if math.isfinite(total) else 0.0
