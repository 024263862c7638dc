/* A LoRA module's Δ for a run of rows, in C: the fixed-order fp32 sum of checkpoint/lora.py's
 * Delta.rows (the torch path), so the bytes are the same (tests/test_lora_kernel.py). Loaded
 * with ctypes by checkpoint/_lora_kernel.py; ctypes releases the GIL, so the engine's reader
 * threads make Δ blocks side by side.
 *
 * Built with -ffp-contract=off and without fast-math: every operation is one IEEE fp32
 * operation (no l*r+acc fused into an FMA), whatever the vector width; the compiler may
 * vectorize over columns, which keeps each element's order of operations.
 *
 * Per element (i, j), k = 0..rank-1 in order, each product and each sum rounded to fp32:
 *   acc = l[i,0]*r[0,j];  acc = acc + l[i,k]*r[k,j];  out[i,j] = acc * scale
 * with left (rows, rank) and right (rank, cols) row-major fp32, out (rows, cols) fp32.
 */
#include <Python.h>
#include <stdint.h>

void mp_lora_rows_f32(const float *left, const float *right, int64_t rows, int64_t rank, int64_t cols,
                      float scale, float *out) {
    for (int64_t i = 0; i < rows; i++) {
        const float *l = left + i * rank;
        float *o = out + i * cols;
        const float l0 = l[0];
        for (int64_t j = 0; j < cols; j++) o[j] = l0 * right[j];
        for (int64_t k = 1; k < rank; k++) {
            const float lk = l[k];
            const float *rk = right + k * cols;
            for (int64_t j = 0; j < cols; j++) {
                const float term = lk * rk[j];
                o[j] = o[j] + term;
            }
        }
        for (int64_t j = 0; j < cols; j++) o[j] = o[j] * scale;
    }
}

/* setup.py builds this file once per x86-64 level, as _lorac, _lorac_v3 and _lorac_v4 (MP_MODULE):
 * the module object exists only so that the build is an importable extension. */
#ifndef MP_MODULE
#define MP_MODULE _lorac
#endif
#define MP_CAT2(a, b) a##b
#define MP_CAT(a, b) MP_CAT2(a, b)
#define MP_STR2(x) #x
#define MP_STR(x) MP_STR2(x)
#define MP_INIT(m) MP_CAT(PyInit_, m)
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MP_STR(MP_MODULE), NULL, -1, NULL};
PyMODINIT_FUNC MP_INIT(MP_MODULE)(void) { return PyModule_Create(&module); }
