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


def sp_experts(w):
    return expand(W + "/smollm/" + SP["recipe"] + "/s{s}/experts/{t}/model/model.safetensors",
                  s=w.pseed, t=SP["tasks"])


# The main screens (SP["methods"]). Their committed results ran an export of ec69cdf; their merges
# and scores are cached in the work folder only, so a rebuilt work folder's newer experts must not
# rerun them (ancient): about 40 min per seed. Delete the result JSON to run them again.
rule sketch_protocol_screen:
    input:
        base=ancient(SM_BASE + "/model.safetensors"),
        experts=lambda w: [ancient(p) for p in sp_experts(w)],
        calib=ancient(W + "/smollm/calib/calib.txt"),
        heldout=ancient(W + "/smollm/calib/heldout.txt"),
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


# Later invocations (config sketch_protocol.extra_runs: methods the main screens did not run), one
# result JSON per (run, seed); the merges run mergepipe as of `mergepipe` (an export of that
# commit, rule sketch_protocol_mergepipe) when given, else the checkout's.
SP_EXTRA = SP.get("extra_runs", {})
SP_EXTRA_RESULT = "workflows/real/results/strategies_smollm4_sketch_{run}_s{pseed}.json"
SP_EXTRA_RESULTS = [SP_EXTRA_RESULT.format(run=r, pseed=s) for r in SP_EXTRA for s in SP["seeds"]]
SP_ALL_METHODS = list(dict.fromkeys([*(m for r in SP_EXTRA.values() for m in r["methods"]), *SP["methods"]]))
SP_METHODS_ARG = ",".join(SP_ALL_METHODS)


def sp_score_experts(seed: int) -> bool:
    """An extra run scores a seed's experts alone if experts_seeds asks and its main result lacks them."""
    if seed not in SP["experts_seeds"]:
        return False
    main = Path(SP_RESULT.format(pseed=seed))
    return not (main.exists() and json.loads(main.read_text())["test"].get("experts"))


def sp_pinned(run):
    commit = SP_EXTRA[run].get("mergepipe")
    return f"{W}/mergepipe-pinned/{commit}" if commit else None


rule sketch_protocol_mergepipe:
    output:
        W + "/mergepipe-pinned/{commit}/built.json",
    wildcard_constraints:
        commit=r"[0-9a-f]{7,40}",
    log:
        LOGS + "/sketch_protocol_mergepipe_{commit}.log",
    shell:
        # the package as of that commit, its C extension built with pyproject's flags
        "(d=$(dirname {output}) && rm -rf $d/mergepipe && mkdir -p $d && git archive {wildcards.commit} mergepipe"
        " | tar -x -C $d && cd $d && {PY} -c 'from setuptools import setup, Extension; setup(name=\"mp_pinned\","
        " ext_modules=[Extension(\"mergepipe.methods._bf16c\", [\"mergepipe/methods/_bf16c.c\"],"
        " extra_compile_args=[\"-O3\", \"-ffp-contract=off\", \"-fno-fast-math\"])],"
        " script_args=[\"build_ext\", \"--inplace\"])'"
        " && echo '{{\"commit\": \"{wildcards.commit}\"}}' > built.json) > {log} 2>&1"


rule sketch_protocol_extra_screen:
    input:
        base=SM_BASE + "/model.safetensors",
        experts=sp_experts,
        calib=W + "/smollm/calib/calib.txt",
        heldout=W + "/smollm/calib/heldout.txt",
        mergepipe=lambda w: [sp_pinned(w.run) + "/built.json"] if sp_pinned(w.run) else [],
    output:
        SP_EXTRA_RESULT,
    wildcard_constraints:
        pseed=r"\d+",
        run="|".join(re.escape(r) for r in SP_EXTRA) or "no-extra-run",
    params:
        family=lambda w: f"{W}/smollm/{SP['recipe']}/s{w.pseed}",
        methods=lambda w: ",".join(SP_EXTRA[w.run]["methods"]),
        dev=" ".join(f"--dev-per-class {t}={n}" for t, n in SP["dev_per_class"].items()),
        test=" ".join(f"--test-per-class {t}={n}" for t, n in SP["test_per_class"].items()),
        seen=SP_RECIPE["steps"] * SP_RECIPE["batch_size"],
        experts=lambda w: "" if sp_score_experts(int(w.pseed)) else "--no-test-experts",
        env=lambda w: (f"PYTHONSAFEPATH=1 PYTHONPATH={sp_pinned(w.run)}:$PWD "
                       f"MERGEPIPE_EVAL_MERGEPIPE_COMMIT={SP_EXTRA[w.run]['mergepipe']}" if sp_pinned(w.run) else ""),
    log:
        LOGS + "/sketch_protocol_screen_{run}_s{pseed}.log",
    shell:
        "{params.env} MERGEPIPE_EVAL_THREADS=2 nice -n 10 {PY} -m mergepipe_eval smollm-strategy-screen"
        " --family {params.family} --base {SM_BASE} --tasks-root {W}/tasks"
        " --calib {input.calib} --heldout {input.heldout} --out {output}"
        " --tasks {SP_ARGS[tasks]} --methods {params.methods} --strategies {SP_ARGS[strategies]}"
        " --budgets {SP_ARGS[budgets]} --test-budgets {SP_ARGS[test_budgets]} --test-strategies sketch"
        " --test-energy-budgets {SP_ARGS[test_energy_budgets]} --test-methods {params.methods}"
        " {params.dev} {params.test} --seen {params.seen} --train-seed {wildcards.pseed}"
        " --heldout-seqs {SS[heldout_seqs]} --heldout-len {SS[heldout_len]} {params.experts} > {log} 2>&1"


# mean over seeds: each seed's main result and its extra runs' (merged per family)
rule sketch_protocol_seeds:
    input:
        expand(SP_RESULT, pseed=SP["seeds"]),
        SP_EXTRA_RESULTS,
        keep=[SP["keep_seeds"]] if SP.get("keep_seeds") else [],
    output:
        SP_SEEDS_RESULT,
    params:
        results=lambda w, input: " ".join(f"--result {r}" for r in input if r not in input.keep),
        keep=lambda w, input: " ".join(f"--keep {r}" for r in input.keep),
    log:
        LOGS + "/sketch_protocol_seeds.log",
    shell:
        "{PY} -m mergepipe_eval smollm-strategy-seeds {params.results} --methods {SP_METHODS_ARG}"
        " --strategies {SP_ARGS[strategies]} --budgets {SP_ARGS[budgets]} {params.keep} --out {output} > {log} 2>&1"


# EVAL.md's sketch section: the protocol (per seed and mean), the earlier 3-task SmolLM2
# screens and the MiniLM screens (committed results, run by hand: workflows/real/sketch_notes.md)
SP_EARLIER = ["workflows/real/results/strategies_smollm_sketch.json",
              "workflows/real/results/strategies_smollm_sketch_ties.json",
              "workflows/real/results/strategies_smollm_sketch_s1.json"]
SP_MINILM = ["workflows/real/results/strategies_minilm_sketch_s0.json",
             "workflows/real/results/strategies_minilm_sketch_s1.json"]


rule sketch_report:
    input:
        protocol=expand(SP_RESULT, pseed=SP["seeds"]) + SP_EXTRA_RESULTS,
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
        " --minilm-seeds {input.minilm_seeds} --notes {input.notes} --plot {output.plot} --markdown workflows/real/EVAL.generated.md > {log} 2>&1"
