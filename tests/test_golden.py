"""Our bytes do not depend on the machine: golden merges under different CPU settings.

tests/golden.py builds a family from integers only and merges it with every method
(bf16 and fp32, a sharded base, a partial budget, a dtype change). Each setting below
runs it in a fresh interpreter; every one must give the committed weight hashes and
the same manifest bytes, and the manifests (less their version fields) are pinned too.
(The hashes changed once, on purpose, when the delta index's sums left BLAS: np.dot's
summation order followed OpenBLAS's per-CPU kernel, so plan bounds and slerp angles,
hence f32 slerp outputs, differed between CPUs; see index/kernels.py.) A hash that changes means the output bytes changed: a change
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
    "bf16-breadcrumbs": "e39253cad9782aca070b808e0cd5168d541e12a803def42b3ed65f7feb504e4d",
    "bf16-breadcrumbs_ties": "a8c746814d73fc8b84c9c6c9051339f1fb0cbb1e86605c9e50afaba9cbffc045",
    "bf16-dare_linear": "992f6a0819a4a4862ff9dc4e073dd1aa6d2b7301dadf506b167ca3f0e1085dbe",
    "bf16-dare_ties": "a7be79ff2bad1173e6d585d118133ff78fcdd4fabdc53380b9a34c84e37b7857",
    "bf16-linear": "88313b6d4d2db944e6c6b8a47f57a222358d6a048d3c6475dc044f3c22f39498",
    "bf16-slerp": "e592e2f9a3b7e13784885cd503225e0f65a958c21e9ca7a9fba2ef6803f66e73",
    "bf16-ta-30pct": "f65c0d39592e10156f70904b89820dda2f50e52198f74f8b8258f8534d487956",
    "bf16-ta-to-f32": "4e9e98aa4c476c49cbe0b16c917f7c6c31919e84aa422b8c0a204b3f6c7f95ba",
    "bf16-task_arithmetic": "5353eb978db112d5ecfc9cff2172dbab01974e987b1ce242a1afb71ec1a1bec8",
    "bf16-ties": "60a838f09bf0652ab01b67c6f5e9722332001d51b0ba8d0f20138cf033b990b5",
    "bf16-ties-30pct": "ed91136e7a87200b80af929e5901cc21350378b5cef932d9f603b9e268ddc554",
    "f32-breadcrumbs_ties": "25a5c77164abbc8a113f1258ef5e890bb937603745aacf22c88c1b7663aab7c7",
    "f32-dare_ties": "5442a8acd71e95eacff5572dc74e19a5876ae8d1a5f3a3c45979a51b7eaa0861",
    "f32-slerp": "0110107612ff5a78958b1c1fafb421d5dc8f93a207f665339118309353fcf45d",
    "f32-task_arithmetic": "2471cf4e5ce4a2545379868010bc072c6876bc792992b6c408bd445be26a0f04",
    "f32-ties": "19b5096eddcf65934a25b80c99a4d52df191093079b38fcc7cdfe0409153ea45",
    "sharded-base-ties": "fc91cb91eb4f46d5fcd89577a146443f3fba6a8c845bfda4df16ef586e864f11",
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
