"""The merged folder's README.md is a card the Hub reads (mergekit's shape: front matter with
base_model, library_name and tags; the method; the models merged; the configuration as YAML),
experts by name (the order a params.yaml lists them changes no byte), naming a stack's real
source models, with every byte read and a usage
snippet; an imported mergekit recipe is kept as mergekit_config.yml. Byte-stable."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from mergepipe.cli import main
from mergepipe.output.manifest import load_manifest
from mergepipe.output.run_record import record_path
from tests.helpers import write_config


def _front(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def _yaml_blocks(text: str) -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```$", text, re.S | re.M)]


def _out(params: Path) -> Path:
    out = Path(yaml.safe_load(params.read_text())["output"]["dir"])
    return out if out.is_absolute() else params.parent / out


def _card(tmp_path, family, name, **overrides):
    d = tmp_path / name
    d.mkdir()
    cfg = write_config(d, family, method="ties", parameters={"density": 0.5}, **overrides)
    assert main(["run", str(cfg), "-q"]) == 0
    return (d / "out" / "README.md").read_text(), yaml.safe_load(cfg.read_text())


def test_card_front_matter_names_every_input_by_name_whatever_the_list_order(tiny_family, tmp_path):
    text, cfg = _card(tmp_path, tiny_family, "a")
    front = _front(text)
    assert front["base_model_relation"] == "merge" and front["library_name"] == "transformers"
    assert front["tags"] == ["merge", "mergepipe"]
    by_name = sorted(cfg["experts"], key=lambda e: e["name"])
    assert front["base_model"] == [cfg["base"], *(e["path"] for e in by_name)]
    again, _ = _card(tmp_path, tiny_family, "b")  # own cache: built again, not restored
    assert again.replace(str(tmp_path / "b"), str(tmp_path / "a")) == text
    rev = list(reversed(cfg["experts"]))
    reordered, _ = _card(tmp_path, tiny_family, "c", experts=rev, cache_dir=str(tmp_path / "a" / "cache"))
    assert reordered.replace(str(tmp_path / "c"), str(tmp_path / "a")) == text  # the list order changes no byte
    rows = [line.split("|")[2].strip() for line in reordered.splitlines() if line.startswith("| `")]
    assert rows == [e["name"] for e in by_name]
    a, c = load_manifest(tmp_path / "a" / "out"), load_manifest(tmp_path / "c" / "out")
    assert a["plan_hash"] == c["plan_hash"] and a["outputs"]["tensors"] == c["outputs"]["tensors"]
    # c was restored from a's store entry (hard links): its card was replaced, a's and the store's kept
    assert "restored_from" in json.loads(record_path(tmp_path / "c" / "out").read_text())
    assert (tmp_path / "a" / "out" / "README.md").read_text() == text
    for out in (tmp_path / "a" / "out", tmp_path / "c" / "out"):
        assert main(["verify", str(out), "--deep", "-q"]) == 0
    assert (tmp_path / "a" / "cache" / "merges" / a["plan_hash"] / "README.md").read_text() == text


def test_card_recipe_is_yaml_that_reproduces_the_plan(tiny_family, tmp_path, capsys):
    text, cfg = _card(tmp_path, tiny_family, "a")
    (recipe,) = _yaml_blocks(text)
    assert recipe["method"] == "ties" and [e["name"] for e in recipe["experts"]] == ["e0", "e1", "e2"]
    assert "cache_dir" not in recipe and "dir" not in recipe.get("output", {})  # nothing of this machine
    recipe["output"] = {"dir": str(tmp_path / "again")}
    recipe["cache_dir"] = cfg["cache_dir"]
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", str(tmp_path / "again.yaml"), "-q"]) == 0
    assert load_manifest(tmp_path / "again")["plan_hash"] == load_manifest(tmp_path / "a" / "out")["plan_hash"]
    assert 'from_pretrained(path, dtype="auto")' in text and "AutoModelForCausalLM" in text
    capsys.readouterr()
    assert main(["run", str(tmp_path / "a" / "params.yaml")]) == 0  # and the rerun is a no-op
    assert "up to date" in capsys.readouterr().err


def test_card_counts_the_sketch_bytes_read(tiny_family, tmp_path):
    text, _ = _card(tmp_path, tiny_family, "s", budget="20%", plan={"strategy": "sketch"})
    b = load_manifest(tmp_path / "s" / "out")["plan"]["bytes"]
    assert b["planned_sketch_bytes"] > 0
    assert (f"read {b['planned_expert_bytes']:,} of {b['total_expert_bytes']:,} expert bytes and "
            f"{b['planned_sketch_bytes']:,} bytes of sketches") in text


def test_a_stacks_card_names_its_source_models(tmp_path, tiny_family):
    root = Path(tiny_family["root"])
    mk = tmp_path / "frankenmerge.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "dtype": "float32", "slices": [
        {"sources": [{"model": str(root / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(root / "expert_1"), "layer_range": [2, 4]}]}]}))
    params = tmp_path / "params.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    data = yaml.safe_load(params.read_text())
    data["cache_dir"] = str(tmp_path / "cache")
    params.write_text(yaml.safe_dump(data))
    assert main(["run", str(params), "-q"]) == 0
    text = (_out(params) / "README.md").read_text()
    assert _front(text)["base_model"] == [str(root / "base"), str(root / "expert_1")]
    assert f"* `{root / 'base'}`: layers 0 to 2" in text and f"* `{root / 'expert_1'}`: layers 2 to 3" in text
    assert "params.stacked" not in text.split("---\n")[1]


def test_an_imported_recipe_keeps_its_mergekit_yaml(tmp_path, tiny_family):
    root = Path(tiny_family["root"])
    mk = tmp_path / "ties.yml"
    mk_text = (f"# my recipe\nmerge_method: ties\nbase_model: {root / 'base'}\nmodels:\n"
               f"  - model: {root / 'expert_0'}\n    parameters: {{weight: 0.6, density: 0.5}}\n"
               f"  - model: {root / 'expert_1'}\n    parameters: {{weight: 0.4, density: 0.5}}\n"
               "dtype: bfloat16\n")
    mk.write_text(mk_text)
    params = tmp_path / "params.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    assert main(["run", str(params), "-q"]) == 0
    out = _out(params)
    assert (out / "mergekit_config.yml").read_text() == mk_text  # mergekit writes its recipe there too
    text = (out / "README.md").read_text()
    mergekit, ours = _yaml_blocks(text)
    assert mergekit == yaml.safe_load(mk_text) and "# my recipe" in text
    assert ours["method"] == "ties" and "mergekit_config" not in json.dumps(ours)
    assert "mergekit_config.yml" in load_manifest(out)["outputs"]["files"]
    assert main(["verify", str(out), "-q"]) == 0


def test_a_plan_merged_without_its_recipe_gets_the_plans_configuration(tiny_family, tmp_path):
    cfg = write_config(tmp_path, tiny_family, method="ties", parameters={"density": 0.5})
    assert main(["plan", str(cfg), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    assert main(["merge", str(tmp_path / "plan.json"), "-o", str(tmp_path / "m"), "--root", str(tmp_path),
                 "--cache-dir", str(tmp_path / "cache"), "-q"]) == 0
    text = (tmp_path / "m" / "README.md").read_text()
    (config,) = _yaml_blocks(text)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert config["method"] == "ties" and config["budget"] == plan["budget"]
    assert sorted(_front(text)["base_model"][1:]) == sorted(e["path"] for e in plan["experts"])


def test_a_plan_merged_with_its_params_gets_the_card_run_writes(tiny_family, tmp_path):
    """Snakemake's merge and gather pass --params: the card is the one `run` writes."""
    text, cfg = _card(tmp_path, tiny_family, "a", experts=list(reversed(yaml.safe_load(
        write_config(tmp_path, tiny_family).read_text())["experts"])))
    params = tmp_path / "a" / "params.yaml"
    assert main(["plan", str(params), "-o", str(tmp_path / "plan.json"), "-q"]) == 0
    assert main(["merge", str(tmp_path / "plan.json"), "-o", str(tmp_path / "m"), "--root", str(tmp_path / "a"),
                 "--cache-dir", cfg["cache_dir"], "--params", str(params), "-q"]) == 0
    assert (tmp_path / "m" / "README.md").read_text() == text
    assert [e["name"] for e in _yaml_blocks(text)[0]["experts"]] == ["e0", "e1", "e2"]  # by name, not as listed
