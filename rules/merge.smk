# The merge, as one job or (merge_parts > 1) as independent part jobs plus a gather;
# both publish the same bytes; an adapter output (output.adapter) is one `mergepipe run`. A plan merged before is restored from CACHE/merges.
# --params: a plan made from other bytes of params.yaml (edited while the plan job ran)
# is refused, never merged under the edited file.

if ADAPTER_OUT:
    if PARTS > 1:
        raise WorkflowError(f"{PARAMS}: output.adapter is combined in one job; merge_parts={PARTS} splits a model "
                            "merge only: drop --config merge_parts")

    # The adapters combined into one adapter of the base: `mergepipe run` reads the adapters and
    # the base's headers (its weight files are inputs: a changed tensor table reruns it).
    rule merge:
        input:
            params=PARAMS,
            base=lambda wildcards: model_files(BASE),
            adapters=lambda wildcards: [f for a in ADAPTERS for f in model_files(a)],
        output:
            files=OUT_WEIGHTS,
            manifest=OUT_MANIFEST,
        params:
            version=VERSION,
            out=OUT,
        log:
            "logs/merge.log",
        shell:
            "mergepipe run {input.params:q} -o {params.out:q} 2>&1 | tee {log:q}"

elif PARTS <= 1:

    rule merge:
        input:
            plan=PLAN,
        output:
            weights=OUT_WEIGHTS,
            manifest=OUT_MANIFEST,
        params:
            version=VERSION,
            out=OUT,
            cache=CACHE,
            root=ROOT,
            config=PARAMS,
        log:
            "logs/merge.log",
        threads: 4
        shell:
            "mergepipe merge {input.plan:q} -o {params.out:q} --cache-dir {params.cache:q} --root {params.root:q} "
            "--params {params.config:q} --threads {threads} 2>&1 | tee {log:q}"

else:

    rule merge_part:
        input:
            plan=PLAN,
        output:
            part=temp(f"{PARTS_DIR}/part-{{part}}-of-{PARTS}.safetensors"),
            record=temp(f"{PARTS_DIR}/part-{{part}}-of-{PARTS}.json"),
        params:
            version=VERSION,
            parts_dir=PARTS_DIR,
            parts=PARTS,
            cache=CACHE,
            root=ROOT,
            config=PARAMS,
        log:
            f"logs/merge/part-{{part}}-of-{PARTS}.log",
        threads: 2
        shell:
            "mergepipe merge {input.plan:q} --part {wildcards.part}/{params.parts} -o {params.parts_dir:q} "
            "--cache-dir {params.cache:q} --root {params.root:q} --params {params.config:q} --threads {threads} "
            "2>&1 | tee {log:q}"

    rule gather:
        input:
            plan=PLAN,
            parts=expand(f"{PARTS_DIR}/part-{{part}}-of-{PARTS}.{{ext}}", part=range(1, PARTS + 1),
                         ext=["safetensors", "json"]),
        output:
            weights=OUT_WEIGHTS,
            manifest=OUT_MANIFEST,
        params:
            version=VERSION,
            out=OUT,
            parts_dir=PARTS_DIR,
            parts=PARTS,
            cache=CACHE,
            root=ROOT,
            config=PARAMS,
        log:
            "logs/merge.log",
        threads: 2
        shell:
            "mergepipe gather {input.plan:q} {params.parts_dir:q} --parts {params.parts} -o {params.out:q} "
            "--cache-dir {params.cache:q} --root {params.root:q} --params {params.config:q} --threads {threads} "
            "2>&1 | tee {log:q}"
