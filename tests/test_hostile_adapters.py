"""LoRA adapter experts that cannot be merged, seen by `mergepipe check` as `run` sees them: the
same one line and exit code, from adapter_config.json and the safetensors header alone (check
reads no factor), where check used to say "OK" and run then refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergepipe.cli import main

Q = "base_model.model.model.layers.0.self_attn.q_proj."


def _factors(hidden: int = 128, r: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {Q + "lora_A.weight": (torch.randn(r, hidden, generator=g) * 0.01).to(torch.bfloat16),
            Q + "lora_B.weight": (torch.randn(hidden, r, generator=g) * 0.01).to(torch.bfloat16)}


def _adapter(folder: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **config}))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _wider_a(f):
    return {**f, Q + "lora_A.weight": torch.zeros(4, 129, dtype=torch.bfloat16)}


def _a_norm_of_another_model(f):
    return {**f, "base_model.model.model.norm.weight": torch.ones(7, dtype=torch.bfloat16)}


def _b_missing(f):
    return {Q + "lora_A.weight": f[Q + "lora_A.weight"]}


def _int_factor(f):
    return {**f, Q + "lora_A.weight": torch.zeros(4, 128, dtype=torch.int8)}


BROKEN = {  # name: (tensors from the good factors, config changes, what the line says, exit code)
    "in_features_of_another_model": (_wider_a, {}, "B·A is [128, 129]", 2),
    "a_whole_tensor_of_another_shape": (_a_norm_of_another_model, {}, "has shape [7]", 2),
    "a_rank_the_factors_lack": (lambda f: f, {"r": 8}, "rank 8 in adapter_config.json", 2),
    "b_missing": (_b_missing, {}, "needs both A and B", 2),
    "an_integer_factor": (_int_factor, {}, "adapter tensors are floats", 2),
}


def _params(tmp_path: Path, family: dict, adapter: Path) -> Path:
    cfg = {"base": str(Path(family["root"]) / "base"), "method": "task_arithmetic",
           "experts": [{"name": "lora", "adapter": str(adapter), "weight": 1.0}],
           "output": {"dir": str(tmp_path / "out")}, "cache_dir": str(tmp_path / "cache")}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_check_refuses_what_run_refuses_in_the_same_line(case, tiny_family, tmp_path, capsys):
    edit, config, fragment, code = BROKEN[case]
    params = _params(tmp_path, tiny_family, _adapter(tmp_path / "lora", edit(_factors()), **config))
    capsys.readouterr()
    assert main(["run", str(params), "-q"]) == code
    ran = _last_line(capsys)
    assert main(["check", str(params), "--no-probe"]) == code
    checked = _last_line(capsys)
    assert checked == ran and fragment in checked, (checked, ran)
    assert not (tmp_path / "out").exists()


def test_a_half_downloaded_adapter_is_refused_by_check(tiny_family, tmp_path, capsys):
    folder = _adapter(tmp_path / "lora", _factors())
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    params = _params(tmp_path, tiny_family, folder)
    capsys.readouterr()
    assert main(["check", str(params), "--no-probe"]) == 3
    assert str(weights) in _last_line(capsys)


def test_a_good_adapter_passes_check_and_runs(tiny_family, tmp_path, capsys):
    params = _params(tmp_path, tiny_family, _adapter(tmp_path / "lora", _factors()))
    assert main(["check", str(params), "--no-probe"]) == 0
    assert "a LoRA adapter of the base" in capsys.readouterr().out
    assert main(["run", str(params), "-q"]) == 0


def test_audit_proves_a_merge_with_an_adapter_expert_wherever_the_adapter_now_is(tiny_family, tmp_path, capsys):
    """audit looked every input up as a dense checkpoint: an adapter expert was "not found at
    that path" (exit 8) even where it lay, so no merge with an adapter could be proven."""
    import shutil
    lora = _adapter(tmp_path / "lora", _factors())
    params = _params(tmp_path, tiny_family, lora)
    assert main(["run", str(params), "-q"]) == 0
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(lora, moved)
    shutil.rmtree(lora)
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "out"), "--search", str(tmp_path / "elsewhere")]) == 0
    report = capsys.readouterr().out
    assert f"found {moved}" in report and "replay: identical" in report, report
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    assert main(["audit", str(tmp_path / "out"), "--search", str(tmp_path / "elsewhere")]) == 8  # not this adapter
