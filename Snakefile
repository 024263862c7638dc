# mergepipe as a build: index each model, plan the reads under the budget, merge, verify.
#
#   snakemake merged/model.safetensors     # profiles/default: cores: all
#   snakemake                              # ... and verify (logs/verify.txt)
#   snakemake --profile profiles/slurm     # the merge split into parts on a cluster
#
# params.yaml is the one description of the merge (also DVC's params file); the rules
# only call the `mergepipe` CLI. See docs/workflow.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "params.yaml"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/index.smk"
include: "rules/plan.smk"
include: "rules/merge.smk"
include: "rules/verify.smk"


localrules:
    all,
    demo,
    plan,


rule all:
    input:
        VERIFIED,
