"""The workflow's files hold together: thin rules, profiles, dvc.yaml, envs, the workflow extra.

Fast checks of the text; the builds themselves are in test_workflow.py, test_workflow_dvc.py
and test_slurm.py.
"""
from __future__ import annotations

import configparser
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RULE_FILES = sorted((REPO / "rules").glob("*.smk"))


def _rules(text: str) -> dict[str, str]:
    """rule or checkpoint name -> its body (up to the next one)."""
    parts = re.split(r"^\s*(?:rule|checkpoint) (\w+):\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_rule_files_are_the_layout_ones():
    assert {p.name for p in RULE_FILES} >= {"common.smk", "index.smk", "plan.smk", "merge.smk", "verify.smk"}
    snakefile = (REPO / "Snakefile").read_text()
    assert 'configfile: "params.yaml"' in snakefile and "min_version(" in snakefile
    for p in RULE_FILES:
        assert f'include: "rules/{p.name}"' in snakefile


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_rules_are_thin(path):
    for name, body in _rules(path.read_text()).items():
        assert "run:" not in body, f"{path.name}:{name}: run: block"
        assert re.search(r"^\s+log:\s*$", body, re.M), f"{path.name}:{name}: no log"
        assert re.search(r"^\s+(input|output):\s*$", body, re.M), f"{path.name}:{name}: no named inputs/outputs"
        shell = re.search(r"^\s+shell:\s*\n((?:\s+\".*\"\n?)+)", body, re.M)
        assert shell, f"{path.name}:{name}: no shell"
        command = "".join(re.findall(r"\"(.*)\"", shell.group(1)))
        assert command.startswith("mergepipe ") and command.count("mergepipe ") == 1, command
        assert "{log" in command, f"{path.name}:{name}: the log is not written"


def test_common_validates_the_config_before_anything_else():
    text = (REPO / "rules" / "common.smk").read_text()
    assert text.index("validate(config") < text.index("BASE =")
    assert "../schemas/params.schema.yaml" in text and (REPO / "schemas" / "params.schema.yaml").is_file()


def test_profiles():
    default = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    assert default["cores"] == "all"
    assert default["max-checksum-file-size"] == 0  # see the comment there: DVC replaces outputs
    slurm = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    assert slurm["executor"] == "slurm"
    local = yaml.safe_load((REPO / "profiles" / "local-cluster" / "config.yaml").read_text())
    assert local["executor"] == "cluster-generic"
    for key in ("cluster-generic-submit-cmd", "cluster-generic-cancel-cmd"):
        script = REPO / local[key]
        assert script.is_file() and os.access(script, os.X_OK), script


def test_dvc_stages_call_snakemake_targets():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        assert stage["cmd"].startswith("snakemake "), name  # the steps are defined once, in the Snakefile
    build = stages["build"]
    assert build["cmd"] == "snakemake ${output.dir}/manifest.json"
    assert {"Snakefile", "rules", "mergepipe", "models"} <= set(build["deps"])
    assert build["params"] == [{"params.yaml": None}]
    assert build["outs"] == [{"${output.dir}": {"persist": True}}]  # DVC must not delete a user's folder there
    ignored = (REPO / ".dvcignore").read_text().split()
    assert {"__pycache__/", ".snakemake/", ".mergepipe/", "run.json"} <= set(ignored)
    config = configparser.ConfigParser()
    config.read(REPO / ".dvc" / "config")
    assert config["core"]["analytics"] == "false"


def test_envs_pin_what_nodes_run():
    env = yaml.safe_load((REPO / "envs" / "mergepipe.yaml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip = next(d for d in env["dependencies"] if isinstance(d, dict))["pip"]
    assert pip == ["-r requirements.txt"]
    pins = dict(line.split("==") for line in (REPO / "envs" / "requirements.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=\[ ]", d)[0].lower() for d in project["dependencies"]}
    needed |= {"snakemake", "snakemake-executor-plugin-slurm", "snakemake-executor-plugin-cluster-generic"}
    assert needed <= set(pins), needed - set(pins)
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in pins.values())
    workflow = " ".join(project["optional-dependencies"]["workflow"])
    for name in ("snakemake>=9.27,<9.28", "snakemake-executor-plugin-cluster-generic",
                 "snakemake-executor-plugin-slurm", "dvc>=3.67"):
        assert name in workflow
