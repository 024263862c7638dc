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
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t u) {
    uint32_t bits = (uint32_t)u << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

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

/* Task arithmetic over LoRA adapter experts of one bf16 base tensor, for a run of its rows, in
 * one pass over the base rows (engine/adapter_sums.py). Per element (i, j), adapters in the
 * given order (the merge's expert order), every operation one IEEE fp32 operation:
 *   b = f32(B[i,j])
 *   adapter k with factors: D = the Δ of mp_lora_rows_f32 (k = 0..r-1 in order, then * scale);
 *                           E = f32(bf16(b + D))   (its expert's element: Adapter.merged_rows)
 *   adapter k without:      E = b                  (its expert holds the base's bytes)
 *   t = (E - b) * w_k;  acc = t for the first adapter, acc + t after
 *   acc = acc / divisor (if normalize);  acc = acc * lambda (if apply_lambda)
 *   out = bf16(b + acc)
 * which is mp_task_arithmetic_bf16 (methods/_bf16c.c) over the experts' bytes, so the same
 * bytes as merging the adapters' virtual experts (tests/test_adapter_sums.py). bf16() rounds to
 * nearest even, NaN to 0x7FC0, as torch and _bf16c.c do.
 *
 * The work is tiled: CC columns at a time (each adapter's R rows of them packed, zero-padded, so
 * that every adapter's tile stays in L2 across the rows), MR rows at a time, and a register
 * block of MR rows x NV vectors for the Δ sum, so each R element loaded serves MR rows. Tiles
 * change which elements are computed together, never an element's operations or their order.
 * Padded rows and columns are computed and dropped. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX2__)
#define VW 8
#else
#define VW 4
#endif
#define MR 4           /* rows per register block */
#define NV 2           /* vectors of VW columns per register block */
#define CC 256         /* columns per tile: a multiple of NV * VW at every width */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf vload(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void vstore(float *p, vf x) { memcpy(p, &x, sizeof x); }

/* the fp32 value of bf16(x), rounded to nearest even (NaN -> 0x7FC0), lane by lane */
static inline vf vround_bf16(vf x) {
    vu u = (vu)x;
    vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    vu nan = (vu)(x != x);
    return (vf)((r & ~nan) | (nan & 0x7FC00000u));
}

static inline uint16_t round_bf16_bits(float x) {
    if (x != x) return 0x7FC0;
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Δ of MR rows x NV*VW columns: l[m] the rows' factor rows (rank values each), r the packed
 * tile (rank rows of CC floats, starting at this block's column); then * scale. */
static inline void delta_block(const float *const *l, const float *r, int64_t rank, float scale, vf d[MR][NV]) {
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) d[m][v] = l[m][0] * vload(r + v * VW);
    for (int64_t k = 1; k < rank; k++) {
        const float *rk = r + k * CC;
        vf x[NV];
        for (int v = 0; v < NV; v++) x[v] = vload(rk + v * VW);
        for (int m = 0; m < MR; m++) {
            const float lk = l[m][k];
            for (int v = 0; v < NV; v++) {
                const vf term = lk * x[v];
                d[m][v] = d[m][v] + term;
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) d[m][v] = d[m][v] * scale;
}

/* acc = t, or acc + t after the first adapter, with t = (e - b) * w: one adapter's term */
static inline void accumulate(float *acc, vf b, vf e, float w, int first) {
    const vf t = (e - b) * w;
    vstore(acc, first ? t : vload(acc) + t);
}

/* base, out: rows x cols bf16, row-major. Adapter k: lefts[k] its rows' factor rows (rows x
 * ranks[k] fp32, row-major) or NULL (no Δ of this tensor), rights[k] (ranks[k] x cols fp32,
 * row-major), scales[k], weights[k]. Returns 0, or -1 when p < 1 or the tile buffer cannot be
 * allocated. */
int mp_lora_task_arithmetic_bf16(const uint16_t *base, int64_t rows, int64_t cols, int64_t p,
                                 const float *const *lefts, const float *const *rights, const int64_t *ranks,
                                 const float *scales, const float *weights, float divisor, int normalize,
                                 float lambda_, int apply_lambda, uint16_t *out) {
    if (p < 1) return -1;
    int64_t total_rank = 0;
    for (int64_t k = 0; k < p; k++) total_rank += lefts[k] != NULL ? ranks[k] : 0;
    float *packed = malloc((size_t)(total_rank > 0 ? total_rank : 1) * CC * sizeof(float));
    if (packed == NULL) return -1;
    float bt[MR][CC] __attribute__((aligned(64))), acc[MR][CC] __attribute__((aligned(64)));
    for (int64_t c0 = 0; c0 < cols; c0 += CC) {
        const int64_t cn = cols - c0 < CC ? cols - c0 : CC;
        const int64_t cp = (cn + NV * VW - 1) / (NV * VW) * (NV * VW);
        float *dst = packed;
        for (int64_t k = 0; k < p; k++) {
            if (lefts[k] == NULL) continue;
            for (int64_t q = 0; q < ranks[k]; q++, dst += CC) {
                memcpy(dst, rights[k] + q * cols + c0, (size_t)cn * sizeof(float));
                memset(dst + cn, 0, (size_t)(CC - cn) * sizeof(float));
            }
        }
        for (int64_t i0 = 0; i0 < rows; i0 += MR) {
            const int64_t mr = rows - i0 < MR ? rows - i0 : MR;
            for (int m = 0; m < MR; m++) {
                const uint16_t *src = base + (i0 + (m < mr ? m : 0)) * cols + c0;
                for (int64_t j = 0; j < cn; j++) bt[m][j] = bf16_to_f32(src[j]);
                for (int64_t j = cn; j < cp; j++) bt[m][j] = 0.0f;
            }
            const float *tile = packed;
            for (int64_t k = 0; k < p; k++) {
                if (lefts[k] == NULL) {
                    for (int m = 0; m < MR; m++)
                        for (int64_t j = 0; j < cp; j += VW) {
                            const vf b = vload(&bt[m][j]);
                            accumulate(&acc[m][j], b, b, weights[k], k == 0);
                        }
                    continue;
                }
                const float *l[MR];
                for (int m = 0; m < MR; m++) l[m] = lefts[k] + (i0 + (m < mr ? m : 0)) * ranks[k];
                for (int64_t v0 = 0; v0 < cp; v0 += NV * VW) {
                    vf d[MR][NV];
                    delta_block(l, tile + v0, ranks[k], scales[k], d);
                    for (int m = 0; m < MR; m++)
                        for (int v = 0; v < NV; v++) {
                            const vf b = vload(&bt[m][v0 + v * VW]);
                            accumulate(&acc[m][v0 + v * VW], b, vround_bf16(b + d[m][v]), weights[k], k == 0);
                        }
                }
                tile += ranks[k] * CC;
            }
            for (int m = 0; m < mr; m++) {
                uint16_t *o = out + (i0 + m) * cols + c0;
                for (int64_t j = 0; j < cn; j++) {
                    float a = acc[m][j];
                    if (normalize) a = a / divisor;
                    if (apply_lambda) a = a * lambda_;
                    o[j] = round_bf16_bits(bt[m][j] + a);
                }
            }
        }
    }
    free(packed);
    return 0;
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
