# One index per model, cached by content in CACHE: a touched but unchanged model is
# rehashed once and its record (index/...json) keeps its bytes, so nothing downstream
# reruns on a later call; a new expert indexes only that expert.


rule index_base:
    input:
        weights=lambda wildcards: model_files(BASE),
    output:
        record="index/base.json",
    params:
        version=VERSION,
        model=BASE,
        block_bytes=BLOCK_BYTES,
        cache=CACHE,
    log:
        "logs/index/base.log",
    threads: 4
    shell:
        "mergepipe index {params.model:q} --block-bytes {params.block_bytes} --cache-dir {params.cache:q} "
        "--threads {threads} -o {output.record:q} 2>&1 | tee {log:q}"


rule index_expert:
    input:
        weights=lambda wildcards: model_files(EXPERTS[wildcards.expert]),
        base="index/base.json",
    output:
        record="index/experts/{expert}.json",
    params:
        version=VERSION,
        model=lambda wildcards: EXPERTS[wildcards.expert],
        base=BASE,
        block_bytes=BLOCK_BYTES,
        cache=CACHE,
    log:
        "logs/index/{expert}.log",
    threads: 4
    shell:
        "mergepipe index {params.model:q} --base {params.base:q} --block-bytes {params.block_bytes} "
        "--cache-dir {params.cache:q} --threads {threads} -o {output.record:q} 2>&1 | tee {log:q}"
