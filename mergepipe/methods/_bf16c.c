/* Compiled bf16 merge loops for task arithmetic and TIES, in C: the same fp32 arithmetic,
 * in the same order, as methods/_kernels.py (numba) and the torch path, so the bytes are
 * the same (tests/test_merge_kernels.py). Built as the extension module `_bf16c` and
 * loaded with ctypes by methods/_ckernels.py: a process that merges from a cached index
 * then never imports numba (~0.7 s of import and cached-kernel loading per process).
 *
 * Built with -ffp-contract=off and without fast-math: every operation is one IEEE fp32
 * operation (no a*b+c fused into an FMA), whatever the CPU's vector width; the compiler
 * may vectorize, which does not change per-element results.
 *
 * The formulas (per element, experts in canonical order):
 *   delta_k = f32(E_k) - f32(B);  term_k = trim_k(delta_k) * w_k
 *   TA:   mixed = term_0 + term_1 + ...
 *   TIES: s = [sum_k term_k >= 0]; a_k = [sign(term_k) agrees with s];
 *         mixed = sum_k term_k * a_k;  divisor = sum_k a_k * w_k (1 where 0)
 *   mixed /= divisor (if normalize);  mixed *= lambda (if apply_lambda)
 *   out = bf16_round_nearest_even(f32(B) + mixed)   (NaN -> 0x7FC0, as torch)
 */
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 1024 /* elements per chunk: up to 16 experts' fp32 terms stay in L1/L2 */
enum { KEEP_ALL = 0, DROP_ALL = 1, CUT = 2 };

static inline float bf16_to_f32(uint16_t u) {
    uint32_t bits = (uint32_t)u << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t f32_to_bf16(float x) {
    /* c10::BFloat16's round_to_nearest_even: torch's float -> bfloat16 cast */
    if (x != x) return 0x7FC0;
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Task arithmetic's end of a chunk: mixed /= divisor, *= lambda, out = bf16(B + mixed). */
static inline void finish_chunk(const float *b, float *acc, int64_t m, float divisor, int normalize, float lambda_,
                                int apply_lambda, uint16_t *o) {
    if (normalize)
        for (int64_t j = 0; j < m; j++) acc[j] = acc[j] / divisor;
    if (apply_lambda)
        for (int64_t j = 0; j < m; j++) acc[j] = acc[j] * lambda_;
    for (int64_t j = 0; j < m; j++) o[j] = f32_to_bf16(b[j] + acc[j]);
}

void mp_task_arithmetic_bf16(const uint16_t *base, const uint16_t *const *experts, int64_t p,
                             const float *weights, float divisor, int normalize, float lambda_,
                             int apply_lambda, uint16_t *out, int64_t n) {
    float b[CHUNK], acc[CHUNK];
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t m = n - s < CHUNK ? n - s : CHUNK;
        const uint16_t *bs = base + s;
        for (int64_t j = 0; j < m; j++) b[j] = bf16_to_f32(bs[j]);
        const uint16_t *ek = experts[0] + s;
        float w = weights[0];
        for (int64_t j = 0; j < m; j++) acc[j] = (bf16_to_f32(ek[j]) - b[j]) * w;
        /* experts 1.. in groups of up to 3 per pass over the chunk, still added left to right
         * (GCC 12's code for one expert per pass ran 2.5x slower than numba's at K=4) */
        for (int64_t k = 1; k < p; k += 3) {
            int64_t g = p - k < 3 ? p - k : 3;
            const uint16_t *e1 = experts[k] + s;
            float w1 = weights[k];
            if (g == 1) {
                for (int64_t j = 0; j < m; j++) acc[j] = acc[j] + (bf16_to_f32(e1[j]) - b[j]) * w1;
            } else if (g == 2) {
                const uint16_t *e2 = experts[k + 1] + s;
                float w2 = weights[k + 1];
                for (int64_t j = 0; j < m; j++) {
                    float a = acc[j] + (bf16_to_f32(e1[j]) - b[j]) * w1;
                    acc[j] = a + (bf16_to_f32(e2[j]) - b[j]) * w2;
                }
            } else {
                const uint16_t *e2 = experts[k + 1] + s, *e3 = experts[k + 2] + s;
                float w2 = weights[k + 1], w3 = weights[k + 2];
                for (int64_t j = 0; j < m; j++) {
                    float a = acc[j] + (bf16_to_f32(e1[j]) - b[j]) * w1;
                    a = a + (bf16_to_f32(e2[j]) - b[j]) * w2;
                    acc[j] = a + (bf16_to_f32(e3[j]) - b[j]) * w3;
                }
            }
        }
        finish_chunk(b, acc, m, divisor, normalize, lambda_, apply_lambda, out + s);
    }
}

/* A ternary sketch's delta (index/sketch.py): d[j] = code_j * a for the m elements whose
 * codes start at byte c (code 1 = +1, 2 = -1, else 0; element i in bits 2*(i % 4) of byte
 * i / 4), the values index/sketch.unpack gives the torch path. */
static inline void sketch_decode(const uint8_t *c, float a, float *d, int64_t m) {
    int64_t q = m >> 2;
    /* code -> (bit 0) - (bit 1) as a float (+1, -1, 0; an unused code 3 is 0): arithmetic the
     * compiler vectorizes, 0.29 against 0.44 ns per element for a 256 x 4 table */
    for (int64_t t = 0; t < q; t++) {
        unsigned v = c[t];
        for (int r = 0; r < 4; r++) {
            unsigned u = (v >> (2 * r)) & 3u;
            d[4 * t + r] = (float)((int)(u & 1u) - (int)(u >> 1)) * a;
        }
    }
    for (int64_t j = 4 * q; j < m; j++) {
        unsigned u = (c[j >> 2] >> (2 * (j & 3))) & 3u;
        d[j] = (float)((int)(u & 1u) - (int)(u >> 1)) * a;
    }
}

/* Task arithmetic where some experts are ternary sketches (plan strategy `sketch`,
 * index/sketch.py): expert k's delta is f32(E_k) - f32(B) when experts[k] is set, else
 * alphas[k] * code_k (code 1 = +1, 2 = -1, else 0; element i of the block in bits 2*(i % 4)
 * of byte i / 4 of codes[k]), the values the torch path gets from index/sketch.unpack.
 * One expert per pass, left to right, the same operations as mp_task_arithmetic_bf16. */
void mp_task_arithmetic_sketch_bf16(const uint16_t *base, const uint16_t *const *experts,
                                           const uint8_t *const *codes, const float *alphas, int64_t p,
                                           const float *weights, float divisor, int normalize, float lambda_,
                                           int apply_lambda, uint16_t *out, int64_t n) {
    float b[CHUNK], acc[CHUNK], d[CHUNK];
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t m = n - s < CHUNK ? n - s : CHUNK;
        const uint16_t *bs = base + s;
        for (int64_t j = 0; j < m; j++) b[j] = bf16_to_f32(bs[j]);
        for (int64_t k = 0; k < p; k++) {
            if (experts[k] != NULL) {
                const uint16_t *ek = experts[k] + s;
                for (int64_t j = 0; j < m; j++) d[j] = bf16_to_f32(ek[j]) - b[j];
            } else {  /* s is a multiple of CHUNK, so of 4: this chunk's codes start on a byte */
                sketch_decode(codes[k] + (s >> 2), alphas[k], d, m);
            }
            float w = weights[k];
            if (k == 0)
                for (int64_t j = 0; j < m; j++) acc[j] = d[j] * w;
            else
                for (int64_t j = 0; j < m; j++) acc[j] = acc[j] + d[j] * w;
        }
        finish_chunk(b, acc, m, divisor, normalize, lambda_, apply_lambda, out + s);
    }
}

