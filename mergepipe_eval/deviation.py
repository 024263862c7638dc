"""How far a merged model is from a reference merge, relative to the reference's update."""
from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open


def relative_deviation(merged: Path, reference: Path, base: Path) -> float:
    """||merged - reference||_F / ||reference - base||_F over the float tensors."""
    num = den = 0.0
    with safe_open(str(merged / "model.safetensors"), "pt") as fm, \
            safe_open(str(reference / "model.safetensors"), "pt") as fr, \
            safe_open(str(base / "model.safetensors"), "pt") as fb:
        for name in fb.keys():
            b = fb.get_tensor(name)
            if not b.is_floating_point():
                continue
            r = fr.get_tensor(name).double()
            num += float((fm.get_tensor(name).double() - r).pow(2).sum())
            den += float((r - b.double()).pow(2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else 0.0
