# SmolLM2-135M-Instruct: GGUF -> bf16 base, 3 fine-tuned experts, mergepipe merges, scores.
# Own wildcard names (stask, srecipe, sseed, smerge, sbudget): the MiniLM rules constrain theirs.
SM = config["smollm"]
SM_TASKS = list(SM["tasks"])
SM_RECIPES = list(SM["recipes"])
SM_SEEDS = [int(s) for s in SM["seeds"]]
SM_MERGES = SM["merges"]
SM_BASE = W + "/smollm/base"
SM_FAMILY = W + "/smollm/{srecipe}/s{sseed}"


def sm_family(w):
    return f"{W}/smollm/{w.srecipe}/s{w.sseed}"


def sm_expert_models(w):
    return [f"{sm_family(w)}/experts/{t}/model/model.safetensors" for t in SM_TASKS]


def sm_expert_args(w):
    return " ".join(f"--expert {t}={sm_family(w)}/experts/{t}/model" for t in SM_TASKS)


def sm_task_args():
    return " ".join(f"--task {t}={W}/tasks/{t} --per-class {t}={n}"
                    for t, n in SM["tasks"].items())


def sm_budgets(merge):
    return SM_MERGES[merge].get("budgets", list(BUDGETS))


def sm_all_scores():
    out = []
    for recipe in SM.get("report_recipes", SM_RECIPES):
        for seed in SM_SEEDS:
            fam = f"{W}/smollm/{recipe}/s{seed}/scores"
            out.append(f"{fam}/base.json")
            out += [f"{fam}/expert_{t}.json" for t in SM_TASKS]
            out += [f"{fam}/{m}/{b}.json" for m in SM_MERGES for b in sm_budgets(m)]
    return out


SM_CONSTRAINTS = dict(
    # the sketch protocol's tasks train with the same rule (verb_cat besides the 3 above)
    stask="|".join(dict.fromkeys(SM_TASKS + list(SM.get("sketch_protocol", {}).get("tasks", [])))),
    srecipe="|".join(SM_RECIPES),
    sseed=r"\d+",
    smerge="|".join(re.escape(m) for m in SM_MERGES),
    sbudget="|".join(BUDGETS),
)


rule smollm_install:
    output:
        W + "/installed_smollm.json",
    log:
        LOGS + "/smollm_install.log",
    shell:
        "{PY} -m mergepipe_eval install --smollm --out {output} > {log} 2>&1"


rule smollm_base:
    input:
        W + "/installed_smollm.json",
    output:
        model=SM_BASE + "/model.safetensors",
        config=SM_BASE + "/config.json",
    log:
        LOGS + "/smollm_base.log",
    shell:
        "{PY} -m mergepipe_eval smollm-base --out $(dirname {output.model}) > {log} 2>&1"


rule smollm_train:
    input:
        base=SM_BASE + "/model.safetensors",
        task=W + "/tasks/{stask}/task.json",
    output:
        model=SM_FAMILY + "/experts/{stask}/model/model.safetensors",
        info=SM_FAMILY + "/experts/{stask}/train.json",
    params:
        recipe=lambda w: json.dumps(SM["recipes"][w.srecipe], sort_keys=True),
        out=lambda w: f"{sm_family(w)}/experts/{w.stask}",
    wildcard_constraints:
        **SM_CONSTRAINTS,
    log:
        LOGS + "/smollm_train_{srecipe}_s{sseed}_{stask}.log",
    shell:
        "{PY} -m mergepipe_eval smollm-train --base $(dirname {input.base})"
        " --task-dir $(dirname {input.task}) --out {params.out} --recipe '{params.recipe}'"
        " --seed {wildcards.sseed} > {log} 2>&1"


rule smollm_score_base:
    input:
        model=SM_BASE + "/model.safetensors",
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=SM_TASKS),
    output:
        SM_FAMILY + "/scores/base.json",
    params:
        tasks=sm_task_args(),
        max_text_tokens=SM["max_text_tokens"],
        meta=lambda w: json.dumps({"recipe": w.srecipe, "seed": int(w.sseed), "kind": "base"}),
    wildcard_constraints:
        **SM_CONSTRAINTS,
    log:
        LOGS + "/smollm_score_{srecipe}_s{sseed}_base.log",
    shell:
        "{PY} -m mergepipe_eval smollm-score --base {SM_BASE} --model {SM_BASE}"
        " {params.tasks} --max-text-tokens {params.max_text_tokens} --meta '{params.meta}'"
        " --out {output} > {log} 2>&1"


