"""Our bytes do not depend on the machine: golden merges under different CPU settings.

tests/golden.py builds a family from integers only and merges it with every method
(bf16 and fp32, a sharded base, a partial budget, a dtype change). Each setting below
runs it in a fresh interpreter; every one must give the committed weight hashes and
the same manifest bytes, and the manifests (less their version fields) are pinned too. A hash that changes means the output bytes changed: a change
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
    "f32-slerp": "8c8473ba1619ba05907253044da09005d5c54b9783dc3741581b00a3f8f14be6",
    "f32-task_arithmetic": "0d4fdf795e858b216b065555be84d66385f112a96aea02b35a1b6f5d22ecbc2e",
    "f32-ties": "6beaff44c3cb7bd60c9655d5239b28d141bc17e4a66cf63908496b92e302416e",
    "sharded-base-ties": "3594945755653a455a90e980641ca71065168750b69e51efb9cba3fd7bf6ff9e",
}
# the manifests without their version fields (tests/golden.py::manifest_digest): plans,
# access sets, byte counts, bounds and output hashes
PLANS = {
    "bf16-breadcrumbs": "4f55f07f64471334b34b90384da1117479a706cd9a35d38b13d0001be847c64a",
    "bf16-breadcrumbs_ties": "d804cb47f78046edc8bc030ea2003cedc3d53c16ddc61e8dbabaacfe6a68974f",
    "bf16-dare_linear": "6bcc506854666e31073a8a21e4e1ee001e0bda812877d978231998325c89046c",
    "bf16-dare_ties": "fa56c38a8ae2008ee70b1b86ecc4fb601b3a772bd10b752e21fea9f027701b39",
    "bf16-linear": "f534e528fb720cb6f04353970df21761ec1e24d7d8e4912a1dcf3f8605520816",
    "bf16-slerp": "d30a0a60440021cbb4b71cc8283c050109d1f60f0fc5cc91e55c1d2e2067ec15",
    "bf16-ta-30pct": "04501579d21d1f2b6782539158c914e633a5a240759aa20756ca6090e1fe14a8",
    "bf16-ta-to-f32": "fc19626891158c7acd3c1ae3a4dcb538512f5f605f465a2c591acfa5712d6eb4",
    "bf16-task_arithmetic": "3c5ba64574f1bcaab11b04f0dbb9b1023480cff87c59b91830f04e70d252bde9",
    "bf16-ties": "06cd5c4d0b610042a1cfcb8ab739d1c9758ba34bf3b2cbdc12f5c00bb335101b",
    "bf16-ties-30pct": "85b18fd1608090c24d3141262e7a3ac260a8ff3d7b5a5c58989c0a70d24b1aba",
    "f32-breadcrumbs_ties": "c9074af9934d18d311d2e6e156f2b2d25c2ab510093763d30ccf017378e5b6ee",
    "f32-dare_ties": "49bce395f372e6f7c6a70fd7d66a52ea8714a55af9a9c119ffab75086794792a",
    "f32-slerp": "4f7a2c5ff137c3abadde759e30335472f39a5263fee991d9e00daa0c061b4b72",
    "f32-task_arithmetic": "b7a1598748d56c7c2a668df244c60f5e470d665ce59126b78f7b69928f4902fc",
    "f32-ties": "acffdf587fb0d5a8ff73361f8f1b53645bdf4b2910e9a2b308d0b90e518f62c5",
    "sharded-base-ties": "02fe345ed280847ed9d02a1d1d72e8aa1d7d99063af65dee7b12139cb3f0e45a",
}

# numpy's runtime-dispatched SIMD paths that this CPU has, all turned off in one setting
NUMPY_SIMD = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
SETTINGS = {
    "default": ({}, []),
    "torch-path-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, ["--torch-path"]),
    "scalar-1-thread": ({"ATEN_CPU_CAPABILITY": "default", "NUMBA_CPU_NAME": "generic", "OMP_NUM_THREADS": "1",
                         "NPY_DISABLE_CPU_FEATURES": NUMPY_SIMD}, ["--threads", "1"]),
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
