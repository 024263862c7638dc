"""Command line: `mergepipe COMMAND`, one handler per command (`mergepipe --help` lists them).

The only place that catches MergepipeError: it prints one line and exits with the
error's code. Any other exception is a bug and keeps its traceback. Longer than the
~400-line rule of thumb because it is the whole command-line surface in one place: each
command's arguments next to its thin handler (the work is in commands/), which a user
reading `--help` and a reviewer checking an option can follow top to bottom.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from mergepipe import __version__
from mergepipe.errors import ConfigError, MergepipeError

# numpy's OpenBLAS starts a thread per core at import, and they spin before they sleep:
# on two cores that took ~0.15 CPU-s from every command (perf,
# docs/history/benchmarks-rounds.md). No result of mergepipe's comes from BLAS
# (index/kernels.py sums in a fixed order), so one thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_index(args: argparse.Namespace) -> int:
    from mergepipe.index.store import Store
    from mergepipe.checkpoint.blocks import DEFAULT_BLOCK_BYTES, parse_block_bytes
    if args.o:  # the record never replaces a file of the models it indexes, even with --force
        _refuse_inside_inputs(Path(args.o), [Path(m) for m in (args.model, args.base) if m])
    store = Store(args.cache_dir)
    bb = parse_block_bytes(DEFAULT_BLOCK_BYTES if args.block_bytes is None else args.block_bytes, what="--block-bytes")
    t0 = time.monotonic()
    progress = not args.quiet
    if args.base:
        base, base_index = store.model_index(args.base, block_bytes=bb, threads=args.threads, progress=progress)
        ckpt, index, delta = store.expert_index(args.model, base, base_index, threads=args.threads, progress=progress)
    else:
        ckpt, index = store.model_index(args.model, block_bytes=bb, threads=args.threads, progress=progress)
    out = {"model": str(args.model), "content_hash": index.content_hash, "block_bytes": bb,
           "tensors": len(index.tensors), "bytes": ckpt.total_bytes}
    if args.base:
        identical = sum((r[1] - r[0]) * ckpt.tensors[n].row_bytes()
                        for n, e in index.tensors.items() for r, same in zip(e.ranges, delta.tensors[n].identical)
                        if same)
        out.update(base=str(args.base), base_hash=base_index.content_hash, identical_bytes=identical,
                   delta_l2=sum(t.l2 ** 2 for t in delta.tensors.values()) ** 0.5)
    if args.o:
        _check_overwrite(Path(args.o), args, key="content_hash", what="index record", inputs=(args.model,))
        _write_record(Path(args.o), out)
    seconds = time.monotonic() - t0
    read = store.index_reads.total
    out.update(index_bytes_read=read, seconds=round(seconds, 3), cached=store.builds == 0)
    if args.json:
        print(json.dumps(out, indent=1, sort_keys=True))
    else:
        rate = f", {read / 2**20 / max(seconds, 1e-9):,.0f} MiB/s" if read else ""
        print(f"{args.model}: content {index.content_hash[:16]}, {len(index.tensors)} tensors, "
              f"{_mib(ckpt.total_bytes)}; read {_mib(read)} in {seconds:.2f} s{rate}"
              + (" (cached)" if store.builds == 0 else ""))
        if args.base:
            print(f"  vs base {args.base}: {_mib(out['identical_bytes'])} identical to base, "
                  f"||delta||_2 = {out['delta_l2']:.6g}")
    return 0


def _check_overwrite(path: Path, args: argparse.Namespace, *, key: str, what: str,
                     inputs: tuple[str, ...] = ()) -> None:
    """An -o record may replace only what this command wrote before (a JSON object with `key`),
    never an input of the command, a folder, or (without --force) any other file."""
    from mergepipe.output.safety import check_file_target, json_record_with
    check_file_target(path, what=what, inputs=inputs, force=getattr(args, "force", False),
                      ours=json_record_with(key))


def _refuse_inside_inputs(path: Path, inputs: list[Path]) -> None:
    """An -o file may not be an input file or lie in an input folder, even with --force
    (`plan -o models/base/model.safetensors --force` replaced the base's weights)."""
    from mergepipe.output.safety import refuse_inside
    refuse_inside(path, inputs)


def _write_record(path: Path, obj: dict) -> None:
    """Write canonical JSON; identical content is only touched, never rewritten.

    The touch tells a build tool that reran this step (the model's mtime changed) that it is
    done; the unchanged bytes tell it, by checksum, that nothing downstream needs to rerun.
    """
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    if path.is_file() and path.read_bytes() == data:
        path.touch()
        return
    from mergepipe.util.fs import atomic_write_bytes
    atomic_write_bytes(path, data)


def _load(args: argparse.Namespace):
    from mergepipe.config.params import load_config
    overrides = {}
    if getattr(args, "budget", None) is not None:
        overrides["budget"] = args.budget
    if getattr(args, "output", None) is not None:
        from mergepipe.output.safety import check_output_path
        overrides["output"] = {"dir": str(check_output_path(args.output))}
    return load_config(args.config, overrides=overrides or None)


def cmd_plan(args: argparse.Namespace) -> int:
    from mergepipe.commands.pipeline import plan_config
    from mergepipe.util.fs import canonical_json
    from mergepipe.index.store import Store
    if args.o:
        _check_overwrite(Path(args.o), args, key="plan_hash", what="plan", inputs=(args.config,))
    from mergepipe.commands.made_from import loaded_with_record
    from mergepipe.plan.record import MADE_FROM, plan_json
    cfg, made_from = loaded_with_record(args.config, lambda: _load(args), budget=args.budget)
    if args.o:
        _refuse_inside_inputs(Path(args.o), _input_paths(cfg))
    plan, _ = plan_config(cfg, Store(cfg.cache_dir), threads=args.threads, quiet=args.quiet)
    data = canonical_json({**plan_json(plan), MADE_FROM: made_from}) + b"\n"  # beside the plan, outside its hash
    if args.o:
        out = Path(args.o)
        if not (out.is_file() and out.read_bytes() == data):  # unchanged content: keep the mtime
            from mergepipe.util.fs import atomic_write_bytes
            atomic_write_bytes(out, data)
    else:
        sys.stdout.write(data.decode())
    b = plan.bytes
    sketches = f" + {_mib(b.planned_sketch_bytes)} of sketches" if b.planned_sketch_bytes else ""
    _log(args, f"plan {plan.plan_hash[:16]} ({plan.strategy_name}): read {_mib(b.planned_expert_bytes)}{sketches} "
               f"of {_mib(b.total_expert_bytes)} expert bytes (budget {plan.budget})"
               + _bound_suffix(plan.bound.model_dump(), "; "))
    return 0


def _bound_suffix(bound: dict, sep: str) -> str:
    from mergepipe.plan.bound_text import bound_line
    line = bound_line(bound)
    return "" if line is None else sep + line


def _report(args: argparse.Namespace, out_dir: Path, man: dict, seconds: float) -> None:
    b = man["bytes"]
    _log(args, f"merged -> {out_dir} ({man['plan']['method']}, plan {man['plan_hash'][:16]}) in {seconds:.2f} s\n"
               f"  expert bytes read {_mib(b['expert_bytes_read'])}"
               + (f" + {_mib(b['sketch_bytes_read'])} of sketches" if b.get("sketch_bytes_read") else "")
               + f" of {_mib(b['total_expert_bytes'])} "
               f"(budget {man['budget']['spec']} = {_mib(man['budget']['bytes'])}); "
               f"base read {_mib(b['base_bytes_read'])}; written {_mib(b['bytes_written'])}"
               + _bound_suffix(man["bound"], "\n  ") + f"\n  manifest {out_dir / 'manifest.json'}")


def _load_plan(path: str, params: str | None = None):
    """The plan in a plan file, checked (plan/load.py); `params`: also refuse it unless it was
    made from that file's current bytes (commands/made_from.py)."""
    from mergepipe.plan.load import read_plan_file
    plan, made_from = read_plan_file(path)
    if params is not None:
        from mergepipe.commands.made_from import check_made_from
        check_made_from(made_from, params, path)
    return plan


def _params_card(args: argparse.Namespace, plan, inputs) -> dict[str, bytes] | None:
    """The card files of the recipe `--params` names (the plan was made from it: the experts in
    its order, its YAML), or None (the card of the plan alone)."""
    if args.params is None:
        return None
    from mergepipe.commands.pipeline import card_recipe, output_card
    from mergepipe.config.params import load_config
    return output_card(plan, inputs, card_recipe(load_config(args.params)))


def cmd_merge(args: argparse.Namespace) -> int:
    from mergepipe.commands.pipeline import merge_plan, open_inputs
    from mergepipe.index.store import Store
    from mergepipe.output.safety import check_output_path
    plan = _load_plan(args.plan, args.params)
    check_output_path(args.o, what="-o")
    if args.part:
        return _merge_part(args, plan)
    store = Store(args.cache_dir)
    t0 = time.monotonic()
    inputs = open_inputs(plan, store, Path(args.root), threads=args.threads, where=args.plan)
    man = merge_plan(plan, inputs, Path(args.o), store, threads=args.threads, progress=not args.quiet,
                     force=args.force, protect=(Path(args.plan),), card=_params_card(args, plan, inputs))
    _report(args, Path(args.o), man, time.monotonic() - t0)
    return 0


def _merge_part(args: argparse.Namespace, plan) -> int:
    from mergepipe.commands.parts import merge_part, parse_part, part_paths
    from mergepipe.commands.pipeline import open_inputs
    from mergepipe.index.store import Store
    i, n = parse_part(args.part)
    store = Store(args.cache_dir)
    t0 = time.monotonic()
    inputs = open_inputs(plan, store, Path(args.root), threads=args.threads, where=args.plan)
    info = merge_part(plan, inputs, Path(args.o), i, n, store, threads=args.threads, progress=not args.quiet,
                      force=args.force)
    what = ("plan is in the store; nothing to merge" if info["from_store"] else
            f"{len(info['tensors'])} tensors, expert bytes read {_mib(sum(info['expert_bytes_read'].values()))}")
    _log(args, f"part {i}/{n} of plan {plan.plan_hash[:16]} -> {part_paths(args.o, i, n)[0]} "
               f"({what}) in {time.monotonic() - t0:.2f} s")
    return 0


def cmd_gather(args: argparse.Namespace) -> int:
    from mergepipe.commands.parts import gather
    from mergepipe.commands.pipeline import open_inputs
    from mergepipe.index.store import Store
    from mergepipe.output.safety import check_output_path
    plan = _load_plan(args.plan, args.params)
    check_output_path(args.o, what="-o")
    from mergepipe.commands.parts import check_parts
    check_parts(args.parts, what=f"--parts {args.parts}")
    store = Store(args.cache_dir)
    t0 = time.monotonic()
    inputs = open_inputs(plan, store, Path(args.root), threads=args.threads, where=args.plan)
    man = gather(plan, inputs, Path(args.parts_dir), args.parts, Path(args.o), store, threads=args.threads,
                 progress=not args.quiet, force=args.force, protect=(Path(args.plan),),
                 card=_params_card(args, plan, inputs))
    _report(args, Path(args.o), man, time.monotonic() - t0)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from mergepipe.commands.gc import collect, keep_of, remove
    keep = keep_of(args.keep)
    foreign: list[Path] = []
    removals = collect(args.cache_dir, keep, indexes=args.indexes, foreign=foreign)
    for p in foreign:
        print(f"keep {p} (its name is a cache entry's, its content is not mergepipe's)")
    for r in removals:
        print(f"{'would remove' if args.dry_run else 'remove'} {r.path} ({_mib(r.freed)})")
    freed = sum(r.freed for r in removals) if args.dry_run else remove(removals)
    _log(args, f"{args.cache_dir}: {'would free' if args.dry_run else 'freed'} {_mib(freed)}; "
               f"kept {len(keep.plans)} referenced merge(s)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from mergepipe.commands import uptodate
    t0 = time.monotonic()
    cli_overrides = {"budget": args.budget, "output": args.output}
    # no-op check first, by the output's run record: no config model, index, plan or torch
    done = uptodate.fast_up_to_date(args.config, cli_overrides, args.output)
    if done is not None:
        from mergepipe.output.publish import clean_dead_writer
        clean_dead_writer(done[0])  # a run killed after its commit left its lock or old version
        _log(args, f"{done[0]}: up to date (plan {done[1][:16]}); "
                   f"nothing to do ({time.monotonic() - t0:.2f} s)")
        return 0
    from mergepipe.output.manifest import verify_outputs
    from mergepipe.commands.pipeline import card_recipe, merge_plan, output_card, plan_config, up_to_date
    from mergepipe.index.store import Store
    cfg = _load(args)
    if cfg.output.adapter is not None:  # one PEFT adapter instead of a model: no index, plan or budget
        return _run_adapter(args, cfg, t0)
    record = uptodate.snapshot(args.config, cli_overrides, _input_paths(cfg))
    store = Store(cfg.cache_dir)
    plan, inputs = plan_config(cfg, store, threads=args.threads, quiet=args.quiet)
    out_dir = Path(cfg.output.dir)
    files = [h.path for ck in (inputs.base, *inputs.experts.values()) for h in ck.files]
    record = uptodate.finish(record, files, out_dir, plan.plan_hash)
    card = output_card(plan, inputs, card_recipe(cfg))  # the experts in the user's order, the recipe's YAML
    if up_to_date(out_dir, plan, card=card):
        from mergepipe.output.publish import clean_dead_writer
        clean_dead_writer(out_dir)
        uptodate.refresh(out_dir, record)  # the next no-op takes the fast check
        _log(args, f"{out_dir}: up to date (plan {plan.plan_hash[:16]}); nothing to do "
                   f"({time.monotonic() - t0:.2f} s)")
        return 0
    man = merge_plan(plan, inputs, out_dir, store, threads=args.threads, progress=not args.quiet,
                     force=args.force, run_record=None if record is None else {uptodate.RECORD: record},
                     protect=(Path(args.config), *_calibration_text(cfg)), card=card)
    verify_outputs(out_dir)
    _report(args, out_dir, man, time.monotonic() - t0)
    return 0


def _run_adapter(args: argparse.Namespace, cfg, t0: float) -> int:
    from mergepipe.commands.adapter_run import run_adapter_output
    out_dir = Path(cfg.output.dir)
    done = run_adapter_output(cfg, force=args.force, protect=(Path(args.config),))
    if done.report is not None and done.report["combination"] == "svd":
        for module, m in done.report["modules"].items():
            _log(args, f"  {module}: rank {m['rank']}, relative error {m['relative_error']:.3e}")
    what = "adapter ->" if done.report is not None else "up to date (adapter):"
    _log(args, f"{what} {out_dir} ({cfg.method}, {cfg.output.adapter.combination}, "
               f"recipe {done.manifest['recipe_hash'][:16]}) in {time.monotonic() - t0:.2f} s\n"
               f"  manifest {out_dir / 'manifest.json'}")
    return 0


def _input_paths(cfg) -> list[Path]:
    """Every file or folder a plan of `cfg` reads besides the cache: the models, the
    tokenizer source, the calibration text (run's no-op record keys on all of them)."""
    from mergepipe.commands.stack import stack_sources
    paths = [cfg.base, *(e.path for e in cfg.experts)]
    paths += sorted({src for m in paths for src in stack_sources(m)})  # a stacked folder's sources
    if cfg.output.tokenizer_dir is not None:
        paths.append(cfg.output.tokenizer_dir)
    return paths + _calibration_text(cfg)


def _calibration_text(cfg) -> list[Path]:
    """The calibrated strategy's text file, if any (an input the output folder may not hold)."""
    text = (cfg.plan_options or {}).get("text")
    return [] if text is None else [cfg.config_path(text)]


def cmd_verify(args: argparse.Namespace) -> int:
    from mergepipe.commands.sign import signature_report, trusted_keys
    from mergepipe.commands.verify import verify
    keys = trusted_keys(args.public_key, signature=args.signature)
    line = verify(Path(args.outdir), deep=args.deep, inputs=args.inputs, replay=args.replay, root=Path(args.root),
                  threads=args.threads)
    signed = signature_report(Path(args.outdir), keys,
                              signature=None if args.signature is None else Path(args.signature))
    print(line if signed is None else f"{line}; {signed}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from mergepipe.commands.audit import audit
    from mergepipe.commands.sign import signature_report, trusted_keys
    keys = trusted_keys(args.public_key, signature=args.signature)
    report = audit(Path(args.outdir), search=[Path(d) for d in args.search], cache_dir=Path(args.cache_dir),
                   recursive=args.recursive, threads=args.threads)
    sys.stdout.write(report.text())
    report.raise_if_failed(Path(args.outdir))
    signature = None if args.signature is None else Path(args.signature)
    signed = signature_report(Path(args.outdir), keys, signature=signature)
    if signed is not None:
        print(f"signature: {signed}")
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    from mergepipe.commands.sign import sign_output
    _log(args, sign_output(Path(args.outdir), Path(args.key), password_env=args.password_env, force=args.force,
                           deep=args.deep, signature=None if args.signature is None else Path(args.signature)))
    return 0


def cmd_provenance(args: argparse.Namespace) -> int:
    from mergepipe.commands.provenance import write_provenance
    _log(args, write_provenance(Path(args.outdir), Path(args.o), key=None if args.key is None else Path(args.key),
                                password_env=args.password_env, force=args.force, deep=args.deep))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from mergepipe.commands.check import check_file
    report = check_file(Path(args.config), budget=args.budget, output=args.output, force=args.force,
                        threads=args.threads, probe=not args.no_probe)
    print(report.text())
    report.raise_if_failed()  # the one line and exit code the merge would give
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from mergepipe.commands.explain import explain
    print(explain(Path(args.target), cache_dir=args.cache_dir, root=args.root, budget=args.budget,
                  threads=args.threads))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from mergepipe.config.mergekit import check_imported, import_mergekit, write_params
    from mergepipe.output.safety import check_file_target, check_output_path
    out = check_output_path(args.o, what="-o")
    check_file_target(Path(args.o), what="params file", inputs=(args.config,), force=args.force)  # none is ours
    stack_dir = _build_stack(args, out) or _build_slice_views(args, out)
    warnings: list[str] = []
    params = import_mergekit(args.config, params_path=out, stack_dir=stack_dir, validate=False, warnings=warnings)
    refs = [params.get("base"), *(e.get("path") for e in params.get("experts", [])),
            (params.get("output") or {}).get("tokenizer_source")]  # relative to the params file's folder
    _refuse_inside_inputs(out, [out.parent / m for m in refs if isinstance(m, str)])
    check_imported(params, source=args.config, params_path=out)
    write_params(params, args.o)
    for line in warnings:  # after the import succeeded: a refusal stays one line
        print(line, file=sys.stderr)
    _log(args, f"wrote {args.o}")
    return 0


def _build_stack(args: argparse.Namespace, out: Path) -> str | None:
    """For a config that stacks layers (mergekit passthrough `slices`): build the stacked model
    folder `<params stem>.stacked/` beside params.yaml (commands/stack.py); its name as params.yaml
    gives it, or None."""
    from mergepipe.config.mergekit import resolve_model_ref, stacking_slices
    from mergepipe.config.params import read_yaml
    source = str(args.config)
    slices = stacking_slices(read_yaml(args.config), source)
    if slices is None:
        return None
    from mergepipe.commands.stack import build_stack
    folders = {s["model"]: resolve_model_ref(s["model"], f"slices[{i}].sources[0].model", source)
               for i, s in enumerate(slices)}  # relative to the working directory, as mergekit reads them
    name = f"{out.stem}.stacked"
    # a slice of the folder being built is not a source (build_stack names it)
    sources = [f for f in folders.values() if f.resolve() != (out.parent / name).resolve()]
    return _build_beside(args, out, name, sources, lambda target, **kw: build_stack(slices, folders, target, **kw),
                         "the stacked model")


def _build_slice_views(args: argparse.Namespace, out: Path) -> str | None:
    """For a config whose slices merge: build each input's stacked view in `<params stem>.slices/`
    beside params.yaml (commands/stack.py); that folder's name as params.yaml gives it, or None."""
    from mergepipe.commands.stack import build_views, slice_views
    found = slice_views(str(args.config), out)
    if found is None:
        return None
    views, folders = found
    return _build_beside(args, out, f"{out.stem}.slices", list(folders.values()),
                         lambda target, **kw: build_views(views, folders, target, **kw), "the stacked views")


def _build_beside(args: argparse.Namespace, out: Path, name: str, sources: list[Path], build, what: str) -> str:
    """Build the folder `name` beside params.yaml `out` from `sources` with `build(target, rerun)`
    (--force is for params.yaml: a folder the import did not write is never replaced); returns `name`."""
    source = str(args.config)
    # params.yaml and the folder beside it never go into a source model (even with --force)
    _refuse_inside_inputs(out, sources)
    _refuse_inside_inputs(out.parent / name, sources)
    try:
        build(out.parent / name,
              rerun=f"mergepipe import-mergekit {shlex.quote(os.path.abspath(source))} "
                    f"-o {shlex.quote(os.path.abspath(out))} --force")
    except ConfigError as e:  # a layer range outside its model: name the config it is in
        raise ConfigError(f"{source}: {e}") from None
    _log(args, f"built {what} {out.parent / name}")
    return name


def cmd_extract_lora(args: argparse.Namespace) -> int:
    from mergepipe.commands.extract_lora import extract_lora, rank_rule
    run = extract_lora(args.expert, args.base, args.o, rule=rank_rule(args.rank, args.energy),
                       keep=args.modules_to_save, embed_lora=args.embed_lora, threads=args.threads,
                       log=lambda line: _log(args, line))
    _log(args, f"{args.o}: {run.factored} modules factored, {run.whole} tensors kept whole, {run.unchanged} "
               f"unchanged (manifest {run.manifest['manifest_hash'][:16]})")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mergepipe.config.params import load_config
    from mergepipe.commands.sweep import (check_sweep_folder, plot_png, require_matplotlib, run_sweep, to_csv,
                                          to_markdown, write_results)
    from mergepipe.units import parse_budget_list
    from mergepipe.output.safety import check_output_path
    check_output_path(args.o, what="-o")
    check_sweep_folder(Path(args.o), force=args.force)
    cfg = load_config(args.config)
    budgets = parse_budget_list(args.budgets)
    if not budgets:
        raise ConfigError(f"--budgets {args.budgets!r}: no budget given; e.g. --budgets 5%,10%,25%,50%,100%")
    if not args.no_plot:
        require_matplotlib()
    out = Path(args.o)
    result = run_sweep(cfg, budgets, out, threads=args.threads, progress=not args.quiet,
                       log=lambda msg: _log(args, msg), protect=(Path(args.config),))
    table = to_markdown(result)
    files = {"sweep.md": table.encode(), "sweep.csv": to_csv(result).encode()}
    if not args.no_plot:
        files["sweep.png"] = plot_png(result, title=f"mergepipe sweep: {Path(args.config).name}")
    check_sweep_folder(out, force=args.force)  # again: the merges took minutes
    write_results(out, files)
    written = list(files)
    print(table, end="")
    _log(args, f"wrote {', '.join(str(out / w) for w in written)}; merged models under {out / 'models'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mergepipe.commands.demo import run
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one `_add_<command>` per subcommand, in the order `--help` lists them."""
    p = argparse.ArgumentParser(prog="mergepipe", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"mergepipe {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", "-q", action="store_true", help="no progress or summaries on stderr")
    common.add_argument("--debug", action="store_true", help="show tracebacks for mergepipe errors")
    common.add_argument("--threads", type=int, default=2, help="reader threads (default 2)")
    sub = p.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub, common)
    return p


def _add_index(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("index", parents=[common], help="index a checkpoint (cached by content)")
    s.add_argument("model", help="model folder (or one .safetensors file) to index")
    s.add_argument("--base", help="also compute delta statistics against this base")
    s.add_argument("--block-bytes", help="block size like '1MiB' (default: params.yaml's default block_bytes)")
    _cache_dir_option(s)
    s.add_argument("--json", action="store_true", help="print the record as JSON instead of a summary line")
    s.add_argument("-o", help="also write the (timing-free) record as JSON here; unchanged content is only touched")
    s.add_argument("--force", action="store_true", help="overwrite an -o file that is not a mergepipe index record")
    s.set_defaults(fn=cmd_index)


def _add_plan(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("plan", parents=[common], help="plan which expert blocks to read")
    s.add_argument("config", help="params.yaml")
    _budget_option(s)
    s.add_argument("-o", help="write the plan here (default: stdout)")
    s.add_argument("--force", action="store_true", help="overwrite an -o file that is not a mergepipe plan")
    s.set_defaults(fn=cmd_plan)


def _add_merge(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("merge", parents=[common], help="execute a plan")
    s.add_argument("plan", help="plan.json written by `mergepipe plan`")
    s.add_argument("-o", required=True, help="output folder")
    _cache_dir_option(s)
    _root_option(s)
    _force_replace_option(s)
    s.add_argument("--part", metavar="I/N", help="merge only part I of N (tensor groups) into folder -o; "
                   "`mergepipe gather` assembles the parts")
    _params_option(s)
    s.set_defaults(fn=cmd_merge)


def _add_gather(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("gather", parents=[common], help="assemble `merge --part` outputs, publish like merge")
    s.add_argument("plan", help="plan.json written by `mergepipe plan`")
    s.add_argument("parts_dir", help="the folder the part jobs wrote to")
    s.add_argument("--parts", type=int, required=True, help="N, the number of parts")
    _params_option(s)
    s.add_argument("-o", required=True, help="output folder")
    _force_replace_option(s)
    _cache_dir_option(s)
    _root_option(s)
    s.set_defaults(fn=cmd_gather)


def _add_gc(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("gc", parents=[common], help="prune the cache: stored merges, part files, calibration and "
                       "joint statistics, indexes")
    _cache_dir_option(s)
    s.add_argument("--keep", action="append", default=[], metavar="OUTDIR|PLAN",
                   help="keep the stored merge of this output folder or plan.json, and the calibration "
                   "and joint statistics it names (repeatable)")
    s.add_argument("--indexes", action="store_true", help="also drop model/delta indexes (models are reread)")
    s.add_argument("--dry-run", "-n", action="store_true", help="only list what would be removed")
    s.set_defaults(fn=cmd_gc)


def _add_run(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("run", parents=[common], help="index + plan + merge + verify, cached")
    s.add_argument("config", help="params.yaml")
    _budget_option(s)
    s.add_argument("-o", "--output", help="output folder (default: output.dir of the config)")
    _force_replace_option(s)
    s.set_defaults(fn=cmd_run)


def _add_verify(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("verify", parents=[common], help="check an output against its manifest (files changed "
                       "since publication are rehashed; --deep rehashes every file)")
    s.add_argument("outdir", help="output folder to check (holding manifest.json)")
    s.add_argument("--deep", action="store_true", help="reread and rehash every output file, even those whose "
                   "stat keys are as published")
    s.add_argument("--inputs", action="store_true", help="also rehash the inputs")
    s.add_argument("--replay", action="store_true", help="also rebuild and compare output hashes")
    s.add_argument("--root", default=".", help="folder that relative input paths in the plan are relative to "
                   "(default: the current folder)")
    _signature_options(s)
    s.set_defaults(fn=cmd_verify)


def _add_audit(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("audit", parents=[common], help="prove how an output was built, anywhere: find its inputs "
                       "by content hash, rehash them, replay the merge and compare; walk its lineage")
    s.add_argument("outdir", help="output folder to audit (holding manifest.json)")
    s.add_argument("--search", action="append", default=[], metavar="DIR", help="a folder to search, "
                   "recursively, for the inputs (repeatable); the Hugging Face cache is searched too")
    s.add_argument("--recursive", "-r", action="store_true", help="also audit each input that is a mergepipe "
                   "output, down to inputs that are not merges")
    s.add_argument("--cache-dir", default=".mergepipe", help="index cache for the searched folders")
    _signature_options(s)
    s.set_defaults(fn=cmd_audit)


def _add_sign(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("sign", parents=[common], help="sign an output folder (OpenSSF model-signing format, "
                       "EC key): OUT/model.sig covers every file, manifest.json included")
    s.add_argument("outdir", help="output folder to sign (it must verify against its manifest)")
    s.add_argument("--key", required=True, metavar="KEY.pem", help="EC private key (P-256, P-384 or P-521), PEM")
    _key_options(s, "replace a signature made with another key")
    s.add_argument("--signature", metavar="PATH", help="where to write it (default OUT/model.sig; else outside OUT)")
    s.set_defaults(fn=cmd_sign)


def _add_provenance(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("provenance", parents=[common], help="write an in-toto SLSA provenance statement of an "
                       "output (subjects: its files; dependencies: its inputs' content hashes; the plan)")
    s.add_argument("outdir", help="output folder (it must verify against its manifest)")
    s.add_argument("-o", required=True, metavar="FILE", help="statement to write (outside OUT)")
    s.add_argument("--key", metavar="KEY.pem", help="sign it (DSSE bundle, as `sign`) with this EC private key")
    _key_options(s, "overwrite an existing -o file")
    s.set_defaults(fn=cmd_provenance)


def _add_check(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("check", parents=[common], help="what a merge of params.yaml (or a mergekit YAML) would "
                       "fail on, and what it would read, write, need and take; reads no weights")
    s.add_argument("config", help="params.yaml, or a mergekit YAML (model paths relative to the current folder)")
    _budget_option(s)
    s.add_argument("-o", "--output", help="output folder (default: output.dir of the config)")
    s.add_argument("--force", action="store_true", help="as run's --force: an output folder mergepipe did not "
                   "write may be replaced")
    s.add_argument("--no-probe", action="store_true", help="do not time a read of a few MiB of the base "
                   "(the time estimate is then unknown)")
    s.set_defaults(fn=cmd_check)


def _add_explain(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("explain", parents=[common], help="readable table of a plan, output or params.yaml: "
                       "bytes, update energy kept per expert, rescale factors, bound")
    s.add_argument("target", help="plan.json, an output folder, or params.yaml (planned first)")
    s.add_argument("--budget", help="with params.yaml: the budget to explain (default: the config's)")
    s.add_argument("--cache-dir", default=None, help="the index store (default: .mergepipe; a params.yaml's own)")
    _root_option(s)
    s.set_defaults(fn=cmd_explain)


def _add_import_mergekit(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("import-mergekit", parents=[common], help="convert a mergekit YAML to params.yaml")
    s.add_argument("config", help="mergekit YAML; its model paths are relative to the current folder, as "
                   "mergekit reads them")
    s.add_argument("-o", required=True, metavar="PARAMS_YAML", help="params file to write: its model paths are "
                   "rewritten relative to its folder, and the merge goes to merged-<its name>/ beside it")
    s.add_argument("--force", action="store_true", help="overwrite an existing -o file")
    s.set_defaults(fn=cmd_import)


def _add_extract_lora(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("extract-lora", parents=[common], help="a PEFT LoRA adapter of BASE from a dense fine-tune: "
                       "truncated SVD of expert - base per module, with each module's retained energy")
    s.add_argument("expert", help="the fine-tuned model folder")
    s.add_argument("--base", required=True, help="the model it was fine-tuned from")
    rank = s.add_mutually_exclusive_group(required=True)
    rank.add_argument("--rank", type=int, help="the rank of every module")
    rank.add_argument("--energy", type=float, help="per module, the smallest rank keeping this fraction of "
                      "||delta||^2 (e.g. 0.9)")
    s.add_argument("-o", required=True, help="the adapter folder to write (a new one, or one extract-lora wrote)")
    s.add_argument("--modules-to-save", nargs="+", default=[], metavar="PATTERN", help="modules kept whole "
                   "(PEFT's rule: the module name ends with PATTERN), e.g. embed_tokens norm")
    s.add_argument("--embed-lora", action="store_true", help="factor changed embeddings too (lora_embedding_A/B; "
                   "default: kept whole)")
    s.set_defaults(fn=cmd_extract_lora)


def _add_sweep(sub, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser("sweep", parents=[common], help="merge at several budgets: table and plot of I/O vs deviation")
    s.add_argument("config", help="params.yaml")
    s.add_argument("--budgets", default="5%,10%,25%,50%,100%", help="comma-separated budgets (default %(default)s)")
    s.add_argument("-o", required=True, help="output folder: sweep.md, sweep.csv, sweep.png, models/")
    s.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    s.add_argument("--force", action="store_true", help="write into an -o folder that is not a previous sweep's "
                   "(its models/<budget> folders are still only replaced where mergepipe wrote them)")
    s.set_defaults(fn=cmd_sweep)


def _add_demo(sub, common: argparse.ArgumentParser) -> None:
    from mergepipe.commands.demo_args import DESCRIPTION, add_arguments
    s = sub.add_parser("demo", help="generate a seeded demo family (base + experts)", description=DESCRIPTION)
    add_arguments(s)
    s.add_argument("--debug", action="store_true", help="show tracebacks for mergepipe errors")
    s.set_defaults(fn=cmd_demo)


_SUBCOMMANDS = (_add_index, _add_plan, _add_merge, _add_gather, _add_gc, _add_run, _add_verify, _add_audit,
                _add_sign, _add_provenance, _add_check, _add_explain, _add_import_mergekit, _add_extract_lora,
                _add_sweep, _add_demo)


def _budget_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--budget", help="override the config's budget: 'full', a percentage (25%%), a fraction (0.25) "
                   "or a size (2GiB)")


def _force_replace_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--force", action="store_true", help="replace an existing output folder even if mergepipe did "
                   "not write it (never /, home, the current folder or one above it, or an input)")


def _params_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--params", metavar="PARAMS_YAML", help="refuse the plan unless `mergepipe plan` made it from "
                   "this file as it is now (not an earlier edit of it); the model card then lists the experts in "
                   "its order and quotes it")


def _cache_dir_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--cache-dir", default=".mergepipe", help="index, plan and merge cache (default %(default)s)")


def _root_option(s: argparse.ArgumentParser) -> None:
    s.add_argument("--root", default=".", help="folder that relative input paths in the plan are relative to")


def _signature_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--public-key", action="append", default=[], metavar="PUB.pem", help="check the folder's "
                   "signature (OUT/model.sig) against this trusted public key (repeatable: any one of them)")
    s.add_argument("--signature", metavar="PATH", help="the signature to check, if not OUT/model.sig")


def _key_options(s: argparse.ArgumentParser, force_help: str) -> None:
    s.add_argument("--password-env", metavar="VAR", help="environment variable holding the key's password")
    s.add_argument("--force", action="store_true", help=force_help)
    s.add_argument("--deep", action="store_true", help="reread every file against the manifest first, even those "
                   "whose stat keys are as published")


def one_line(text: str) -> str:
    """The error as one line: newlines and terminal escapes from hostile names shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: list[str] | None = None) -> int:
    from mergepipe.output.publish import terminate_unwinds
    from mergepipe.util.gcpause import rare_gc
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["demo", "--"]:  # `demo -- OPTIONS`, the form the help once gave: `--help` is no folder name
        del argv[1]
    args = build_parser().parse_args(argv)
    try:
        with terminate_unwinds(), rare_gc():  # SIGTERM/SIGHUP clean up (temp folders, locks) like Ctrl-C
            return args.fn(args)
    except MergepipeError as e:
        if args.debug:
            raise
        print(f"mergepipe: error: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        import signal
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"mergepipe: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
