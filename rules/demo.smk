# The demo family that the committed params.yaml merges (only used when params.yaml
# names models under demo_dir): demo_dir/base and expert_0 .. expert_<demo_experts - 1>,
# exactly the rule's outputs, so a path under demo_dir it does not make is refused at
# parse time (rules/common.smk), never generated. MERGEPIPE_DEMO_PRESET (tiny|small|bench,
# default small) picks its size when it is generated; the content is what the later steps
# track. `mergepipe demo` also writes demo_dir/.mergepipe-demo, its record of what it wrote.


checkpoint demo:
    output:
        family=[directory(f"{DEMO_DIR}/{model}") for model in DEMO_FAMILY],
    params:
        folder=DEMO_DIR,
        experts=len(DEMO_FAMILY) - 1,
    log:
        "logs/demo.log",
    shell:
        "mergepipe demo {params.folder:q} --preset ${{MERGEPIPE_DEMO_PRESET:-small}} "
        "--experts {params.experts} 2>&1 | tee {log:q}"