int64_t mp_eq_limit(const uint16_t *base, const uint16_t *expert, float value, int64_t eq_keep, int64_t n) {
    /* flat position just past the eq_keep-th element with |E - B| == value, or n */
    if (eq_keep <= 0) return 0;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        float d = bf16_to_f32(expert[i]) - bf16_to_f32(base[i]);
        if ((d < 0 ? -d : d) == value && ++count == eq_keep) return i + 1;
    }
    return n;
}

/* Returns 0, or -1 when p < 1 or the per-expert chunk buffer cannot be allocated.
 * codes (may be NULL): where experts[k] is NULL, expert k is the ternary sketch codes[k] with
 * scale alphas[k] (as in mp_task_arithmetic_sketch_bf16), untrimmed: term = (alpha * code) * w. */
int mp_ties_bf16(const uint16_t *base, const uint16_t *const *experts, const uint8_t *const *codes,
                 const float *alphas, int64_t p, const float *weights,
                 const int64_t *modes, const float *values, const int64_t *limits, int normalize,
                 float lambda_, int apply_lambda, uint16_t *out, int64_t n) {
    if (p < 1) return -1;
    float (*terms)[CHUNK] = malloc((size_t)p * sizeof *terms); /* p chunks of fp32 terms */
    if (terms == NULL) return -1;
    float b[CHUNK], total[CHUNK], mixed[CHUNK], div[CHUNK];
    const float one = 1.0f, zero = 0.0f;
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t m = n - s < CHUNK ? n - s : CHUNK;
        const uint16_t *bs = base + s;
        for (int64_t j = 0; j < m; j++) b[j] = bf16_to_f32(bs[j]);
        for (int64_t k = 0; k < p; k++) {
            float *tk = terms[k];
            float w = weights[k], v = values[k];
            if (experts[k] == NULL) {
                sketch_decode(codes[k] + (s >> 2), alphas[k], tk, m);
                for (int64_t j = 0; j < m; j++) tk[j] = tk[j] * w;
                continue;
            }
            const uint16_t *ek = experts[k] + s;
            int64_t lim = limits[k] - s; /* j < lim may keep a threshold-equal |delta| */
            if (modes[k] == KEEP_ALL) {
                for (int64_t j = 0; j < m; j++) tk[j] = (bf16_to_f32(ek[j]) - b[j]) * w;
            } else if (modes[k] == DROP_ALL) {
                for (int64_t j = 0; j < m; j++) tk[j] = ((bf16_to_f32(ek[j]) - b[j]) * zero) * w;
            } else {
                for (int64_t j = 0; j < m; j++) {
                    float d = bf16_to_f32(ek[j]) - b[j];
                    float a = d < 0 ? -d : d;
                    int keep = (a > v) | ((a == v) & (j < lim));
                    tk[j] = (d * (keep ? one : zero)) * w;
                }
            }
        }
        for (int64_t j = 0; j < m; j++) total[j] = terms[0][j];
        for (int64_t k = 1; k < p; k++)
            for (int64_t j = 0; j < m; j++) total[j] = total[j] + terms[k][j];
        for (int64_t k = 0; k < p; k++) {
            const float *tk = terms[k];
            float w = weights[k];
            for (int64_t j = 0; j < m; j++) {
                float t = tk[j];
                int pos = total[j] >= zero;
                float a = ((t > zero && pos) || (t < zero && !pos)) ? one : zero;
                if (k == 0) {
                    mixed[j] = t * a;
                    div[j] = a * w;
                } else {
                    mixed[j] = mixed[j] + t * a;
                    div[j] = div[j] + a * w;
                }
            }
        }
        uint16_t *o = out + s;
        for (int64_t j = 0; j < m; j++) {
            float x = mixed[j];
            if (normalize) x = x / (div[j] == zero ? one : div[j]);
            if (apply_lambda) x = x * lambda_;
            o[j] = f32_to_bf16(b[j] + x);
        }
    }
    free(terms);
    return 0;
}

