"""Our bytes do not depend on the machine: golden merges under different CPU settings.

tests/helpers/golden.py builds a family from integers only and merges it with every method
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
(issue 24; output/hf_config.py). PLANS changed once more, every weight unchanged, when plans
began to record the base's copied non-weight files, base.files {name: blake3} (issue 28:
same plan hash, same bytes; commands/base_files.py).) A hash that changes means the output
bytes changed: a change of behaviour, to be made on purpose (and the hashes updated in the
same commit), never by a refactor.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

from mergepipe.plan.load import load_plan, recorded_plan
from mergepipe.plan.record import plan_json
from mergepipe.util.fs import canonical_json
from tests.helpers.golden import CASES

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
# the manifests without their version fields (tests/helpers/golden.py::manifest_digest): plans,
# access sets, byte counts, bounds and output hashes
PLANS = {
    "bf16-breadcrumbs": "f683768678c1bc569bed8d4f4efb886d6f29f7cdf2d6546bccaeeda8748e5e9d",
    "bf16-breadcrumbs_ties": "13e5685f8aed357e639f32a7f01c36f44dcb665e2430ee268d191dfd5db960af",
    "bf16-dare_linear": "510c03a6046bc35a1a0e546c92a2e845ea8e5d3871a05286f527f62eb2c4d44c",
    "bf16-dare_ties": "44364aeab8cf53a932950fde3cbcb446366ad53337356ba18730e586cf1bb657",
    "bf16-linear": "79c4b408419f3c293215cb674075e72f8d9111a5fb55fb06cf3bd0c7f9e2616c",
    "bf16-slerp": "3c5ff2bf2879c0b10e96b220d0f6b289c6b2c7c09008db457e57ebcf1f5cb858",
    "bf16-ta-30pct": "e1489022d6897e2df520058caf7659bbb2516192035eaa2f723ad36165c6a677",
    "bf16-ta-30pct-sketch": "aa4c15e547ed753be813d49f9d6287d315f7b1497674998e17a7568a48651220",
    "bf16-ta-to-f32": "1878a2376d13eeccfaff3711e6d5f6d161ae7ccf64d2451c46dc6d73a73d9968",
    "bf16-task_arithmetic": "26092eb7095efc4bcec88c1b848602fcebcc0fa7b1800946d335246f05b93a66",
    "bf16-ties": "909a3fc1c8480d5a249cb2e771461d4be6c71f54056706b213ffed9a471ff22f",
    "bf16-ties-30pct": "bade57100eb76e42f7e7ff52ca3d337a11505ed2324c8c4dd0477219d4fd4796",
    "bf16-ties-30pct-sketch": "a602b9e8b0a30b0a3f37c0189c3f5814b8a5e8831a034d61624252552212da51",
    "f32-breadcrumbs_ties": "e3fbcbdfecc03fb56567f023dee22ea631baf4c3e4191dd97199e7a39e9c66f8",
    "f32-dare_ties": "40947bf84642360320fa948e32948f74edb7c62a5fd838af6e8ecba038707db6",
    "f32-slerp": "4860ba9082fb823e0b97dd2f21bea4486f9712319b92ba28c615614711727f72",
    "f32-task_arithmetic": "fc61b32654442f9ff5121e489dfe64e64f7e10f235400a5f1cced3585b67ce2d",
    "f32-ties": "f75a92af173d428e32069e01888d1b1fbc836b19db7ab96798da176201b0087b",
    "sharded-base-ties": "c71b51c40db1d4c00ee554e92584b6b9d8acd08f9ee0e2afd9d8f355ae1cbb48",
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


ROOTS: dict[str, Path] = {}  # setting -> the folder its cases were merged in (cases/NAME/out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each setting in its own interpreter, all started at once: they share nothing (own folder,
    own output files), so running them side by side changes only the wall time, never a byte."""
    procs = {}
    for name, (env, args) in SETTINGS.items():
        root, logs = tmp_path_factory.mktemp(f"golden-{name}"), tmp_path_factory.mktemp(f"golden-{name}-logs")
        ROOTS[name] = root
        argv = [sys.executable, "-m", "tests.helpers.golden", str(root), *args]
        with open(logs / "stdout.json", "wb") as out, open(logs / "stderr.txt", "wb") as err:
            procs[name] = (logs, subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=err,
                                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    results = {}
    try:
        for name, (logs, proc) in procs.items():
            assert proc.wait(timeout=600) == 0, f"{name}: {(logs / 'stderr.txt').read_text()[-3000:]}"
            results[name] = json.loads((logs / "stdout.json").read_text())
    finally:  # a failed setting leaves no interpreter of the others running
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


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


def test_golden_plans_load_and_dump_to_their_bytes(runs, tmp_path):
    """Each golden output's recorded plan, written as a plan file, loads (plan/load.py) to a
    record whose JSON is the file's bytes, and is the manifest's plan."""
    manifests = sorted((ROOTS["default"] / "cases").glob("*/out/manifest.json"))
    assert len(manifests) == len(CASES)
    for path in manifests:
        man = json.loads(path.read_text())
        assert canonical_json(plan_json(recorded_plan(man, f"{path}: plan"))) == canonical_json(man["plan"])
        plan_file = tmp_path / f"{path.parent.parent.name}.json"
        plan_file.write_bytes(canonical_json(man["plan"]) + b"\n")
        assert canonical_json(plan_json(load_plan(plan_file))) + b"\n" == plan_file.read_bytes()
