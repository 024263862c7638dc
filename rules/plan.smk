# The plan: which expert blocks to read under the budget. Its hash covers the inputs'
# content hashes, method, parameters, budget and version. The plan file also records the
# blake3 of the params bytes it was made from (made_from), which is this rule's param too:
# the plan is rebuilt whenever params.yaml's bytes differ from those, whatever the mtimes.


rule plan:
    input:
        params=PARAMS,
        base="index/base.json",
        experts=expand("index/experts/{expert}.json", expert=EXPERTS),
    output:
        plan=PLAN,
    params:
        version=VERSION,
        made_from=PARAMS_HASH,
    log:
        "logs/plan.log",
    shell:
        "mergepipe plan {input.params:q} -o {output.plan:q} 2>&1 | tee {log:q}"
