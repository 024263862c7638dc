"""The steps a user runs, composed: index -> plan -> merge -> publish -> verify.

Everything is keyed by content: indexes by the inputs' bytes, merges by the plan
hash. `run` on an unchanged config and unchanged inputs finds the published
output's manifest already matching the plan and returns without reading weights;
a plan seen before is restored from the store instead of being recomputed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from blake3 import blake3

from mergepipe.commands import uptodate
from mergepipe.commands.base_files import check_planned_files, copy_base_files, plan_base_files
from mergepipe.commands.check import preflight
from mergepipe.commands.cuts import config_cuts, plan_cuts
from mergepipe.commands.sketches import plan_sketches, sketch_inputs
from mergepipe.checkpoint.vocab import ModelView, VocabularyViews
from mergepipe.commands.vocabulary import Recipe as VocabularyRecipe
from mergepipe.commands.vocabulary import views as vocabulary_views
from mergepipe.commands.vocabulary import config_recipe as vocabulary_recipe
from mergepipe.commands.vocabulary import plan_vocabulary, vocabulary_record
from mergepipe.output.chat_template import write_chat_template
from mergepipe.output.vocab_files import write_vocabulary_files
from mergepipe.commands.tokenizer_source import copy_tokenizer, plan_tokenizer
from mergepipe.config.paths import check_expert_kinds
from mergepipe.config.tensor_params import resolve_tensor_parameters
from mergepipe.engine.layout import layout_record, plan_layout
from mergepipe.engine.merge import Inputs, run_merge
from mergepipe.util.fs import hash_file
from mergepipe.errors import ConfigError, IntegrityError
from mergepipe.output import merge_store
from mergepipe.output import run_record as records
from mergepipe.output.manifest import (MANIFEST, SIGNATURE, build_manifest, load_manifest,
                                      manifest_hash, verify_outputs, write_manifest)
from mergepipe.output.model_card import CARD_FILES, Recipe, card_files, read_stack
from mergepipe.output.run_record import stat_key
from mergepipe.plan.strategies.default import default_options
from mergepipe.plan.planner import PlanInput, PlanRequest, check_plan_inputs, make_plan
from mergepipe.plan.record import PlanRecord, check_plan_reads, plan_json
from mergepipe.output.lineage import input_lineage
from mergepipe.output.publish import Publisher
from mergepipe.output.safety import WriteInputs, check_output_folder
from mergepipe.index.store import Store
from mergepipe.commands.stack import STACK_FILE, check_fresh, stacked_sources
from mergepipe.config.mergekit import dump_params


def resolve(path: str, root: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else root / p


def open_inputs(plan: PlanRecord, store: Store, root: Path, *, threads: int = 2, where: str = "plan",
                check_stacks: bool = True) -> Inputs:
    """Open and index (cached) every input of a plan (a plan from disk: plan/load.py first);
    check they are the planned bytes and that the plan's reads are inside them and its budget.
    `check_stacks`: refuse a stacked input folder whose sources changed (verify and explain,
    which only compare with the record, pass False)."""
    bb = plan.layout
    if check_stacks:
        for m in (plan.base, *plan.experts):
            check_fresh(resolve(m.path, root))
    views = plan_vocabulary(plan, root, store, threads=threads)  # None: the base's vocabulary
    base, base_index = store.model_index(resolve(plan.base.path, root), block_bytes=bb, threads=threads,
                                         view=_view(views, "base"))
    experts, expert_indexes, deltas = {}, {}, {}
    for e in plan.experts:
        experts[e.name], expert_indexes[e.name] = store.model_index(
            resolve(e.path, root), block_bytes=bb, threads=threads, base=(base, base_index),
            view=_view(views, e.name))
    check_plan_inputs(plan, base_index, expert_indexes)
    tokenizer = plan.output.tokenizer_source
    tokenizer_dir = None if tokenizer is None else resolve(tokenizer.path, root)
    # before a store restore too: a stored merge of this plan holds the planned non-weight files
    check_planned_files(plan, base, tokenizer_dir)
    for e in plan.experts:
        deltas[e.name] = store.delta_index(base, base_index, experts[e.name], expert_indexes[e.name],
                                           threads=threads)
    check_plan_reads(plan, base_index, expert_indexes, deltas, where)
    # the exact cuts off the index's grid the plan was made with, laid into the delta indexes
    deltas = plan_cuts(plan, store, base, base_index, {n: (experts[n], expert_indexes[n], deltas[n])
                                                      for n in experts}, where, threads=threads)
    if plan.output.layout is not None:  # one naming other tensors is refused before any weight is read
        plan_layout(plan, base.tensors, where=where)
    return Inputs(base, base_index, experts, expert_indexes, deltas, cache_dir=store.root,
                  tokenizer_dir=tokenizer_dir,
                  sketches=plan_sketches(plan, store, base, base_index, {
                      n: (experts[n], expert_indexes[n], deltas[n]) for n in experts}, where))


def plan_config(cfg, store: Store, *, budget=None, threads: int = 2,
                quiet: bool = False) -> tuple[PlanRecord, Inputs]:
    """Index every input (cached) and make the plan for `cfg` (budget overridable); `quiet`
    (-q): no progress bars, and the calibration pass's libraries print nothing but errors."""
    from mergepipe.config.paths import check_models_exist
    if cfg.output.adapter is not None:  # one adapter of the base, combined without a plan (commands/adapter_run.py)
        raise ConfigError(f"{cfg.source}: output.adapter: an adapter output has no plan; `mergepipe run` writes it")
    preflight(cfg, budget=budget)  # what `mergepipe check` finds, from headers, before any index reads a weight
    check_models_exist(cfg)  # a missing one named by its key and expert, not only its folder
    norm = cfg.normalized()
    bb = cfg.block_layout
    for folder in {cfg.base, *(e.path for e in cfg.experts)}:
        check_fresh(folder)  # a stacked folder whose source models changed is refused
    check_expert_kinds(cfg)  # an adapter folder is listed as adapter:, a model folder as path:
    vocabulary = vocabulary_recipe(cfg)  # embeddings rebuilt in an output vocabulary (checkpoint/vocab.py)
    views = built = None
    if vocabulary is not None:
        vocabulary, *built, views = vocabulary_views(store, vocabulary, bb.block_bytes, threads=threads,
                                                     progress=not quiet)
    base, base_index = store.model_index(cfg.base, block_bytes=bb, threads=threads, progress=not quiet,
                                         view=_view(views, "base"))
    experts, expert_indexes, deltas, plan_inputs = {}, {}, {}, []
    for e, e_norm in zip(cfg.experts, norm["experts"]):
        # one scan per new expert: block hashes and delta statistics from the same reads
        experts[e.name], expert_indexes[e.name], deltas[e.name] = store.expert_index(
            e.path, base, base_index, threads=threads, progress=not quiet, view=_view(views, e.name))
        # a per-tensor weight/density/gamma is in the plan's tensor_parameters, not here
        plan_inputs.append(PlanInput(e.name, e_norm.get("path", e_norm.get("adapter")),
                                     expert_indexes[e.name].content_hash,
                                     float(_scalar_or(e.weight, 0.0)), _scalar_or(e_norm.get("density"), None),
                                     _scalar_or(e_norm.get("gamma"), None)))
    params = cfg.method_params.model_dump(mode="json", by_alias=True)
    tensor_parameters = resolve_tensor_parameters(cfg, base_index.tensors)
    # a density or gamma off the index's grid: its exact cuts, made once and recorded (commands/cuts.py)
    cuts, deltas = config_cuts(
        {"method": norm["method"], "parameters": params, "tensor_parameters": tensor_parameters,
         "experts": [{"name": e.name, "density": e.density, "gamma": e.gamma} for e in plan_inputs]},
        store, base, base_index, {n: (experts[n], expert_indexes[n], deltas[n]) for n in experts},
        threads=threads, progress=not quiet)
    budget = budget if budget is not None else cfg.budget
    # a params.yaml without `plan:` gets the measured default for its method and budget
    strategy = norm.get("plan") if cfg.plan else default_options(norm["method"], budget)
    calibration = None
    if (strategy or {}).get("strategy") == "calibrated":  # importance from the base on the user's text
        from mergepipe.commands.calibration import calibration_inputs
        calibration = calibration_inputs(norm["plan"], cfg.config_path(norm["plan"]["text"]), store, base,
                                         base_index, {n: (experts[n], expert_indexes[n]) for n in experts},
                                         progress=not quiet, quiet=quiet)
    sketches = None
    if (strategy or {}).get("strategy") == "sketch":  # ternary sketches (one scan per new expert)
        sketches = sketch_inputs(store, base, base_index,
                                 {n: (experts[n], expert_indexes[n], deltas[n]) for n in experts}, progress=not quiet)
    base_files = plan_base_files(base, tokenizer_source=cfg.output.tokenizer_dir is not None,
                                 dtype=norm["output"]["dtype"])
    plan = make_plan(PlanRequest(
        base=PlanInput("base", norm["base"], base_index.content_hash, 0.0, files=base_files), base_index=base_index,
        experts=plan_inputs, expert_indexes=expert_indexes, deltas=deltas, method=norm["method"],
        params=params, seed=norm["seed"],
        budget=budget, block_bytes=bb, output=_plan_output(cfg, norm, base, vocabulary, built),
        nonfinite=norm.get("nonfinite", "error"), strategy=strategy,
        tensor_parameters=tensor_parameters, calibration=calibration, sketches=sketches, cuts=cuts))
    return plan, Inputs(base, base_index, experts, expert_indexes, deltas, cache_dir=store.root,
                        tokenizer_dir=cfg.output.tokenizer_dir, sketches=sketches or {})


