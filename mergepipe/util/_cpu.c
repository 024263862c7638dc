/* Which x86-64 microarchitecture level (psABI: 1 = baseline SSE2, 2 = SSE4.2, 3 = AVX2/FMA,
 * 4 = AVX-512) this CPU and its OS can run, from CPUID and XGETBV as the compiler runtime
 * reads them; 0 on other architectures. util/cpu.py reads it to choose among the kernel
 * builds (one per level); it is built for the baseline, so it runs on any x86-64. */
#include <Python.h>

int mp_cpu_level(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
#if !defined(__clang__) && __GNUC__ >= 12
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
    if (__builtin_cpu_supports("x86-64-v2")) return 2;
#else /* the features each level's kernels use (a subset of the level's list) */
    int v2 = __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("ssse3") &&
             __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("sse4.2");
    int v3 = v2 && __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
    if (v4) return 4;
    if (v3) return 3;
    if (v2) return 2;
#endif
    return 1;
#else
    return 0;
#endif
}

/* An importable (empty) module, so the build and the loader can find this library. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&module); }
