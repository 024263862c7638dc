"""End to end against mergekit 0.1.5: `mergepipe run` at full budget on the tiny
bf16 family (index rank cuts, engine, methods) versus mergekit's
`merge_tensors(..., dtype=float32, out_dtype=bf16)` on the same checkpoints.

Bit-identical output, except on elements where some expert's |delta| equals one
of its magnitude thresholds (mergekit keeps an arbitrary subset of such ties).
Skipped without `.venv-mergekit` (see test_mergekit_equivalence.py).
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_mergekit_equivalence import INSTALL, MERGEKIT_PYTHON

from mergepipe.cli import main
from tests.conftest import write_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not MERGEKIT_PYTHON.exists(),
                       reason=f"mergekit reference venv not found at {MERGEKIT_PYTHON}; create it with: {INSTALL}"),
]

WEIGHTS = [1.0, 0.5, 0.7]  # tests/conftest.py write_config
DENSITY = [0.4, 0.3, 0.55]
GAMMA = 0.02
METHODS = {
    "linear": ({}, {}),
    "task_arithmetic": ({"lambda": 0.8}, {}),
    "ties": ({}, {"density": DENSITY}),
    "breadcrumbs": ({}, {"density": DENSITY, "gamma": [GAMMA] * 3}),
    "breadcrumbs_ties": ({"lambda": 1.2}, {"density": DENSITY, "gamma": [GAMMA] * 3}),
    "dare_ties": ({}, {}),  # density 1: nothing dropped, so deterministic in both
    "slerp": ({"t": 0.3}, {}),  # base and expert_0 only; one whole-tensor angle from the index's sums
}

SCRIPT = r'''
import glob, json, sys
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from mergekit.merge_methods.api import merge_tensors

def load(folder):
    out = {}
    for f in sorted(glob.glob(folder + "/*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out

spec = json.loads(sys.argv[1])
base = load(spec["base"])
experts = [load(p) for p in spec["experts"]]
for method, params in spec["methods"].items():
    out = {}
    for name, b in base.items():
        if not b.is_floating_point():
            continue
        if method == "linear":
            tensors, base_index = [e[name] for e in experts], None
        elif method == "slerp":
            tensors, base_index = [b, experts[0][name]], 0
        else:
            tensors, base_index = [b] + [e[name] for e in experts], 0
        out[name] = merge_tensors(tensors, method, parameters=params, base_index=base_index,
                                  dtype=torch.float32, out_dtype=b.dtype).contiguous()
    save_file(out, f"{spec['out']}/{method}.safetensors")
'''


def _load_dir(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def merges(tmp_path_factory, tiny_family):
    root = tiny_family["root"]
    tmp = tmp_path_factory.mktemp("mk_pipeline")
    experts = [root / f"expert_{k}" for k in range(len(tiny_family["experts"]))]
    ours = {}
    for method, (shared, per_expert) in METHODS.items():
        d = tmp / method
        d.mkdir()
        params = dict(shared)
        if "density" in per_expert:
            params["density"] = 0.5  # overridden per expert below
        cfg = write_config(d, tiny_family, method=method, parameters=params,
                           cache_dir=str(tmp / "cache"))  # index the family once
        data = yaml.safe_load(cfg.read_text())
        for i, e in enumerate(data["experts"]):
            e.update({key: values[i] for key, values in per_expert.items()})
        if method == "linear":
            data["parameters"] = {}
        if method == "slerp":
            data["experts"] = data["experts"][:1]
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        assert main(["run", str(cfg), "-q"]) == 0
        ours[method] = _load_dir(d / "out")
    spec = {"base": str(root / "base"), "experts": [str(p) for p in experts], "out": str(tmp),
            "methods": {m: {**shared, **({} if m == "slerp" else {"weight": WEIGHTS}), **per_expert}
                        for m, (shared, per_expert) in METHODS.items()}}
    proc = subprocess.run([str(MERGEKIT_PYTHON), "-c", SCRIPT, json.dumps(spec)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = {m: load_file(tmp / f"{m}.safetensors") for m in METHODS}
    base = _load_dir(root / "base")
    expert_tensors = [_load_dir(p) for p in experts]
    return ours, theirs, base, expert_tensors


def _at_thresholds(method: str, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    at = torch.zeros(base.shape, dtype=torch.bool)
    n = base.numel()
    b = base.float()
    for e, density in zip(experts, DENSITY):
        magnitudes = (e.float() - b).abs()
        if method == "ties":
            ranks = [max(1, int(density * n))]
        elif method.startswith("breadcrumbs"):
            target, n_top = int(density * n), int(GAMMA * n)
            n_bot = max(0, n - target - n_top)
            ranks = [n - n_bot - target, n - n_bot]
        else:
            ranks = []
        for r in ranks:
            if 0 < r < n:
                at |= magnitudes == magnitudes.reshape(-1).kthvalue(n - r + 1).values
    return at


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    return torch.exp2(torch.floor(torch.log2(x.clamp_min(1e-30))) - mantissa)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_pipeline_matches_mergekit(merges, method):
    ours, theirs, base, experts = merges
    compared = differing = worst_ulps = 0
    for name, reference in theirs[method].items():
        out = ours[method][name]
        assert out.dtype == reference.dtype == base[name].dtype
        off = ~_at_thresholds(method, base[name], [e[name] for e in experts])
        compared += int(off.sum())
        as_int = {2: torch.int16, 4: torch.int32}[out.element_size()]
        ulps = (out[off].view(as_int).int() - reference[off].view(as_int).int()).abs()  # same sign: ulp distance
        differing += int((ulps != 0).sum())
        if method == "slerp":
            # in units of one ulp of the larger input: a last-bit difference in the angle moves an
            # output by that much, which is several output ulps where W0 and W1 nearly cancel
            scale = torch.maximum(base[name].float().abs(), experts[0][name].float().abs())[off]
            ulps = (out[off].float() - reference[off].float()).abs() / _ulp(scale, out.dtype)
        worst_ulps = max(worst_ulps, float(ulps.max()) if ulps.numel() else 0)
    assert compared > 0
    if method == "slerp":
        # our angle comes from whole-tensor sums in the index, mergekit's from its own chunked fp32
        # norms (which depend on how it batched tensors), so the trig coefficients can differ in
        # their last fp32 bit: at most one ulp of the inputs, on almost no elements.
        assert worst_ulps <= 1 and differing <= compared // 1000, (worst_ulps, differing, compared)
    else:
        assert differing == 0, f"{differing} of {compared} elements off the thresholds differ from mergekit"
