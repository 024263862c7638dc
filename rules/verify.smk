# Rehash the published output against its manifest; the report is the target of `all`.


rule verify:
    input:
        weights=OUT_WEIGHTS,
        manifest=OUT_MANIFEST,
    output:
        report=VERIFIED,
    params:
        version=VERSION,
        out=OUT,
    log:
        "logs/verify.log",
    shell:
        "mergepipe verify {params.out:q} 2>&1 > {output.report:q} | tee {log:q}"