def _view(views: VocabularyViews | None, name: str) -> ModelView | None:
    return None if views is None else views.of(name)


def _plan_output(cfg, norm: dict, base, vocabulary: VocabularyRecipe | None = None, built=None) -> dict:
    """The plan's `output`: dtype, shard_bytes and, only when set, the tokenizer source (hashed)
    and the base-mirroring file layout (engine/layout.py: absent where it is the canonical one)."""
    out = {"dtype": norm["output"]["dtype"], "shard_bytes": norm["output"]["shard_bytes"]}
    layout = layout_record(base, dtype=out["dtype"], shard_bytes=out["shard_bytes"])
    if layout is not None:
        out["layout"] = layout
    if cfg.output.tokenizer_dir is not None:
        out["tokenizer_source"] = plan_tokenizer(cfg.output.tokenizer_dir, norm["output"]["tokenizer_source"],
                                                 cfg.base, same_vocabulary=not cfg.output.aligns_vocabulary)
    if vocabulary is not None:  # the output vocabulary and where its rows come from (commands/vocabulary.py)
        out["vocabulary"] = vocabulary_record(vocabulary, *built)
    if cfg.output.chat_template is not None:  # its text: the plan hash covers the file written
        out["chat_template"] = cfg.output.chat_template
    return out


def _scalar_or(value, default):
    return value if value is None or isinstance(value, int | float) else default


