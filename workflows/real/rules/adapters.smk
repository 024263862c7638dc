# Issue 25 item 6: LoRA adapters of SmolLM2-135M against the dense `sft30` experts of the same
# tasks and seeds (config smollm.adapters). One adapter per (seed, task) (smollm-lora-train), then
# one adapter-eval per seed (merges, merged adapters, extraction; scored per example, paired), then
# the EVAL section (adapter-report). Merges and scores are cached under each seed's eval/ folder by
# manifest hash, so a rerun only merges and rescores what changed.
AD = SM["adapters"]
AD_LORA = W + "/smollm/lora/s{aseed}"
AD_RESULT = "workflows/real/results/adapters_smollm_s{aseed}.json"


AD_PINNED = W + "/mergepipe-built/" + AD["mergepipe"]


# mergepipe as of the commit config names (the checkout is edited while the merges run): its
# package exported and every C kernel built in place with setup.py's flags
rule adapters_mergepipe:
    output:
        W + "/mergepipe-built/{commit}/built.json",
    wildcard_constraints:
        commit=r"[0-9a-f]{7,40}",
    log:
        LOGS + "/adapters_mergepipe_{commit}.log",
    shell:
        "(d=$(dirname {output}) && rm -rf $d && mkdir -p $d && git archive {wildcards.commit} mergepipe setup.py"
        " | tar -x -C $d && cd $d && {PY} setup.py -q build_ext --inplace"
        " && echo '{{\"commit\": \"{wildcards.commit}\"}}' > built.json) > {log} 2>&1"


def ad_dense(seed):
    return f"{W}/smollm/{AD['dense_recipe']}/s{seed}"


rule smollm_lora_train:
    input:
        base=SM_BASE + "/model.safetensors",
        task=W + "/tasks/{atask}/task.json",
    output:
        adapter=AD_LORA + "/{atask}/adapter/adapter_model.safetensors",
        info=AD_LORA + "/{atask}/train.json",
    wildcard_constraints:
        aseed=r"\d+",
        atask="|".join(AD["tasks"]),
    params:
        recipe=json.dumps(AD["recipe"], sort_keys=True),
        out=lambda w: f"{W}/smollm/lora/s{w.aseed}/{w.atask}",
    log:
        LOGS + "/smollm_lora_train_s{aseed}_{atask}.log",
    shell:
        "{PY} -m mergepipe_eval smollm-lora-train --base $(dirname {input.base})"
        " --task-dir $(dirname {input.task}) --out {params.out} --recipe '{params.recipe}'"
        " --seed {wildcards.aseed} > {log} 2>&1"


rule adapter_eval:
    input:
        base=SM_BASE + "/model.safetensors",
        dense=lambda w: [f"{ad_dense(w.aseed)}/experts/{t}/model/model.safetensors" for t in AD["tasks"]],
        lora=lambda w: [f"{W}/smollm/lora/s{w.aseed}/{t}/adapter/adapter_model.safetensors" for t in AD["tasks"]],
        tasks=expand(W + "/tasks/{task}/test.jsonl", task=AD["tasks"]),
        mergepipe=AD_PINNED + "/built.json",
    output:
        AD_RESULT,
    wildcard_constraints:
        aseed=r"\d+",
    params:
        dense=lambda w: ad_dense(w.aseed),
        lora=lambda w: f"{W}/smollm/lora/s{w.aseed}",
        test=" ".join(f"--test-per-class {t}={n}" for t, n in AD["test_per_class"].items()),
        tasks=",".join(AD["tasks"]),
        methods=",".join(AD["methods"]),
        budgets=",".join(AD["budgets"]),
        svd=",".join(str(r) for r in AD["svd_ranks"]),
        extract=",".join(str(r) for r in AD["extract_ranks"]),
    log:
        LOGS + "/adapter_eval_s{aseed}.log",
    shell:
        "PYTHONSAFEPATH=1 PYTHONPATH={AD_PINNED}:$PWD MERGEPIPE_EVAL_MERGEPIPE_COMMIT={AD[mergepipe]}"
        " MERGEPIPE_EVAL_THREADS=2 nice -n 10 {PY} -m mergepipe_eval adapter-eval --dense {params.dense}"
        " --lora {params.lora} --base {SM_BASE} --tasks-root {W}/tasks --out {output}"
        " --tasks {params.tasks} {params.test} --methods {params.methods} --budgets {params.budgets}"
        " --out-method {AD[out_method]} --svd-ranks {params.svd} --extract-ranks {params.extract}"
        " --seed {wildcards.aseed} > {log} 2>&1"


# the section is spliced into EVAL.generated.md; EVAL.md quotes it
rule adapter_report:
    input:
        expand(AD_RESULT, aseed=AD["seeds"]),
    output:
        touch(W + "/adapter_report.done"),
    params:
        results=lambda w, input: " ".join(f"--result {r}" for r in input),
    log:
        LOGS + "/adapter_report.log",
    shell:
        "{PY} -m mergepipe_eval adapter-report {params.results} --markdown workflows/real/EVAL.generated.md > {log} 2>&1"