rule smollm_score_expert:
    input:
        model=SM_FAMILY + "/experts/{stask}/model/model.safetensors",
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=SM_TASKS),
    output:
        SM_FAMILY + "/scores/expert_{stask}.json",
    params:
        tasks=sm_task_args(),
        max_text_tokens=SM["max_text_tokens"],
        meta=lambda w: json.dumps({"recipe": w.srecipe, "seed": int(w.sseed), "kind": "expert",
                                   "expert": w.stask}),
    wildcard_constraints:
        **SM_CONSTRAINTS,
    log:
        LOGS + "/smollm_score_{srecipe}_s{sseed}_expert_{stask}.log",
    shell:
        "{PY} -m mergepipe_eval smollm-score --base {SM_BASE} --model $(dirname {input.model})"
        " {params.tasks} --max-text-tokens {params.max_text_tokens} --meta '{params.meta}'"
        " --out {output} > {log} 2>&1"


rule smollm_merge_config:
    input:
        base=SM_BASE + "/model.safetensors",
        experts=sm_expert_models,
    output:
        SM_FAMILY + "/configs/{smerge}.yaml",
    params:
        experts=sm_expert_args,
        method=lambda w: SM_MERGES[w.smerge]["method"],
        parameters=lambda w: json.dumps(SM_MERGES[w.smerge].get("parameters", {}), sort_keys=True),
        block_bytes=lambda w: SM_MERGES[w.smerge].get("block_bytes", "1MiB"),
        output_dir=lambda w: f"{sm_family(w)}/merges/{w.smerge}/full",
        cache_dir=W + "/mergepipe-cache",
    wildcard_constraints:
        **SM_CONSTRAINTS,
    log:
        LOGS + "/smollm_config_{srecipe}_s{sseed}_{smerge}.log",
    shell:
        "{PY} -m mergepipe_eval merge-config --base {SM_BASE} {params.experts}"
        " --method {params.method} --parameters '{params.parameters}' --seed {wildcards.sseed}"
        " --block-bytes {params.block_bytes} --output-dir {params.output_dir}"
        " --cache-dir {params.cache_dir} --out {output} > {log} 2>&1"


rule smollm_merge:
    input:
        config=SM_FAMILY + "/configs/{smerge}.yaml",
        experts=sm_expert_models,
    output:
        model=SM_FAMILY + "/merges/{smerge}/{sbudget}/model.safetensors",
        manifest=SM_FAMILY + "/merges/{smerge}/{sbudget}/manifest.json",
    params:
        budget=lambda w: BUDGETS[w.sbudget],
    wildcard_constraints:
        **SM_CONSTRAINTS,
    log:
        LOGS + "/smollm_merge_{srecipe}_s{sseed}_{smerge}_{sbudget}.log",
    shell:
        "{PY} -m mergepipe run {input.config} --budget {params.budget} -q --threads 1"
        " -o $(dirname {output.model}) > {log} 2>&1"


rule smollm_score_merge:
    input:
        model=SM_FAMILY + "/merges/{smerge}/{sbudget}/model.safetensors",
        manifest=SM_FAMILY + "/merges/{smerge}/{sbudget}/manifest.json",
        reference=lambda w: (f"{sm_family(w)}/merges/"
                             f"{SM_MERGES[w.smerge].get('reference', w.smerge)}/full/model.safetensors"),
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=SM_TASKS),
    output:
        SM_FAMILY + "/scores/{smerge}/{sbudget}.json",
    params:
        tasks=sm_task_args(),
        max_text_tokens=SM["max_text_tokens"],
        meta=lambda w: json.dumps({"recipe": w.srecipe, "seed": int(w.sseed), "kind": "merge",
                                   "merge": w.smerge, "method": SM_MERGES[w.smerge]["method"],
                                   "parameters": SM_MERGES[w.smerge].get("parameters", {}),
                                   "block_bytes": SM_MERGES[w.smerge].get("block_bytes", "1MiB"),
                                   "budget": BUDGETS[w.sbudget], "budget_tag": w.sbudget,
                                   "reference": SM_MERGES[w.smerge].get("reference", w.smerge)},
                                  sort_keys=True),
    wildcard_constraints:
        **SM_CONSTRAINTS,
    log:
        LOGS + "/smollm_score_{srecipe}_s{sseed}_{smerge}_{sbudget}.log",
    shell:
        "{PY} -m mergepipe_eval smollm-score --base {SM_BASE} --model $(dirname {input.model})"
        " --reference $(dirname {input.reference}) {params.tasks}"
        " --max-text-tokens {params.max_text_tokens} --meta '{params.meta}'"
        " --out {output} > {log} 2>&1"


rule smollm_scores:
    input:
        sm_all_scores(),