def card_recipe(cfg) -> Recipe:
    """What the card says beyond the plan: the recipe as params.yaml (the normalized config,
    experts by name, without where things go on this machine: output.dir, cache_dir),
    and the mergekit YAML it was imported from (output.mergekit_config)."""
    norm = cfg.normalized()
    output = {k: v for k, v in norm["output"].items() if k not in ("dir", "mergekit_config") and v is not None}
    recipe = {k: v for k, v in norm.items() if k not in ("output", "cache_dir")}
    recipe["experts"] = sorted(({k: v for k, v in e.items() if v is not None} for e in norm["experts"]),
                               key=lambda e: e["name"])  # by name: list order changes no output byte
    if output:
        recipe["output"] = output
    return Recipe(dump_params(recipe), getattr(cfg.output, "mergekit_config", None))


def output_card(plan: PlanRecord, inputs: Inputs, recipe: Recipe | None) -> dict[str, bytes]:
    """The output's card files for `plan` (a stacked base's card names its source models)."""
    return card_files(plan, recipe=recipe, stack=read_stack(inputs.base.root / STACK_FILE))


def recorded_card(out_dir: Path, man: dict) -> dict[str, bytes]:
    """The card files `man` records, read from `out_dir` (checked by verify_outputs first): a
    replay publishes them as they are, since the recipe they quote is no input of the plan."""
    return {n: (out_dir / n).read_bytes() for n in CARD_FILES if n in man["outputs"]["files"]}


