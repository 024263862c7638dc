"""Plain helpers shared by test modules (no fixtures: those are in conftest.py)."""
from __future__ import annotations

from pathlib import Path

import torch
import yaml

from mergepipe.checkpoint.safetensors import CheckpointReader, as_tensor, open_checkpoint
from mergepipe.index import binfmt
from mergepipe.index.records import DeltaIndex, ModelIndex, TensorDelta, TensorEntry
from mergepipe.plan.planner import PlanInput, PlanRequest, make_plan
from mergepipe.plan.record import plan_json


def plan_doc(req: PlanRequest) -> dict:
    """make_plan's plan as its JSON form (plan_json): what `mergepipe plan` writes."""
    return plan_json(make_plan(req))


def write_config(tmp_path: Path, family: dict, **overrides) -> Path:
    """params.yaml for a demo family (task arithmetic, full budget, 16KiB blocks) with `overrides`."""
    root = Path(family["root"])
    experts = [{"name": f"e{k}", "path": str(root / f"expert_{k}"), "weight": w}
               for k, w in zip(range(len(family["experts"])), [1.0, 0.5, 0.7, 0.3])]
    cfg = {"base": str(root / "base"), "experts": experts, "method": "task_arithmetic",
           "parameters": {"lambda": 1.0}, "seed": 0, "budget": "full", "block_bytes": "16KiB",
           "output": {"dir": str(tmp_path / "out")}, "cache_dir": str(tmp_path / "cache")}
    cfg.update(overrides)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def load_model(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder, read with mergepipe's reader."""
    ckpt = open_checkpoint(folder)
    with CheckpointReader(ckpt) as r:
        return {n: as_tensor(r.read_range(t, t.begin, t.end), t.dtype, t.shape).clone()
                for n, t in ckpt.tensors.items()}


def columnar(index: ModelIndex | DeltaIndex) -> ModelIndex | DeltaIndex:
    """`index` as every reader gets it from the store: through the binary format, as columns."""
    if isinstance(index, DeltaIndex):
        return binfmt.decode_delta(binfmt.encode_delta(index))
    return binfmt.decode_model(binfmt.encode_model(index))


def synthetic_indexes(tensor_blocks: list[list[float]], n_experts: int, seed: int):
    """Indexes without files: tensors of 4-row blocks with the given l2 per block (x (k + 1)
    for expert k, a fifth of them identical to the base)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, blocks in enumerate(tensor_blocks):
        tensors[f"t{i}"] = TensorEntry(f"t{i}", "BF16", (len(blocks) * 4, 8),
                                       tuple((4 * b, 4 * b + 4) for b in range(len(blocks))),
                                       tuple("0" * 64 for _ in blocks))
    base_index = columnar(ModelIndex("b" * 64, 64, tensors))
    experts, idx, deltas = [], {}, {}
    for k in range(n_experts):
        name, h = f"e{k}", f"{k:064x}"
        experts.append(PlanInput(name, f"/m/{name}", h, float(torch.rand(1, generator=g)) + 0.1))
        idx[name] = columnar(ModelIndex(h, 64, tensors))
        per = {}
        for tname, blocks in zip(tensors, tensor_blocks):
            l2 = tuple(0.0 if float(torch.rand(1, generator=g)) < 0.2 else v * (k + 1) for v in blocks)
            n = len(blocks)
            per[tname] = TensorDelta(tname, n * 32, sum(l2), sum(x * x for x in l2) ** 0.5, 0, l2, l2, (1,) * n,
                                     tuple(x == 0.0 for x in l2), (), (), (), (), {})
        deltas[name] = columnar(DeltaIndex(h, "b" * 64, 64, per))
    return base_index, experts, idx, deltas


def kernel_build(module: str, level: int) -> Path:
    """The installed build of the C library `module` for x86-64 `level` (util/cpu.py); skips,
    saying why, where this CPU or MERGEPIPE_CPU_LEVEL does not run that level."""
    import pytest

    from mergepipe.util import cpu
    name = cpu.NAMES[level]
    if cpu.build_path(module, 1) is None:
        pytest.skip(f"{module}: the C kernels were not built")
    if cpu.detected_level() == 0:
        pytest.skip(f"{name}: not an x86-64 CPU")
    if level > cpu.detected_level():
        pytest.skip(f"{name} not run: this CPU runs up to {cpu.NAMES[cpu.detected_level()]}")
    if level > cpu.allowed_level():
        pytest.skip(f"{name} not run: {cpu.ENV} caps the kernels at {cpu.NAMES[cpu.allowed_level()]}")
    path = cpu.build_path(module, level)
    if path is None and not _compiler_makes(name):
        pytest.skip(f"{name}: this machine's C compiler cannot build it (setup.py's extra builds are optional)")
    assert path is not None, f"{module}: no {name} build beside the baseline one (setup.py builds it on x86-64)"
    return path


def _compiler_makes(march: str) -> bool:
    """Whether `cc` accepts -march=`march` (the extra builds are optional where it does not)."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    return cc is not None and subprocess.run([cc, f"-march={march}", "-x", "c", "-E", "-", "-o", "/dev/null"],
                                             input=b"", capture_output=True).returncode == 0


def fails_in_one_line(capsys, argv: list[str], code: int, *fragments: str) -> None:
    """`mergepipe argv` exits with `code` and one stderr line holding every fragment."""
    from mergepipe.cli import main
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def file_tree(root: Path) -> dict[str, bytes]:
    """Every file under root, relative path -> bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_error(capsys, *want: str) -> str:
    """The captured stderr is one `error: ` line, no traceback, holding every fragment of `want`."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and "Traceback" not in err, err
    for w in want:
        assert w in err, (w, err)
    return err


CALIBRATED = {"strategy": "calibrated", "text": "calib.txt", "max_tokens": 64, "seq_len": 32}


def calibrated_plan(family, work: Path, cache: Path, text: str) -> Path:
    """A `calibrated` 40% plan of `family` made by `mergepipe plan` from `text` in work/, cache at `cache`."""
    from mergepipe.cli import main
    work.mkdir(exist_ok=True)
    (work / "calib.txt").write_text(text)
    cfg = write_config(work, family, budget="40%", plan=CALIBRATED, cache_dir=str(cache))
    assert main(["plan", str(cfg), "-q", "-o", str(work / "plan.json")]) == 0
    return work / "plan.json"


def stacked_project(family, tmp_path: Path) -> tuple[Path, Path]:
    """base and expert_1 copied into tmp_path, a slices config stacking them, imported as p.yaml."""
    import shutil

    from mergepipe.cli import main
    root = Path(family["root"])
    for m in ("base", "expert_1"):
        shutil.copytree(root / m, tmp_path / m)
    mk = tmp_path / "mk.yml"
    mk.write_text(yaml.safe_dump({"merge_method": "passthrough", "slices": [  # mergekit reads them from the cwd
        {"sources": [{"model": str(tmp_path / "base"), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(tmp_path / "expert_1"), "layer_range": [2, 4]}]}]}))
    params = tmp_path / "p.yaml"
    assert main(["import-mergekit", str(mk), "-o", str(params), "-q"]) == 0
    return mk, params
