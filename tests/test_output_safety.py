"""Output safety (output/safety.py): one owner answers "may I write here?", and where the copies
it replaced disagreed, the safer answer holds for every command."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.cli import main
from mergepipe.commands.stack import SOURCES_FILE, source_stats
from mergepipe.errors import OutputError
from mergepipe.output import safety
from tests.helpers import stacked_project, file_tree, one_line_error, write_config
from mergepipe.output.run_record import record_path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mergepipe"
OWNER = PACKAGE / "output" / "safety.py"
# what only the owner defines: its public questions and the rules behind them
RULES = {"check_output_path", "overlaps", "refuse_overlap", "refuse_inside", "inside_output", "replaceable",
         "check_replace", "check_file_target", "check_output_folder", "_protected", "_not_ours", "_at_or_inside",
         "_manifest_removed", "_our_card", "_edited", "_legacy_record"}
# path containment outside the owner, each a read-side question: a weight file's link stays in its
# model folder (checkpoint/safetensors.py), the nearest existing folder for a free-space estimate
CONTAINMENT_ELSEWHERE = {"checkpoint/safetensors.py", "commands/check_predict.py"}
CONTAINMENT = re.compile(r"\.is_relative_to\(|\bin [\w.()\[\]]+\.parents\b")
# the owner's refusals, which no other raise words (part files, signatures and adapters have their own)
REFUSALS = ("output folder overlaps", "an input of this command", "or pass --force to replace it",
            "that mergepipe did not write", "output path is", "is inside an input")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_but_the_owner_defines_an_output_safety_rule():
    defined = [(path, node.name) for path, text in _sources().items() if path != "output/safety.py"
               for node in ast.walk(ast.parse(text))
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in RULES]
    assert defined == []


def test_no_module_but_the_owner_compares_output_paths_or_words_a_refusal():
    contained = [path for path, text in _sources().items()
                 if path != "output/safety.py" and path not in CONTAINMENT_ELSEWHERE and CONTAINMENT.search(text)]
    assert contained == []
    worded = [(path, phrase) for path, text in _sources().items() if path != "output/safety.py"
              for raised in ast.walk(ast.parse(text)) if isinstance(raised, ast.Raise)
              for node in ast.walk(raised) if isinstance(node, ast.Constant) and isinstance(node.value, str)
              for phrase in REFUSALS if phrase in node.value]
    assert worded == []


def test_the_workflow_asks_the_owner_and_decides_nothing_itself():
    files = [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]
    rules = {p.name: p.read_text(encoding="utf-8") for p in files}
    assert "from mergepipe.output.safety import replaceable" in rules["common.smk"]
    for name, text in rules.items():
        assert not CONTAINMENT.search(text), name
        assert "mergepipe.output.publish" not in text, name
        assert not any(phrase in text for phrase in REFUSALS), name


def test_the_owner_imports_nothing_above_util_at_module_level():
    """config/paths asks `overlaps` at load time (the one upward import, tests/test_layers.py)."""
    tree = ast.parse(OWNER.read_text(encoding="utf-8"))
    top = [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module]
    ours = [m for m in top if m.startswith("mergepipe")]
    assert ours and all(m == "mergepipe.errors" or m.startswith("mergepipe.util") for m in ours), ours


def test_publish_s_names_are_the_owner_s():
    from mergepipe.output import publish
    assert publish.check_output_path is safety.check_output_path and publish.replaceable is safety.replaceable


def test_a_file_inside_an_input_is_refused_and_beside_it_is_not(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for inside in (model, model / "model.safetensors", model / "sub" / "x.json"):
        with pytest.raises(OutputError, match="an input of this command"):
            safety.refuse_inside(inside, [model])
    safety.refuse_inside(tmp_path / "model.json", [model])
    safety.refuse_inside(tmp_path / "model2" / "x", [model])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _stacked(tiny_family, tmp_path: Path) -> tuple[Path, Path]:
    """(source model, a stacked base recording it as its source): the stack's record only."""
    src = _copy(Path(tiny_family["base"]), tmp_path / "source")
    stacked = _copy(Path(tiny_family["base"]), tmp_path / "stacked")
    (stacked / SOURCES_FILE).write_text(json.dumps({"sources": source_stats([src]), "rerun": "import again"}))
    return src, stacked


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _lora(tiny_family, folder: Path) -> Path:
    """A PEFT LoRA adapter of the tiny base's q_proj layers, written by hand."""
    folder.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for layer in (0, 1):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, 128, generator=g) * 0.01
        tensors[f"{key}.lora_B.weight"] = torch.randn(128, 2, generator=g) * 0.01
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    return folder


