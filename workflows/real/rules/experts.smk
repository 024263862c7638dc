rule train:
    input:
        base=W + "/minilm/base/model.safetensors",
        task=W + "/tasks/{task}/task.json",
        probe=W + "/minilm/probes/{task}.safetensors",
    output:
        model=FAMILY + "/experts/{task}/model/model.safetensors",
        head=FAMILY + "/experts/{task}/head.safetensors",
        info=FAMILY + "/experts/{task}/train.json",
    params:
        recipe=recipe_json,
        out=lambda w: f"{W}/minilm/{w.recipe}/s{w.seed}/experts/{w.task}",
    log:
        LOGS + "/train_{recipe}_s{seed}_{task}.log",
    shell:
        "{PY} -m mergepipe_eval train --base $(dirname {input.base}) --task-dir $(dirname {input.task})"
        " --out {params.out} --recipe '{params.recipe}' --seed {wildcards.seed}"
        " --probe-head {input.probe} > {log} 2>&1"


rule score_expert:
    input:
        model=FAMILY + "/experts/{task}/model/model.safetensors",
        heads=heads,
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=TASKS),
    output:
        FAMILY + "/scores/expert_{task}.json",
    params:
        tasks=task_args(),
        heads=head_args,
        meta=lambda w: json.dumps({"recipe": w.recipe, "seed": int(w.seed), "kind": "expert",
                                   "expert": w.task}),
    log:
        LOGS + "/score_{recipe}_s{seed}_expert_{task}.log",
    shell:
        "{PY} -m mergepipe_eval score --base {W}/minilm/base --model $(dirname {input.model})"
        " {params.tasks} {params.heads} --meta '{params.meta}' --out {output} > {log} 2>&1"


rule score_base:
    input:
        model=W + "/minilm/base/model.safetensors",
        heads=heads,
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=TASKS),
    output:
        FAMILY + "/scores/base.json",
    params:
        tasks=task_args(),
        heads=head_args,
        meta=lambda w: json.dumps({"recipe": w.recipe, "seed": int(w.seed), "kind": "base"}),
    log:
        LOGS + "/score_{recipe}_s{seed}_base.log",
    shell:
        "{PY} -m mergepipe_eval score --base {W}/minilm/base --model {W}/minilm/base"
        " {params.tasks} {params.heads} --meta '{params.meta}' --out {output} > {log} 2>&1"
