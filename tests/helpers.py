"""Plain helpers shared by test modules (no fixtures: those are in conftest.py)."""
from __future__ import annotations

from pathlib import Path

import torch
import yaml

from mergepipe.checkpoint.safetensors import CheckpointReader, as_tensor, open_checkpoint


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
