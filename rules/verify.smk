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
        "mergepipe verify {params.out:q} > {output.report:q} 2> {log:q}"
