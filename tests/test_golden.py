"""Our bytes do not depend on the machine: golden merges under different CPU settings.

tests/golden.py builds a family from integers only and merges it with every method
(bf16 and fp32, a sharded base, a partial budget, a dtype change). Each setting below
runs it in a fresh interpreter; every one must give the committed weight hashes and
the same manifest bytes, and the manifests (less their version fields) are pinned too.
(The hashes changed once, on purpose, when the delta index's sums left BLAS: np.dot's
summation order followed OpenBLAS's per-CPU kernel, so plan bounds and slerp angles,
hence f32 slerp outputs, differed between CPUs; see index/kernels.py. PLANS changed once
more, with the weights unchanged, when the manifest went to schema 2: output hashes are block
trees and bytes counts base_bytes_copied, issue 13. Both tables changed once more, every
tensor's bytes unchanged (the manifests' tensor hashes are equal), when weight files that
mirror a base file got headers padded to the base's data start modulo 4 KiB, so that
copied runs can be reflinked (issue 13; tests/test_reflink.py). PLANS of the sharded base changed
once more, its weights unchanged, when plans began to record a base-mirroring layout that is not
the canonical one, output.layout (issue 28; engine/layout.py). PLANS of the dtype change
changed once more, its weights unchanged, when config.json began to name the output dtype
(issue 24; output/hf_config.py).) A hash that changes means the output bytes changed: a change
of behaviour, to be made on purpose (and the hashes updated in the same commit), never
by a refactor.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

from tests.golden import CASES

pytestmark = pytest.mark.slow

GOLDEN = {
    "bf16-breadcrumbs": "959823e9f32f4016dc01e17a577f2cd07b627495152f4d2f6152123fdcc20779",
    "bf16-breadcrumbs_ties": "1ee1c685c072e6ed1e108fb1c07423499c66a04968b03135bae59c8184be7136",
    "bf16-dare_linear": "4918dcb46d60143db0f44e7462de81ee797eeca6f1a107faf0396fbe9c6cf9b4",
    "bf16-dare_ties": "0b279ed2eff567a8a50b50be313cb47a66b147b805c23c2106afdc70c0c83641",
    "bf16-linear": "240fc774697002d2393ea4dfeac46a253d539c67350acd1197af6bff1f93b0bf",
    "bf16-slerp": "b455ef36812b03937a130a82c56de9ed733e6ed6654cd921d4c3bfd7621ffb63",
    "bf16-ta-30pct": "55f24978c3024f6a1c4e0f9e3b3f7e018e9a2ff0d68c32a0c7c72aa9db305367",
    "bf16-ta-30pct-sketch": "2d45b2bced2ac488d86e23270eacd07f3d631a29cc11dde355e2207a32823252",
    "bf16-ta-to-f32": "a51d7270c4abc6a6b67b8b75656a244fe94848cbbddbd45d77463a3e8ced0d5c",
    "bf16-task_arithmetic": "4f51731f6e0e140eb0a48799eea3c904eff7905c979a235e033646bdc28b57c5",
    "bf16-ties": "5ce10b82f01a5f9413bfe3d22131ca3d34a9fe1a7fb70efeba598b113cb59cf3",
    "bf16-ties-30pct": "43a2fcbabafea0462f9d64863046e25a892b3953243e50cda10e16350080e4da",
    "bf16-ties-30pct-sketch": "0b69217bfd5bd4352bb463c75d1ebd8aa1785e8ba9ab6e1cb7debb70e10352ff",
    "f32-breadcrumbs_ties": "8b9465ea27c71db20238ebcdc8ec917f097067c5aa4d31f96fe07586e276e4cd",
    "f32-dare_ties": "6bd8c941a9365e5e68519d6baac792124ad9c3f9a453061fdca73b30645c61f8",
    "f32-slerp": "51ad644c19598c584debf28fb6ae5980bda0f4a073f9ff2f3a1c3d4eec4c8903",
    "f32-task_arithmetic": "4c6273b998d7c00a1fb417b95c0e35891e9c53b5d62a273b225784eb99551375",
    "f32-ties": "09fef05b9e28c897285d026d5cb8494f332fa0c958bcc8cdac2e3c01b8425e50",
    "sharded-base-ties": "071ac99db3071ff9cea4e75d5cb723bc20abfb2f1d7c451aa52bed8a509d243a",
}
# the manifests without their version fields (tests/golden.py::manifest_digest): plans,
# access sets, byte counts, bounds and output hashes
PLANS = {
    "bf16-breadcrumbs": "7f476ce5d85ee0d5779b321a76ce7a21133d4c567bae48efee5835b75f1c2325",
    "bf16-breadcrumbs_ties": "e303cd66a0afc7d8c64a2185c6da9bdc3eea334c3ababa5fa2dd3bd1550d53f4",
    "bf16-dare_linear": "abf32359bef2abc784c883af82a98e098f3a7d8e191f13580358279b0713f3d3",
    "bf16-dare_ties": "3b8a604ac58802dd08ded3a00e3ab5c13a2bd7d98f10801d1f7d1ad1f0697511",
    "bf16-linear": "5e4c59718726bc00c1404f029a2096b0672511598f53e7957f74b56145763c95",
    "bf16-slerp": "9e333699251dd543ffe022c77f6a0773cb745f678209c381d23274601df77de1",
    "bf16-ta-30pct": "f661d4de1f1c09c9559c1f8753cb1efd31c836baf03e14133b01aba1c7774cd5",
    "bf16-ta-30pct-sketch": "688384ac2cfbf69796df396920a07f1e2250dd3f2fe7ccef0738ca757f58be6e",
    "bf16-ta-to-f32": "4554ed7e24c1c25b2ce086e2e9c0918b100ebf74f2c8707ca3170c945e227645",
    "bf16-task_arithmetic": "2406c882f884d0181cfb205d21aada126a516ce1adf66f1945c110d5868e7f34",
    "bf16-ties": "8f68413827058f846b61c6f85e831f589648dd6470760f4cfdb78cc77d9ed1e8",
    "bf16-ties-30pct": "455627b78818b946c0bb6b8a53b273e1c0c414cba93099b2a338a5b21042df6b",
    "bf16-ties-30pct-sketch": "5f4c1354d54deed1e7e972c66cb08ffc7a39d80783007c493b216dd8428e0a5d",
    "f32-breadcrumbs_ties": "163b999fedcb7aabc6c268c3b23b2ff7622122114684455df7980b080e8786a9",
    "f32-dare_ties": "d7b734020bd7a5e3c74fea749a0bed6a1910b23e1bb9e9532461282761720e3f",
    "f32-slerp": "00c41e7464dc6f868a4d68689a1520d33281e56de9e555814720a59dcce19de3",
    "f32-task_arithmetic": "09ff27af1d45217e90634fc11c6b987b0aefa54ecf053196fb9bcb8c8e1d5ef3",
    "f32-ties": "c5919ba3edcd164c16cda031f71127e75acc72620f7904a06b24fcfb75a03b05",
    "sharded-base-ties": "e5085638bcb221f7313555c9c61460edf5c94f004e8e4e0411d54b8b229fe928",
}

# numpy's runtime-dispatched SIMD paths that this CPU has, all turned off in one setting
NUMPY_SIMD = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
SETTINGS = {
    "default": ({}, []),
    "torch-path-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, ["--torch-path"]),
    # the C kernels' baseline (SSE2) build, and OpenBLAS's generic SSE3 kernels: anything left on
    # BLAS would sum in another order here
    "scalar-1-thread": ({"MERGEPIPE_CPU_LEVEL": "x86-64", "ATEN_CPU_CAPABILITY": "default",
                         "NUMBA_CPU_NAME": "generic", "OMP_NUM_THREADS": "1",
                         "NPY_DISABLE_CPU_FEATURES": NUMPY_SIMD, "OPENBLAS_CORETYPE": "Prescott"}, ["--threads", "1"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = {}
    for name, (env, args) in SETTINGS.items():
        root = tmp_path_factory.mktemp(f"golden-{name}")
        proc = subprocess.run([sys.executable, "-m", "tests.golden", str(root), *args],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        out[name] = json.loads(proc.stdout)
    return out


def test_cases_have_golden_hashes():
    assert sorted(GOLDEN) == sorted(CASES) == sorted(PLANS)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_golden_weights(runs, setting):
    got = {case: r["weights"] for case, r in runs[setting].items()}
    wrong = sorted(case for case in GOLDEN if got.get(case) != GOLDEN[case])
    assert not wrong, f"{setting}: output bytes changed for {wrong}"


def test_golden_plans_and_manifests(runs):
    got = {case: r["plan"] for case, r in runs["default"].items()}
    wrong = sorted(case for case in PLANS if got.get(case) != PLANS[case])
    assert not wrong, f"plans or manifests changed for {wrong}"


def test_manifests_identical_across_settings(runs):
    first, *rest = SETTINGS
    for setting in rest:
        differ = sorted(c for c in CASES if runs[setting][c]["manifest"] != runs[first][c]["manifest"])
        assert not differ, f"manifests differ between {first} and {setting}: {differ}"
