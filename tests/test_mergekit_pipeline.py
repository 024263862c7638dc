"""End to end against mergekit 0.1.5: `mergepipe run` at full budget on the tiny
bf16 family (index rank cuts, engine, methods) versus mergekit's
`merge_tensors(..., dtype=float32, out_dtype=bf16)` on the same checkpoints.

Equal by the rule of tests/helpers/equivalence.py (one ulp of the larger value, cancellation
residues, knife-edge sign elections), on elements where no expert's |delta| equals one of
its magnitude thresholds (mergekit keeps an arbitrary subset of such ties). Which elements
are bit-identical depends on the machine mergekit runs on; the rule does not.
Skipped without `.venv-mergekit` (see test_mergekit_equivalence.py).
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergepipe.cli import main
from tests.helpers.equivalence import INSTALL, MERGEKIT_PYTHON, judge, knife_edges, merge_scale
from tests.helpers import write_config

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


def _ranks(method: str, density: float, n: int) -> list[int]:
    """The magnitude ranks (r-th largest |delta|) that bound what `method` keeps."""
    if method == "ties":
        return [max(1, int(density * n))]
    if method.startswith("breadcrumbs"):
        target, n_top = int(density * n), int(GAMMA * n)
        return [n_top, n_top + target]
    return []


def _value_at(magnitudes: torch.Tensor, rank: int) -> torch.Tensor:
    n = magnitudes.numel()
    return magnitudes.reshape(-1).kthvalue(n - rank + 1).values


def _at_thresholds(method: str, base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    at = torch.zeros(base.shape, dtype=torch.bool)
    b = base.float()
    for e, density in zip(experts, DENSITY):
        magnitudes = (e.float() - b).abs()
        for r in _ranks(method, density, base.numel()):
            if 0 < r < base.numel():
                at |= magnitudes == _value_at(magnitudes, r)
    return at


def _sign_terms(method: str, base: torch.Tensor, experts: list[torch.Tensor]) -> list[torch.Tensor]:
    """w_k * trimmed delta_k, the terms of a TIES sign election (off the thresholds)."""
    terms = []
    for e, density, w in zip(experts, DENSITY, WEIGHTS):
        delta = e.float() - base.float()
        magnitudes, n = delta.abs(), delta.numel()
        keep = torch.ones_like(delta, dtype=torch.bool)
        ranks = _ranks(method, density, n)
        if method == "ties":
            keep = magnitudes > _value_at(magnitudes, ranks[0]) if ranks[0] < n else keep
        elif method == "breadcrumbs_ties":
            top, low = ranks
            if top > 0:
                keep &= magnitudes < _value_at(magnitudes, top)
            keep &= magnitudes > _value_at(magnitudes, low) if 0 < low < n else low >= n
        terms.append(delta * keep * torch.tensor(w, dtype=torch.float32))
    return terms


@pytest.mark.parametrize("method", sorted(METHODS))
def test_pipeline_matches_mergekit(merges, method):
    ours, theirs, base, experts = merges
    shared = METHODS[method][0]
    weights = WEIGHTS[:1] if method == "slerp" else WEIGHTS
    compared = identical = 0
    for name, reference in theirs[method].items():
        out = ours[method][name]
        assert out.dtype == reference.dtype == base[name].dtype
        tensors = [e[name] for e in experts][:len(weights)]
        off = ~_at_thresholds(method, base[name], tensors)
        divisor = sum(weights) if method == "linear" else 1.0
        scale = merge_scale(base[name], tensors, weights, lam=shared.get("lambda", 1.0), divisor=divisor)
        if method == "slerp":  # sin-weighted: |out| <= |W0| + |W1| up to the angle's rounding
            scale = scale * 4
        knife = None
        if method in ("ties", "breadcrumbs_ties", "dare_ties"):
            knife = knife_edges(_sign_terms(method, base[name], tensors))[off]
        verdict = judge(out[off], reference[off], scale=scale[off], knife=knife)
        assert verdict.misses == 0, f"{name}: {verdict}"
        compared += verdict.compared
        identical += verdict.identical
    assert compared > 0
    print(f"{method}: {identical} of {compared} elements bit-identical to mergekit on this machine")