def _one_line(capsys, *fragments: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(f in err for f in fragments), err


def test_an_adapter_output_never_replaces_a_stacked_base_s_source_model(tiny_family, tmp_path, capsys):
    """The merge refused an output overlapping a stacked input's source models; the adapter run
    did not, and `--force` replaced the source model with the adapter."""
    src, stacked = _stacked(tiny_family, tmp_path)
    params = tmp_path / "adapter.yaml"
    params.write_text(yaml.safe_dump({
        "base": str(stacked), "method": "task_arithmetic",
        "experts": [{"name": "a", "adapter": str(_lora(tiny_family, tmp_path / "lora")), "weight": 1.0}],
        "output": {"dir": str(src), "adapter": {"combination": "cat"}}, "cache_dir": str(tmp_path / "cache")}))
    before = _snapshot(src)
    capsys.readouterr()
    assert main(["run", str(params), "-q", "--force"]) == OutputError.exit_code
    _one_line(capsys, str(src), "a source model of the stacked input")
    # `check` says what run refuses (it did not look at an adapter output's folder)
    assert main(["check", str(params), "-q", "--force"]) == OutputError.exit_code
    assert "a source model of the stacked input" in capsys.readouterr().out
    assert _snapshot(src) == before


def test_part_files_are_never_added_to_a_stacked_base_s_source_model(tiny_family, tmp_path, capsys):
    """The parts folder was refused inside an input model but not inside a stacked input's
    source model, which a second *.safetensors file there changes."""
    src, stacked = _stacked(tiny_family, tmp_path)
    experts = [{"name": "e0", "path": str(tiny_family["experts"][1]), "weight": 0.5}]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"base": str(stacked), "experts": experts, "method": "task_arithmetic",
                                      "budget": "full", "output": {"dir": str(tmp_path / "out")},
                                      "cache_dir": str(tmp_path / "cache")}))
    plan = tmp_path / "plan.json"
    assert main(["plan", str(params), "-o", str(plan), "-q"]) == 0
    before = _snapshot(src)
    capsys.readouterr()
    argv = ["merge", str(plan), "--part", "1/2", "-o", str(src / "parts"), "--cache-dir", str(tmp_path / "cache"),
            "-q", "--force"]
    assert main(argv) == OutputError.exit_code
    _one_line(capsys, str(src), "parts folder -o is inside an input of this command")
    assert _snapshot(src) == before and not (src / "parts").exists()


def test_import_mergekit_does_not_replace_a_symbolic_link_without_force(tiny_family, tmp_path, capsys):
    """`plan -o` and `index -o` refused an existing -o that is a symbolic link (even a dangling one)
    without --force; import-mergekit replaced it."""
    config = tmp_path / "mk.yaml"
    config.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": str(tiny_family["base"]), "dtype": "bfloat16",
        "models": [{"model": str(tiny_family["experts"][1]), "parameters": {"weight": 1.0}}]}))
    link = tmp_path / "params.yaml"
    os.symlink(tmp_path / "elsewhere.yaml", link)
    capsys.readouterr()
    assert main(["import-mergekit", str(config), "-o", str(link), "-q"]) == OutputError.exit_code
    _one_line(capsys, str(link), "exists; refusing to overwrite it")
    assert link.is_symlink() and not (tmp_path / "elsewhere.yaml").exists()
    assert main(["import-mergekit", str(config), "-o", str(link), "-q", "--force"]) == 0


def test_plan_never_overwrites_its_config_or_a_users_file(tiny_family, tmp_path, capsys):
    cfg = write_config(tmp_path, tiny_family)
    text = cfg.read_text()
    assert main(["plan", str(cfg), "-q", "-o", str(cfg)]) == 7
    assert cfg.read_text() == text
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    capsys.readouterr()
    assert main(["plan", str(cfg), "-q", "-o", str(notes)]) == 7
    err = capsys.readouterr().err
    assert str(notes) in err and "--force" in err and err.count("\n") == 1
    assert notes.read_text() == '{"mine": 1}'
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan)]) == 0
    assert main(["plan", str(cfg), "-q", "-o", str(plan), "--budget", "50%"]) == 0  # a plan replaces a plan
    assert main(["plan", str(cfg), "-q", "-o", str(notes), "--force"]) == 0
    assert "plan_hash" in notes.read_text()


