# Plan strategies side by side (issue 12): energy vs balanced vs compensated (and compensated
# with select: balanced), task arithmetic lambda 0.5 and TIES, paired against the full read on
# the MiniLM `probe` family (mergepipe_eval/strategies.py): seed 0 at 10/25/50%, seed 1 at
# 10/25%, then the mean over both seeds. Merges and per-example scores are cached under each
# family's strategies/ folder, so a rerun only rescores what changed.

STRATEGY_LIST = "energy,balanced,compensated,compensated_balanced"


def _family_inputs(seed):
    return {
        "models": expand(W + "/minilm/probe/s{seed}/experts/{task}/model/model.safetensors", seed=seed, task=TASKS),
        "heads": expand(W + "/minilm/probe/s{seed}/experts/{task}/head.safetensors", seed=seed, task=TASKS),
        "tasks": expand(W + "/tasks/{task}/test.jsonl", task=TASKS),
    }


rule strategy_screen:
    input:
        **_family_inputs(0),
    output:
        "workflows/real/results/strategies_minilm.json",
    log:
        LOGS + "/strategy_screen_s0.log",
    shell:
        "nice {PY} -m mergepipe_eval strategy-screen --family {W}/minilm/probe/s0 --base {W}/minilm/base"
        " --tasks-root {W}/tasks --out {output} --strategies {STRATEGY_LIST} > {log} 2>&1"


rule strategy_screen_seed1:
    input:
        **_family_inputs(1),
    output:
        "workflows/real/results/strategies_minilm_s1.json",
    log:
        LOGS + "/strategy_screen_s1.log",
    shell:
        "nice {PY} -m mergepipe_eval strategy-screen --family {W}/minilm/probe/s1 --base {W}/minilm/base"
        " --tasks-root {W}/tasks --out {output} --budgets 10%,25% --strategies {STRATEGY_LIST} > {log} 2>&1"


rule strategy_seeds:
    input:
        "workflows/real/results/strategies_minilm.json",
        "workflows/real/results/strategies_minilm_s1.json",
    output:
        "workflows/real/results/strategies_minilm_seeds.json",
    log:
        LOGS + "/strategy_seeds.log",
    shell:
        "{PY} -m mergepipe_eval strategy-seeds --family {W}/minilm/probe/s0 --family {W}/minilm/probe/s1"
        " --budgets 10%,25% --strategies {STRATEGY_LIST} --out {output} > {log} 2>&1"
