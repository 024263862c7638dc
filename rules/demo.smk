# The demo family that the committed params.yaml merges (only used when params.yaml
# names models under demo_dir). MERGEPIPE_DEMO_PRESET (tiny|small|bench, default small)
# picks its size when it is generated; the content is what the later steps track.


checkpoint demo:
    output:
        family=directory(DEMO_DIR),
    params:
        experts=DEMO_EXPERTS,
    log:
        "logs/demo.log",
    shell:
        "mergepipe demo {output.family:q} --preset ${{MERGEPIPE_DEMO_PRESET:-small}} "
        "--experts {params.experts} > {log:q} 2>&1"
