"""Our bytes do not depend on the machine: golden merges under different CPU settings.

tests/golden.py builds a family from integers only and merges it with every method
(bf16 and fp32, a sharded base, a partial budget, a dtype change). Each setting below
runs it in a fresh interpreter; every one must give the committed weight hashes and
the same manifest bytes, and the manifests (less their version fields) are pinned too.
(The hashes changed once, on purpose, when the delta index's sums left BLAS: np.dot's
summation order followed OpenBLAS's per-CPU kernel, so plan bounds and slerp angles,
hence f32 slerp outputs, differed between CPUs; see index/kernels.py. PLANS changed once
more, with the weights unchanged, when the manifest went to schema 2: output hashes are block
trees and bytes counts base_bytes_copied, issue 13.) A hash that changes means the output bytes changed: a change
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
    "bf16-breadcrumbs": "18725458fdc6a25b786edf4fe137d385a3534335a1f9c05b345320e193811b70",
    "bf16-breadcrumbs_ties": "82038bdd0504842467e3ce2d946c39479fba5fef03d24434c720e51ea31fc0e2",
    "bf16-dare_linear": "80726a8f2237514d01c421774767a1ae60e3d16b033bd6c7fd5d79ebf72eb4bb",
    "bf16-dare_ties": "1d38ef432827f99bb58affc0abce0b4cfc6aa91c67265c2a756a9ce8c7525168",
    "bf16-linear": "bd1ed8ba5b2b6ee132f59c313d59d91678935d3792c66c8eb4b056176e8b4df2",
    "bf16-slerp": "b3f38c174f39b493af2a34316622b43b2025d482679bbadd8881bcca42bb3974",
    "bf16-ta-30pct": "78e1b1b78b6d492f6dd316005af160a74ed9bc03ab1689c4e4e781eb3e2bfea8",
    "bf16-ta-to-f32": "a51d7270c4abc6a6b67b8b75656a244fe94848cbbddbd45d77463a3e8ced0d5c",
    "bf16-task_arithmetic": "e0199ec0a7c139fb854e2887a01352c11bd712b84f5ff9d8b3d611dbc6381480",
    "bf16-ties": "d9e273f502c9e8736c4a16ec24901e68f509e71b735ca4a965b34ebb9b086af7",
    "bf16-ties-30pct": "b4ba7cbe780b68c77f2abd3c4f1da7e81f00203182ea6d414ff3df891eaa5c05",
    "f32-breadcrumbs_ties": "739c58b9e353122fc408b451ce70464562855788847923a0d8ac303d9acb977b",
    "f32-dare_ties": "8063ec394099e34fa25f905791ffab8c7eedabb052559ae0dd94612ac76d1b32",
    "f32-slerp": "901e433adfa43b03eb347fb2923bcb926b4020facd7d5364a8d745682241a1c8",
    "f32-task_arithmetic": "0d4fdf795e858b216b065555be84d66385f112a96aea02b35a1b6f5d22ecbc2e",
    "f32-ties": "6beaff44c3cb7bd60c9655d5239b28d141bc17e4a66cf63908496b92e302416e",
    "sharded-base-ties": "3594945755653a455a90e980641ca71065168750b69e51efb9cba3fd7bf6ff9e",
}
# the manifests without their version fields (tests/golden.py::manifest_digest): plans,
# access sets, byte counts, bounds and output hashes
PLANS = {
    "bf16-breadcrumbs": "dadbe33bc1f206901f1c5eb2baf180c0c3f29eaa4d93a39f3b68dc73f5173d2d",
    "bf16-breadcrumbs_ties": "60ca74c1ffac0ab9fc20b3901286c2219964898c4c794831eb7ec577a0213a57",
    "bf16-dare_linear": "5763eb8391beb2047ce560fd5aa658e668d8f3dcf9b377903f8a3367e91f267f",
    "bf16-dare_ties": "5049fb6ea6d3282d83def258384ffe9580d7d6ccb32b9d6e2bf87e03899e9f8c",
    "bf16-linear": "b9e67577202946b8f7f5f81a31400cd35fa9c7b863fa67b0ba692c95b06ea2a0",
    "bf16-slerp": "a6e7883932a3085d57cae1e7f8e6c648f005deda8575141ab7e95646b394ffb7",
    "bf16-ta-30pct": "fecb388ba13397d5785e4e6babe95c3235be26c162a25c442ec37a91a48a3bbc",
    "bf16-ta-to-f32": "1b69e9a9eea93fff85e492ffb0eaa608cbb39dd123876424efc488c1c9561d3e",
    "bf16-task_arithmetic": "725c9c4dd0a9ab9259ceb4ee948898a6eaff30f65eaa2f3acf36a88d443490de",
    "bf16-ties": "91f122d0c7817f880862ea0950354350a7f9f8c540d7af0e5b5604cf0b1503a7",
    "bf16-ties-30pct": "6df01b093600f30e26967bc9b03e4d50ca28559f36e55296ccafbd1512ee8e3a",
    "f32-breadcrumbs_ties": "980c12ddb58bb5b0c46fb107b40171b4efc6d2d80c79ad1b56480b143a64caac",
    "f32-dare_ties": "650f5aac7013fd3a1acafea38892afa8079fa499076e9acf922dab8497f0a552",
    "f32-slerp": "427f283c4fdb0db92bc1846722a4825127c04df93e432065f5a5713edaf08596",
    "f32-task_arithmetic": "f28f51d54319bfa9d0af52a1edf20d2762b1480f2c1369fd0dd390f6509cf42b",
    "f32-ties": "c5f314a72a5a5631435285e382e21cabd0ecd2bf02b4d61f3be3484c4cf90e18",
    "sharded-base-ties": "6d0cb72a5f021ea2be96460e356c83d344c9f94a1248ba0f306534c35cc74c1e",
}

# numpy's runtime-dispatched SIMD paths that this CPU has, all turned off in one setting
NUMPY_SIMD = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
SETTINGS = {
    "default": ({}, []),
    "torch-path-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, ["--torch-path"]),
    # OpenBLAS's generic SSE3 kernels: anything left on BLAS would sum in another order here
    "scalar-1-thread": ({"ATEN_CPU_CAPABILITY": "default", "NUMBA_CPU_NAME": "generic", "OMP_NUM_THREADS": "1",
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