@pytest.mark.parametrize("argv", [["sweep", "CFG", "-o", ""], ["index", "MODEL", "-o", "MODEL/model.safetensors"]])
def test_other_outputs_refuse_empty_paths_and_inputs(argv, tiny_family, tmp_path):
    cfg = write_config(tmp_path, tiny_family)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes((Path(tiny_family["root"]) / "base" / "model.safetensors").read_bytes())
    before = file_tree(tmp_path)
    argv = [a.replace("CFG", str(cfg)).replace("MODEL", str(model)) for a in argv]
    assert main([*argv, "-q"]) == 7
    assert file_tree(tmp_path) == before


@pytest.mark.parametrize("command", ["plan", "import-mergekit"])
@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_an_o_file_inside_an_input_model_is_refused_even_with_force(command, victim, tiny_family, tmp_path,
                                                                   monkeypatch):
    """`plan cfg -o models/base/model.safetensors --force` (a slip of -o; --force to get past
    "not a mergepipe plan") replaced the base's weights with the plan's JSON; `import-mergekit
    ... -o models/base/config.json --force` its config with params.yaml."""
    import shutil
    import yaml
    base = tmp_path / "models" / "base"
    shutil.copytree(Path(tiny_family["root"]) / "base", base)
    expert = Path(tiny_family["root"]) / "expert_1"
    if command == "plan":
        argv = ["plan", str(write_config(tmp_path, tiny_family, base=str(base)))]
    else:
        mk = tmp_path / "mk.yml"
        monkeypatch.chdir(tmp_path)  # where mergekit (and the import) reads models/base from
        mk.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": "models/base",
                                      "models": [{"model": str(expert), "parameters": {"weight": 1.0}}]}))
        argv = ["import-mergekit", str(mk)]
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    assert main([*argv, "-o", str(base / victim), "--force", "-q"]) == 7
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    assert main([*argv, "-o", str(tmp_path / "elsewhere.out"), "--force", "-q"]) == 0


@pytest.mark.parametrize("target", ["expert_1", "expert_1/merged", "base/sub/p.yaml"])
@pytest.mark.parametrize("command", ["run", "merge", "import-mergekit"])
def test_nothing_is_written_into_a_source_model_of_a_stacked_input(command, target, tiny_family, tmp_path):
    """The stacked folder's source models are the real inputs, yet only the stacked folder was
    protected: `run p.yaml -o expert_1 --force` (after "not a mergepipe output") replaced the
    user's expert_1 with the merge, and `import-mergekit mk.yml -o base/p.yaml` built p.stacked
    and wrote p.yaml inside the base. Now every one is refused (exit 7), even with --force."""
    mk, params = stacked_project(tiny_family, tmp_path)
    assert main(["plan", str(params), "-q", "-o", str(tmp_path / "plan.json")]) == 0
    before = {m: file_tree(tmp_path / m) for m in ("base", "expert_1")}
    argv = {"run": ["run", str(params), "-o"], "merge": ["merge", str(tmp_path / "plan.json"), "-o"],
            "import-mergekit": ["import-mergekit", str(mk), "-o"]}[command]
    path = tmp_path / target
    if command == "import-mergekit" and not target.endswith(".yaml"):
        path = path / "p.yaml"
    assert main([*argv, str(path), "--force", "-q", *(["--root", str(tmp_path)] if command == "merge" else [])]) == 7
    assert {m: file_tree(tmp_path / m) for m in ("base", "expert_1")} == before
    assert not (tmp_path / "base" / "sub").exists() and not (tmp_path / "expert_1" / "merged").exists()


@pytest.mark.parametrize("argv", [["index", "M", "-o", "M/model.safetensors", "--force"],
                                  ["index", "M/model.safetensors", "-o", "M/model.safetensors", "--force"],
                                  ["index", "E", "--base", "M", "-o", "M/config.json", "--force"]])
def test_index_o_never_replaces_a_file_of_the_models_it_indexes(argv, tiny_family, tmp_path, capsys):
    """`index M -o M/model.safetensors --force` wrote the JSON record over the model's weights
    (plan -o and import-mergekit -o already refused an input even with --force)."""
    root = Path(tiny_family["root"])
    model = tmp_path / "M"
    shutil.copytree(root / "expert_1", model)
    before = file_tree(tmp_path)
    argv = [a.replace("M", str(model), 1) if a.startswith("M") else a for a in argv]
    argv = [str(root / "expert_2") if a == "E" else a for a in argv]
    capsys.readouterr()
    assert main([*argv, "-q", "--cache-dir", str(tmp_path / "cache")]) == 7
    one_line_error(capsys, "-o is", "even with --force")
    assert {k: v for k, v in file_tree(tmp_path).items() if not k.startswith("cache")} == before


