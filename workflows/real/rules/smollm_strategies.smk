# Issue 12 on SmolLM2-135M: plan strategies (energy, calibrated, balanced, compensated) x
# methods x budgets, paired against each method's full read (mergepipe_eval/smollm_screen.py).
# The calibration text and the held-out text are Debian text in no task split
# (mergepipe_eval/calib.py; the same `fortunes` and `wordnet-base` packages the install rule
# apt-gets). Merges and per-model scores are cached under the family's strategies/ folder,
# keyed by manifest hash, so a rerun only merges and rescores what changed.
SS = SM["strategy_screen"]
SS_FAMILY = W + "/smollm/" + SS["recipe"] + "/s0"
SS_RECIPE = SM["recipes"][SS["recipe"]]


rule smollm_calib_text:
    input:
        W + "/installed.json",
        expand(W + "/tasks/{task}/test.jsonl", task=TASKS),
    output:
        calib=W + "/smollm/calib/calib.txt",
        heldout=W + "/smollm/calib/heldout.txt",
        info=W + "/smollm/calib/texts.json",
    log:
        LOGS + "/smollm_calib_text.log",
    shell:
        "{PY} -m mergepipe_eval calib-text --tasks-root {W}/tasks --out $(dirname {output.calib}) > {log} 2>&1"


rule smollm_strategy_screen:
    input:
        base=SM_BASE + "/model.safetensors",
        experts=expand(SS_FAMILY + "/experts/{t}/model/model.safetensors", t=SM_TASKS),
        calib=W + "/smollm/calib/calib.txt",
        heldout=W + "/smollm/calib/heldout.txt",
    output:
        "workflows/real/results/strategies_smollm.json",
    params:
        dev=" ".join(f"--dev-per-class {t}={n}" for t, n in SS["dev_per_class"].items()),
        test=" ".join(f"--test-per-class {t}={n}" for t, n in SM["tasks"].items()),
        seen=SS_RECIPE["steps"] * SS_RECIPE["batch_size"],
        methods=",".join(SS["methods"]),
        strategies=",".join(SS["strategies"]),
        budgets=",".join(SS["budgets"]),
        test_budgets=",".join(SS["test_budgets"]),
        test_methods=",".join(SS["test_methods"]),
    log:
        LOGS + "/smollm_strategy_screen.log",
    shell:
        "MERGEPIPE_EVAL_THREADS=2 nice -n 19 {PY} -m mergepipe_eval smollm-strategy-screen"
        " --family {SS_FAMILY} --base {SM_BASE} --tasks-root {W}/tasks"
        " --calib {input.calib} --heldout {input.heldout} --out {output}"
        " --methods {params.methods} --strategies {params.strategies} --budgets {params.budgets}"
        " --test-budgets {params.test_budgets} --test-methods {params.test_methods} {params.dev} {params.test} --seen {params.seen}"
        " --heldout-seqs {SS[heldout_seqs]} --heldout-len {SS[heldout_len]} > {log} 2>&1"


# The EVAL.md section alone (the full `report` rule also rebuilds it, but needs every SmolLM2
# accuracy score of rules/smollm.smk): splices the section between its markers in EVAL.md.
rule smollm_strategy_report:
    input:
        result="workflows/real/results/strategies_smollm.json",
        extra=SS.get("extra_results", []),
        notes="workflows/real/smollm_strategies_notes.md",
    output:
        plot="workflows/real/strategies_smollm.png",
    params:
        extra=" ".join(f"--result {r}" for r in SS.get("extra_results", [])),
    log:
        LOGS + "/smollm_strategy_report.log",
    shell:
        "{PY} -m mergepipe_eval smollm-strategy-report --result {input.result} {params.extra} --markdown workflows/real/EVAL.generated.md"
        " --notes {input.notes} --plot {output.plot} > {log} 2>&1"
