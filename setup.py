"""The C extensions (everything else is in pyproject.toml).

Each kernel library is built once per x86-64 level: `NAME` for the compiler's baseline, and
`NAME_v3` (AVX2) and `NAME_v4` (AVX-512) with -march, so that the install runs on any x86-64
CPU and uses the widest vectors it has; mergepipe/util/cpu.py picks the build at load time.
The extra builds are optional: a compiler that cannot make one leaves the baseline.
No fused multiply-add and no fast-math in any build: every fp32 operation rounds as the torch
path's does, so every build gives the same bytes.
"""
import platform
import sys

from setuptools import Extension, setup

FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
KERNELS = {"mergepipe.index._indexc": "mergepipe/index/_indexc.c",
           "mergepipe.methods._bf16c": "mergepipe/methods/_bf16c.c",
           "mergepipe.checkpoint._lorac": "mergepipe/checkpoint/_lorac.c"}
X86 = platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32"


def builds(module: str, source: str) -> list[Extension]:
    short = module.rsplit(".", 1)[1]
    out = [Extension(module, [source], extra_compile_args=FLAGS, define_macros=[("MP_MODULE", short)])]
    for level in (3, 4) if X86 else ():
        out.append(Extension(f"{module}_v{level}", [source], optional=True,
                             extra_compile_args=[*FLAGS, f"-march=x86-64-v{level}"],
                             define_macros=[("MP_MODULE", f"{short}_v{level}")]))
    return out


setup(ext_modules=[Extension("mergepipe.util._cpu", ["mergepipe/util/_cpu.c"], extra_compile_args=FLAGS),
                   *(e for module, source in KERNELS.items() for e in builds(module, source))])
