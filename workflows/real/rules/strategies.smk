# Plan strategies side by side (issue 12): energy vs balanced vs compensated, task arithmetic
# lambda 0.5 and TIES at 10/25/50%, paired against the full read on the MiniLM `probe`
# family, seed 0 (mergepipe_eval/strategies.py). Merges and per-example scores are cached
# under the family's strategies/ folder, so a rerun only rescores what changed.


rule strategy_screen:
    input:
        models=expand(W + "/minilm/probe/s0/experts/{task}/model/model.safetensors", task=TASKS),
        heads=expand(W + "/minilm/probe/s0/experts/{task}/head.safetensors", task=TASKS),
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=TASKS),
    output:
        "workflows/real/results/strategies_minilm.json",
    log:
        LOGS + "/strategy_screen.log",
    shell:
        "nice {PY} -m mergepipe_eval strategy-screen --family {W}/minilm/probe/s0 --base {W}/minilm/base"
        " --tasks-root {W}/tasks --out {output}"
        " --strategies energy,balanced,compensated,compensated_balanced > {log} 2>&1"
