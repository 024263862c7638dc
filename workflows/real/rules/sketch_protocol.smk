# Issue 12's evaluation protocol for plan strategy `sketch` against `energy` on SmolLM2-135M:
# 4 tasks, >= 300 test examples per task, 2 fine-tuning seeds (config smollm.sketch_protocol).
# One screen per seed (smollm-strategy-screen: dev log-lik + held-out KL for every (method,
# strategy, budget), test accuracy where asked), then the mean over seeds (smollm-strategy-seeds)
# and EVAL.md's sketch section (sketch-report). Merges and scores are cached under each family's
# strategies/ folder by manifest hash, so a rerun only merges and rescores what changed.
SP = SM["sketch_protocol"]
SP_RECIPE = SM["recipes"][SP["recipe"]]
SP_RESULT = "workflows/real/results/strategies_smollm4_sketch_s{pseed}.json"
SP_SEEDS_RESULT = "workflows/real/results/strategies_smollm4_sketch_seeds.json"
SP_ARGS = {k: ",".join(SP[k]) for k in ("tasks", "methods", "strategies", "budgets", "test_budgets",
                                          "test_energy_budgets")}


rule sketch_protocol_screen:
    input:
        base=SM_BASE + "/model.safetensors",
        experts=lambda w: expand(W + "/smollm/" + SP["recipe"] + "/s{s}/experts/{t}/model/model.safetensors",
                                 s=w.pseed, t=SP["tasks"]),
        calib=W + "/smollm/calib/calib.txt",
        heldout=W + "/smollm/calib/heldout.txt",
    output:
        SP_RESULT,
    wildcard_constraints:
        pseed=r"\d+",
    params:
        family=lambda w: f"{W}/smollm/{SP['recipe']}/s{w.pseed}",
        dev=" ".join(f"--dev-per-class {t}={n}" for t, n in SP["dev_per_class"].items()),
        test=" ".join(f"--test-per-class {t}={n}" for t, n in SP["test_per_class"].items()),
        seen=SP_RECIPE["steps"] * SP_RECIPE["batch_size"],
        experts=lambda w: "" if int(w.pseed) in SP["experts_seeds"] else "--no-test-experts",
    log:
        LOGS + "/sketch_protocol_screen_s{pseed}.log",
    shell:
        "MERGEPIPE_EVAL_THREADS=2 nice -n 10 {PY} -m mergepipe_eval smollm-strategy-screen"
        " --family {params.family} --base {SM_BASE} --tasks-root {W}/tasks"
        " --calib {input.calib} --heldout {input.heldout} --out {output}"
        " --tasks {SP_ARGS[tasks]} --methods {SP_ARGS[methods]} --strategies {SP_ARGS[strategies]}"
        " --budgets {SP_ARGS[budgets]} --test-budgets {SP_ARGS[test_budgets]} --test-strategies sketch"
        " --test-energy-budgets {SP_ARGS[test_energy_budgets]} --test-methods {SP_ARGS[methods]}"
        " {params.dev} {params.test} --seen {params.seen} --train-seed {wildcards.pseed}"
        " --heldout-seqs {SS[heldout_seqs]} --heldout-len {SS[heldout_len]} {params.experts} > {log} 2>&1"


rule sketch_protocol_seeds:
    input:
        expand(SP_RESULT, pseed=SP["seeds"]),
    output:
        SP_SEEDS_RESULT,
    params:
        results=lambda w, input: " ".join(f"--result {r}" for r in input),
    log:
        LOGS + "/sketch_protocol_seeds.log",
    shell:
        "{PY} -m mergepipe_eval smollm-strategy-seeds {params.results} --methods {SP_ARGS[methods]}"
        " --strategies {SP_ARGS[strategies]} --budgets {SP_ARGS[budgets]} --out {output} > {log} 2>&1"


# EVAL.md's sketch section: the protocol (per seed and mean), the earlier 3-task SmolLM2
# screens and the MiniLM screens (committed results, run by hand: workflows/real/sketch_notes.md)
SP_EARLIER = ["workflows/real/results/strategies_smollm_sketch.json",
              "workflows/real/results/strategies_smollm_sketch_ties.json",
              "workflows/real/results/strategies_smollm_sketch_s1.json"]
SP_MINILM = ["workflows/real/results/strategies_minilm_sketch_s0.json",
             "workflows/real/results/strategies_minilm_sketch_s1.json"]


rule sketch_report:
    input:
        protocol=expand(SP_RESULT, pseed=SP["seeds"]),
        seeds=SP_SEEDS_RESULT,
        earlier=SP_EARLIER,
        minilm=SP_MINILM,
        minilm_seeds="workflows/real/results/strategies_minilm_sketch_seeds.json",
        notes="workflows/real/sketch_notes.md",
    output:
        plot="workflows/real/sketch.png",
    params:
        args=lambda w, input: " ".join([*(f"--protocol {r}" for r in input.protocol),
                                        *(f"--smollm {r}" for r in input.earlier),
                                        *(f"--minilm {r}" for r in input.minilm)]),
    log:
        LOGS + "/sketch_report.log",
    shell:
        "{PY} -m mergepipe_eval sketch-report {params.args} --protocol-seeds {input.seeds}"
        " --minilm-seeds {input.minilm_seeds} --notes {input.notes} --plot {output.plot} --markdown EVAL.md > {log} 2>&1"
