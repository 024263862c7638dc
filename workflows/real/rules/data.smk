rule install:
    output:
        W + "/installed.json",
    log:
        LOGS + "/install.log",
    shell:
        "{PY} -m mergepipe_eval install --out {output} > {log} 2>&1"


rule task:
    input:
        W + "/installed.json",
    output:
        meta=W + "/tasks/{task}/task.json",
        train=W + "/tasks/{task}/train.jsonl",
        test=W + "/tasks/{task}/test.jsonl",
    params:
        sizes=lambda w: config["tasks"][w.task],
        out=lambda w: f"{W}/tasks/{w.task}",
    log:
        LOGS + "/task_{task}.log",
    shell:
        "{PY} -m mergepipe_eval task {wildcards.task} --out {params.out}"
        " --train-per-class {params.sizes[train_per_class]}"
        " --test-per-class {params.sizes[test_per_class]} > {log} 2>&1"


rule base:
    input:
        W + "/installed.json",
    output:
        W + "/minilm/base/model.safetensors",
    log:
        LOGS + "/base.log",
    shell:
        "{PY} -m mergepipe_eval base --out $(dirname {output}) > {log} 2>&1"


rule probe:
    input:
        base=W + "/minilm/base/model.safetensors",
        task=W + "/tasks/{task}/task.json",
    output:
        head=W + "/minilm/probes/{task}.safetensors",
        info=W + "/minilm/probes/{task}.json",
    params:
        max_len=config["max_len"],
    log:
        LOGS + "/probe_{task}.log",
    shell:
        "{PY} -m mergepipe_eval probe --base $(dirname {input.base}) --task-dir $(dirname {input.task})"
        " --out {output.head} --max-len {params.max_len} > {log} 2>&1"