def _card_matches(man: dict, card: dict[str, bytes]) -> bool:
    recorded = {n: r.get("blake3") for n, r in man["outputs"]["files"].items() if n in CARD_FILES}
    return recorded == {n: blake3(data).hexdigest() for n, data in card.items()}


def _with_card(tmp: Path, man: dict, card: dict[str, bytes]) -> dict:
    """A restored merge with this recipe's card files: the store keeps a plan's first card, and
    the same plan may come from a recipe listing its experts in another order."""
    if _card_matches(man, card):
        return man
    files = {n: r for n, r in man["outputs"]["files"].items() if n not in CARD_FILES}
    for name in CARD_FILES:  # hard links into the store: replaced, never written through
        (tmp / name).unlink(missing_ok=True)
    for name, data in card.items():
        (tmp / name).write_bytes(data)
        files[name] = {"blake3": hash_file(tmp / name)}
    man = {**man, "outputs": {**man["outputs"], "files": dict(sorted(files.items()))}}
    man["manifest_hash"] = manifest_hash(man)
    (tmp / MANIFEST).unlink()
    write_manifest(tmp / MANIFEST, man)
    return man


def output_inputs(inputs: Inputs, store_root: Path, protect: tuple[Path, ...] = ()) -> WriteInputs:
    """What the merge's output folder may not overlap (output/safety.py): the input models and
    their stacked sources, the tokenizer source, the cache, and the command's other inputs
    (`protect`: the params.yaml or plan file, a parts folder, the calibration text)."""
    models = tuple(ck.root for ck in (inputs.base, *inputs.experts.values()))
    return WriteInputs(models=models, sources=stacked_sources(models), tokenizer=inputs.tokenizer_dir,
                       cache=store_root, command=tuple(Path(p) for p in protect))


