import json
import re
import shutil
import sys

W = config["work"]
LOGS = config["logs"]
TASKS = list(config["tasks"])
RECIPES = list(config["recipes"])
SEEDS = [int(s) for s in config["seeds"]]
MERGES = config["merges"]
BUDGETS = config["budgets"]
# the interpreter running Snakemake has mergepipe and mergepipe_eval (run from the repo root)
PY = sys.executable
FAMILY = W + "/minilm/{recipe}/s{seed}"


wildcard_constraints:
    task="|".join(TASKS),
    recipe="|".join(RECIPES),
    merge="|".join(re.escape(m) for m in MERGES),
    budget="|".join(BUDGETS),
    seed=r"\d+",


def recipe_json(wildcards):
    return json.dumps(config["recipes"][wildcards.recipe], sort_keys=True)


def expert_models(wildcards):
    return [f"{W}/minilm/{wildcards.recipe}/s{wildcards.seed}/experts/{t}/model/model.safetensors"
            for t in TASKS]


def expert_args(wildcards):
    return " ".join(f"--expert {t}={W}/minilm/{wildcards.recipe}/s{wildcards.seed}/experts/{t}/model"
                    for t in TASKS)


def task_args():
    return " ".join(f"--task {t}={W}/tasks/{t}" for t in TASKS)


def head_args(wildcards):
    return " ".join(f"--head {t}={W}/minilm/{wildcards.recipe}/s{wildcards.seed}/experts/{t}/head.safetensors"
                    for t in TASKS)


def heads(wildcards):
    return [f"{W}/minilm/{wildcards.recipe}/s{wildcards.seed}/experts/{t}/head.safetensors"
            for t in TASKS]


def merge_budgets(merge):
    return MERGES[merge].get("budgets", list(BUDGETS))


def all_scores():
    out = []
    for recipe in RECIPES:
        for seed in SEEDS:
            fam = f"{W}/minilm/{recipe}/s{seed}/scores"
            out.append(f"{fam}/base.json")
            out += [f"{fam}/expert_{t}.json" for t in TASKS]
            out += [f"{fam}/{m}/{b}.json" for m in MERGES for b in merge_budgets(m)]
    out += [f"{W}/minilm/probes/{t}.json" for t in TASKS]
    return out