/* The sketch scan of one bf16 block (index/sketch.py's block_sketch, in C: the same values):
 * d = f32(E) - f32(B), non-finite d taken as 0; codes[i / 4] bits 2*(i % 4) = 1 where d > 0,
 * 2 where d < 0; sums[e] += the integer mantissa of |d| (implicit bit added for normals) for
 * its biased exponent e, exact in uint64 for any block below 2^40 elements; returns the
 * number of nonzero d. Python turns sums into S1 with one exactly rounded fsum. */
int64_t mp_sketch_bf16(const uint16_t *base, const uint16_t *expert, int64_t n, uint8_t *codes,
                              uint64_t *sums) {
    /* four sum tables, one per element of a code byte: consecutive elements mostly share an
     * exponent, and one table would chain every add through the same memory slot */
    uint64_t part[4][256];
    int64_t nnz = 0;
    memset(part, 0, sizeof part);
    for (int64_t i = 0; i < n; i += 4) {
        unsigned byte = 0;
        int64_t m = n - i < 4 ? n - i : 4;
        for (int64_t q = 0; q < m; q++) {
            float d = bf16_to_f32(expert[i + q]) - bf16_to_f32(base[i + q]);
            uint32_t raw;
            memcpy(&raw, &d, sizeof raw);
            uint32_t bits = raw & 0x7FFFFFFFu, e = bits >> 23;
            uint32_t live = (bits != 0) & (e != 0xFFu); /* NaN/Inf sketched as 0; +-0 is 0 */
            byte |= (live << (raw >> 31)) << (2 * q);  /* 1 where d > 0, 2 where d < 0 */
            part[q][e] += live ? (bits & 0x7FFFFFu) | (e ? 0x800000u : 0u) : 0u;
            nnz += live;
        }
        codes[i >> 2] = (uint8_t)byte;
    }
    for (int e = 0; e < 256; e++) sums[e] = part[0][e] + part[1][e] + part[2][e] + part[3][e];
    return nnz;
}

/* An importable (empty) module, so the build and the loader can find this library. setup.py
 * builds this file once per x86-64 level, as _bf16c, _bf16c_v3 and _bf16c_v4 (MP_MODULE):
 * util/cpu.py picks the build the CPU runs. */
#ifndef MP_MODULE
#define MP_MODULE _bf16c
#endif
#define MP_CAT(a, b) a##b
#define MP_INIT(m) MP_CAT(PyInit_, m)
#define MP_STR(m) MP_XSTR(m)
#define MP_XSTR(m) #m
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MP_STR(MP_MODULE), NULL, -1, NULL};
PyMODINIT_FUNC MP_INIT(MP_MODULE)(void) { return PyModule_Create(&module); }