def merge_plan(plan: PlanRecord, inputs: Inputs, out_dir: Path, store: Store, *, threads: int = 2,
               progress: bool = False, realize=None, force: bool = False, run_record: dict | None = None,
               protect: tuple[Path, ...] = (), card: dict[str, bytes] | None = None) -> dict:
    """Merge into a temp folder beside out_dir, write aux files and the manifest last, publish.

    `realize(tmp) -> Realized` writes the weight files instead of `run_merge` (the gather of a
    split merge, mergepipe.commands.parts); everything else is the same, so the bytes are too.
    `run_record` is added to the output's run record (`run`'s no-op record, commands/uptodate.py;
    output/run_record.py: beside the folder, never in it).
    `protect`: the command's other inputs (params.yaml, plan file, parts folder), which the
    output folder must not hold. `card`: the card files (`output_card` of the user's recipe;
    a replay's, the output's own: `recorded_card`); None: the card of the plan alone.
    """
    check_output_folder(out_dir, output_inputs(inputs, store.root, protect), force=force)
    cached = store.layout.merge(plan.plan_hash)
    lineage = input_lineage((inputs.base, inputs.base_index),
                            {n: (inputs.experts[n], inputs.expert_indexes[n]) for n in inputs.experts})
    publisher = Publisher(out_dir, force=force)
    with publisher as tmp:
        card = card if card is not None else output_card(plan, inputs, None)
        if merge_store.restore(store.layout, plan_json(plan), tmp, lineage):
            man = _with_card(tmp, json.loads((tmp / MANIFEST).read_text()), card)
            run_info = {"restored_from": str(cached)}
        else:
            realized = (realize(tmp) if realize is not None
                        else run_merge(plan, inputs, tmp, threads=threads, progress=progress))
            # an input edited in place meanwhile: copied base bytes no longer match their recorded hashes
            store.check_unchanged([h.path for c in (inputs.base, *inputs.experts.values()) for h in c.files])
            aux = {}
            output = plan.output
            if output.tokenizer_source is not None:  # that model's tokenizer files, checked against the plan
                aux.update(copy_tokenizer(output.tokenizer_source.model_dump(), inputs.tokenizer_dir, tmp))
            aux.update(copy_base_files(plan, inputs.base, tmp))  # the plan's base.files, checked again
            if output.vocabulary is not None:  # added tokens and vocab_size of the rebuilt embeddings
                aux.update(write_vocabulary_files(output.vocabulary.model_dump(), tmp))
            if output.chat_template is not None:
                aux.update(write_chat_template(output.chat_template, tmp))
            for name, data in card.items():
                (tmp / name).write_bytes(data)
                aux[name] = hash_file(tmp / name)
            man = build_manifest(plan, realized, aux, lineage=lineage)
            write_manifest(tmp / MANIFEST, man)  # dumps(man), a batch at a time
            run_info = {"seconds": round(realized.seconds, 3), "index_bytes_read": store.index_reads.total,
                        "index_cache_hits": store.hits, "index_builds": store.builds, "host": os.uname().nodename}
            if realized.joint_statistics:  # a joint method's statistics artifact (engine/stats.py)
                run_info["joint_statistics"] = {**realized.joint_statistics, "bytes_read": realized.joint_bytes_read}
            merge_store.save(store.layout, plan.plan_hash, tmp)
        # stat keys of the files as published (renaming their folder changes none of them):
        # `up_to_date` compares them, so an output edited in place is rebuilt
        run_info["stat"] = {name: stat_key(tmp / name) for name in [*man["outputs"]["files"], MANIFEST]}
        run_info.update(run_record or {})
        publisher.commit()
        # under the lock still; a run killed before this leaves the previous folder's record,
        # whose stat keys the new files do not have (the next run rehashes them)
        records.update(out_dir, lambda _old: run_info)
    return man


def up_to_date(out_dir: Path, plan: PlanRecord, card: dict[str, bytes] | None = None) -> bool:
    """The published output is this plan's (with these card files, `output_card`, when given),
    and its files are untouched since publication.

    Fast path: every file's stat key equals the one the run record holds from when it was
    published, and no file was added. A stat key also changes when a file only gains or
    loses a hard link (the store, `gc`), so a mismatch is settled by rehashing every file
    against the manifest (`verify_outputs`): an edited output is rebuilt, a relinked one is not,
    and its new stat keys are recorded (taken before the rehash and still the same after it),
    so the next check is the fast one again instead of another rehash.
    """
    try:
        man = load_manifest(out_dir)
        if man.get("plan_hash") != plan.plan_hash or man.get("plan") != plan_json(plan):
            return False
        if card is not None and not _card_matches(man, card):
            return False
        files = [*man["outputs"]["files"], MANIFEST]
        # an earlier version's run.json too; a signature (model.sig) still holds while the files do
        if {p.name for p in out_dir.iterdir()} - {SIGNATURE} != set(files):
            return False
        try:
            recorded = (records.read(out_dir) or {}).get("stat")
            if all(stat_key(out_dir / name) == recorded[name] for name in files):
                return True
        except (OSError, ValueError, TypeError, AttributeError, KeyError):
            pass  # no or damaged record: rehash
        before = {name: stat_key(out_dir / name) for name in files}
        verify_outputs(out_dir)
        uptodate.record_output_stats(out_dir, before)
        return True
    except (IntegrityError, OSError, ValueError, TypeError, AttributeError, KeyError):
        return False  # anything unexpected: rebuild

