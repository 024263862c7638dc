# The plan: which expert blocks to read under the budget. Its hash covers the inputs'
# content hashes, method, parameters, budget and version; plans/plan.json is rewritten
# only when that content changes, so an edit that changes nothing reruns nothing after it.


rule plan:
    input:
        params=PARAMS,
        base="index/base.json",
        experts=expand("index/experts/{expert}.json", expert=EXPERTS),
    output:
        plan=PLAN,
    params:
        version=VERSION,
    log:
        "logs/plan.log",
    shell:
        "mergepipe plan {input.params:q} -o {output.plan:q} > {log:q} 2>&1"