@pytest.mark.parametrize("where", ["out_is_a_file", "parent_is_a_file", "base_is_a_file", "out_dangling_link"])
def test_demo_where_a_folder_must_go_is_a_one_line_error(where, tmp_path, capsys):
    """`mergepipe demo FILE` (or one under a file, or with base/ a file) ended in mkdir's traceback."""
    user = tmp_path / "notes.txt"
    user.write_text("mine")
    target = {"out_is_a_file": user, "parent_is_a_file": user / "demo", "base_is_a_file": tmp_path / "d",
              "out_dangling_link": tmp_path / "link"}[where]
    if where == "base_is_a_file":
        target.mkdir()
        (target / "base").write_text("mine")
    if where == "out_dangling_link":
        os.symlink(tmp_path / "nowhere", target)
    before = file_tree(tmp_path)
    capsys.readouterr()
    assert main(["demo", str(target), "--experts", "1", "--quiet"]) == 7
    one_line_error(capsys, str(target))
    assert file_tree(tmp_path) == before


def test_a_users_weights_under_a_copied_manifest_are_not_replaced(tiny_family, tmp_path, capsys):
    """A folder holding a user's model.safetensors and a manifest.json copied from another
    output (`cp -r merged mine` and then new weights moved in, or the manifest copied over)
    passed as a complete mergepipe output: `run` replaced it, weights lost. A weight file is
    ours only at the inode and size the run record holds, or if it matches the manifest."""
    def config(name: str, out: Path, **kw) -> Path:
        (tmp_path / name).mkdir()
        return write_config(tmp_path / name, tiny_family, output={"dir": str(out)},
                            cache_dir=str(tmp_path / "cache"), **kw)
    out = tmp_path / "out"
    cfg = config("c", out)
    assert main(["run", str(cfg), "-q"]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"my fine-tune")
    shutil.copy(out / "manifest.json", mine)
    shutil.copytree(out, tmp_path / "mine2")  # a whole copy, then a fine-tune moved over its weights
    (tmp_path / "ft.safetensors").write_bytes(b"my other fine-tune")
    os.replace(tmp_path / "ft.safetensors", tmp_path / "mine2" / "model.safetensors")
    for folder in (mine, tmp_path / "mine2"):
        before = file_tree(folder)
        other = config(f"c-{folder.name}", folder)
        capsys.readouterr()
        assert main(["run", str(other), "-q"]) == 7
        assert "not the weight file mergepipe published" in capsys.readouterr().err
        assert file_tree(folder) == before
    # what stays replaceable: a flipped byte in place (damage) and the same bytes under a new
    # inode without its run record (a folder DVC restored)
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert main(["run", str(cfg), "-q"]) == 0 and weights.read_bytes() == good
    record_path(out).unlink()
    weights.unlink()
    weights.write_bytes(good)
    lam = config("c-lambda", out, parameters={"lambda": 0.9})
    assert main(["run", str(lam), "-q"]) == 0
    assert json.loads((out / "manifest.json").read_text())["plan"]["parameters"]["lambda"] == 0.9


def test_merge_part_never_replaces_a_users_file_of_a_parts_name(tiny_family, tmp_path, capsys):
    """`merge --part 1/2 -o FOLDER` replaced FOLDER's part-1-of-2.safetensors (a user's download)
    and part-2-of-2.json whatever they were. Now refused (exit 7) unless --force; a part job's
    own files are still replaced by a rerun."""
    cfg = write_config(tmp_path, tiny_family)
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cfg), "-q", "-o", str(plan)]) == 0
    folder = tmp_path / "downloads"
    folder.mkdir()
    mine = {"part-1-of-2.safetensors": (Path(tiny_family["root"]) / "expert_1" / "model.safetensors").read_bytes(),
            "part-2-of-2.json": b'{"notes": 1}\n'}
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    capsys.readouterr()
    for i in (1, 2):
        assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(folder), "-q"]) == 7
        err = capsys.readouterr().err
        assert "not a part file mergepipe wrote" in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == mine
    parts = tmp_path / "parts"
    for _ in range(2):  # a rerun replaces the part job's own files
        for i in (1, 2):
            assert main(["merge", str(plan), "--part", f"{i}/2", "-o", str(parts), "-q"]) == 0
    assert main(["gather", str(plan), str(parts), "--parts", "2", "-o", str(tmp_path / "out"), "-q"]) == 0
    assert main(["verify", str(tmp_path / "out")]) == 0
    assert main(["merge", str(plan), "--part", "1/2", "-o", str(folder), "-q", "--force"]) == 0
