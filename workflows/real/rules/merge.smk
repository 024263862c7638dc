rule merge_config:
    input:
        base=W + "/minilm/base/model.safetensors",
        experts=expert_models,
    output:
        FAMILY + "/configs/{merge}.yaml",
    params:
        experts=expert_args,
        method=lambda w: MERGES[w.merge]["method"],
        parameters=lambda w: json.dumps(MERGES[w.merge].get("parameters", {}), sort_keys=True),
        block_bytes=lambda w: MERGES[w.merge].get("block_bytes", "1MiB"),
        output_dir=lambda w: f"{W}/minilm/{w.recipe}/s{w.seed}/merges/{w.merge}/full",
        cache_dir=W + "/mergepipe-cache",
    log:
        LOGS + "/config_{recipe}_s{seed}_{merge}.log",
    shell:
        "{PY} -m mergepipe_eval merge-config --base {W}/minilm/base {params.experts}"
        " --method {params.method} --parameters '{params.parameters}' --seed {wildcards.seed}"
        " --block-bytes {params.block_bytes} --output-dir {params.output_dir}"
        " --cache-dir {params.cache_dir} --out {output} > {log} 2>&1"


rule merge:
    input:
        config=FAMILY + "/configs/{merge}.yaml",
        experts=expert_models,
    output:
        model=FAMILY + "/merges/{merge}/{budget}/model.safetensors",
        manifest=FAMILY + "/merges/{merge}/{budget}/manifest.json",
    params:
        budget=lambda w: BUDGETS[w.budget],
    log:
        LOGS + "/merge_{recipe}_s{seed}_{merge}_{budget}.log",
    shell:
        "{PY} -m mergepipe run {input.config} --budget {params.budget} -q --threads 1"
        " -o $(dirname {output.model}) > {log} 2>&1"


rule score_merge:
    input:
        model=FAMILY + "/merges/{merge}/{budget}/model.safetensors",
        manifest=FAMILY + "/merges/{merge}/{budget}/manifest.json",
        reference=lambda w: (f"{W}/minilm/{w.recipe}/s{w.seed}/merges/"
                             f"{MERGES[w.merge].get('reference', w.merge)}/full/model.safetensors"),
        heads=heads,
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=TASKS),
    output:
        FAMILY + "/scores/{merge}/{budget}.json",
    params:
        tasks=task_args(),
        heads=head_args,
        meta=lambda w: json.dumps({"recipe": w.recipe, "seed": int(w.seed), "kind": "merge",
                                   "merge": w.merge, "method": MERGES[w.merge]["method"],
                                   "parameters": MERGES[w.merge].get("parameters", {}),
                                   "block_bytes": MERGES[w.merge].get("block_bytes", "1MiB"),
                                   "budget": BUDGETS[w.budget], "budget_tag": w.budget,
                                   "reference": MERGES[w.merge].get("reference", w.merge)},
                                  sort_keys=True),
    log:
        LOGS + "/score_{recipe}_s{seed}_{merge}_{budget}.log",
    shell:
        "{PY} -m mergepipe_eval score --base {W}/minilm/base --model $(dirname {input.model})"
        " --reference $(dirname {input.reference}) {params.tasks} {params.heads}"
        " --meta '{params.meta}' --out {output} > {log} 2>&1"
