/* Compiled loops of the delta index (index/scan.py), in C: the same results as the numba
 * kernels of index/kernels.py, which remain the fallback where this library was not built
 * (tests/test_index_kernels.py checks the two against each other). Built as the extension
 * module `_indexc`, loaded with ctypes by index/ckernels.py: indexing an expert then never
 * imports numba (~0.7 s of import and cached-kernel loading per process), and one pass per
 * block does what five numba passes did (decode, |delta|, the fixed-order sums, the
 * histogram).
 *
 * Exactness: counts are integers; sums are fp64 over fp32 values (products exact in fp64),
 * element i in lane i % 8, lanes combined ((0+1)+(2+3))+((4+5)+(6+7)): the order of
 * index/kernels.py, which vectorizing across lanes does not change. Built with
 * -ffp-contract=off and without fast-math.
 */
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define CHUNK 1024 /* elements per chunk: its fp32 values stay in L1 between the loops */
#define NONFINITE_BITS 0x7F800000u /* |x| patterns at or above +inf: Inf and NaN */

static inline float bf16_to_f32(uint16_t u) {
    uint32_t bits = (uint32_t)u << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline double combine(const double *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The per-block statistics of |expert - base| (fp32), one pass:
 *   d[i] = |e_i - b_i|  (its int32 pattern is the histogram key: non-negative, so integer
 *                        order is float order, NaN above +inf)
 *   hist[(bits >> 16) & 0x7FFF] += 1 for every element (hist may be NULL: not counted)
 *   out[0..2] = sum b^2, sum e^2, sum b*e (fp64, fixed order: slerp's angle)
 *   out[3..4] = sum d^2, sum d over the finite d (fp64, fixed order: block norms)
 *   counts[0] = elements with d != 0, counts[1] = elements with d not finite. */
/* Four lanes as a GCC vector type, two of them for the eight: lane l of an accumulator sums
 * the elements i with i % 8 == l, in order. Each lane's operations are the scalar IEEE ones,
 * so the vector width the compiler lowers these to (SSE2, AVX2, AVX-512) changes nothing.
 * (Eight-wide fp64 vectors spilled to the stack on AVX2: 4x slower.) */
typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v4f load4(const uint16_t *p) {
    uint16_t h[4];
    memcpy(h, p, sizeof h);
    v4u u = {h[0], h[1], h[2], h[3]};
    return (v4f)(u << 16); /* a vector cast reinterprets the bits */
}

static inline __attribute__((always_inline)) v4f load4f(const float *p) {
    v4f f;
    memcpy(&f, p, sizeof f);
    return f;
}

/* lanes 0-3 and 4-7 of the eight */
struct lanes { v4d lo, hi; };

static inline __attribute__((always_inline)) void slerp4(v4f b, v4f e, float *x, v4d *bb, v4d *ee, v4d *be) {
    v4u bits = (v4u)(e - b) & 0x7FFFFFFFu; /* |d|: fabsf's bits (NaN payload kept) */
    memcpy(x, &bits, sizeof bits);
    v4d p = __builtin_convertvector(b, v4d), q = __builtin_convertvector(e, v4d);
    *bb += p * p;
    *ee += q * q;
    *be += p * q;
}

static inline __attribute__((always_inline)) void norms4(const float *x, v4d *sq, v4d *l1, v4u *nz, v4u *nf) {
    v4u bits;
    memcpy(&bits, x, sizeof bits);
    v4u finite = (v4u)(bits < NONFINITE_BITS); /* all ones where finite */
    v4d v = __builtin_convertvector((v4f)bits, v4d);
    v = (v4d)((v4l)v & __builtin_convertvector((v4i)finite, v4l)); /* non-finite -> +0.0: the sums */
    *sq += v * v;                                                  /* stay >= +0, so adding it is exact */
    *l1 += v;
    *nz += (v4u)(bits != 0) & 1u;
    *nf += ~finite & 1u;
}

/* One block: per chunk, pass A stores |d| and adds the slerp sums, pass B rereads |d| from L1
 * for the finite norms and the counts (two short loops keep the accumulators in registers),
 * then the histogram; the last n % 8 elements lane by lane. */
#define DELTA_STATS(NAME, T, LOAD4, LOAD1)                                                      \
    void NAME(const T *base, const T *expert, int64_t n, float *d, int64_t *hist,       \
                     double *out, int64_t *counts) {                                            \
        v4d bb0 = {0}, bb1 = {0}, ee0 = {0}, ee1 = {0}, be0 = {0}, be1 = {0};                   \
        v4d sq0 = {0}, sq1 = {0}, l10 = {0}, l11 = {0};                                         \
        int64_t nnz = 0, nonfinite = 0;                                                         \
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) { /* CHUNK is a multiple of 8 */             \
            int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK, m8 = m & ~(int64_t)7, i;               \
            const T *bp = base + c0, *ep = expert + c0;                                         \
            float *x = d + c0;                                                                  \
            for (i = 0; i < m8; i += 8) {                                                       \
                slerp4(LOAD4(bp + i), LOAD4(ep + i), x + i, &bb0, &ee0, &be0);                  \
                slerp4(LOAD4(bp + i + 4), LOAD4(ep + i + 4), x + i + 4, &bb1, &ee1, &be1);      \
            }                                                                                   \
            v4u nz = {0}, nf = {0};                                                             \
            for (i = 0; i < m8; i += 8) {                                                       \
                norms4(x + i, &sq0, &l10, &nz, &nf);                                            \
                norms4(x + i + 4, &sq1, &l11, &nz, &nf);                                        \
            }                                                                                   \
            nnz += (int64_t)nz[0] + nz[1] + nz[2] + nz[3];                                      \
            nonfinite += (int64_t)nf[0] + nf[1] + nf[2] + nf[3];                                \
            if (hist) {                                                                         \
                const uint32_t *xb = (const uint32_t *)x;                                       \
                for (i = 0; i < m8; i++) hist[(xb[i] >> 16) & 0x7FFF]++;                        \
            }                                                                                   \
        }                                                                                       \
        double a[5][8];                                                                         \
        v4d halves[5][2] = {{bb0, bb1}, {ee0, ee1}, {be0, be1}, {sq0, sq1}, {l10, l11}};        \
        memcpy(a, halves, sizeof a);                                                            \
        for (int64_t i = n & ~(int64_t)7; i < n; i++) { /* the tail, lane by lane */            \
            float b = LOAD1(base[i]), e = LOAD1(expert[i]), x = __builtin_fabsf(e - b);         \
            d[i] = x;                                                                           \
            uint32_t bits;                                                                      \
            memcpy(&bits, &x, sizeof bits);                                                     \
            double p = b, q = e, v = bits < NONFINITE_BITS ? (double)x : 0.0;                   \
            int l = (int)(i & 7);                                                               \
            a[0][l] += p * p;                                                                   \
            a[1][l] += q * q;                                                                   \
            a[2][l] += p * q;                                                                   \
            a[3][l] += v * v;                                                                   \
            a[4][l] += v;                                                                       \
            nnz += bits != 0;                                                                   \
            nonfinite += bits >= NONFINITE_BITS;                                                \
            if (hist) hist[(bits >> 16) & 0x7FFF]++;                                            \
        }                                                                                       \
        for (int k = 0; k < 5; k++) out[k] = combine(a[k]);                                     \
        counts[0] = nnz;                                                                        \
        counts[1] = nonfinite;                                                                  \
    }

#define LOAD_BF16(u) bf16_to_f32(u)
#define LOAD_F32(x) (x)
DELTA_STATS(mp_delta_stats_bf16, uint16_t, load4, LOAD_BF16)
DELTA_STATS(mp_delta_stats_f32, float, load4f, LOAD_F32)

/* sum b^2, sum e^2, sum b*e of two fp32 arrays (an identical block: base twice). */
void mp_slerp_sums_f32(const float *b, const float *e, int64_t n, double *out) {
    double bb[LANES] = {0}, ee[LANES] = {0}, be[LANES] = {0};
    for (int64_t i = 0; i < n; i++) {
        double x = b[i], y = e[i];
        int l = (int)(i & (LANES - 1));
        bb[l] += x * x;
        ee[l] += y * y;
        be[l] += x * y;
    }
    out[0] = combine(bb);
    out[1] = combine(ee);
    out[2] = combine(be);
}

/* table[(bits & 0xFFFF) * stride + slot] += 1 for every element, slot = slot_of_bin[upper 16
 * bits], stride = m + 1: the target bins have slots 0..m-1, every other bin slot m (dropped by
 * the caller). No data-dependent branch on the slot: most elements of bf16 deltas fall in
 * target bins, and skipping the others by a branch or counting them into spare entries was
 * 2-3x slower. Each entry's first use is appended to `occupied`. Returns the new count. */
#define COUNT_LOW(NAME, TT)                                                                     \
    int64_t NAME(const int32_t *bits, int64_t n, const int64_t *slot_of_bin, int64_t m,  \
                        TT *table, int64_t *occupied, int64_t n_occupied) {                     \
        int64_t stride = m + 1, k = n_occupied;                                                 \
        for (int64_t i = 0; i < n; i++) {                                                       \
            uint32_t b = (uint32_t)bits[i];                                                     \
            int64_t j = (int64_t)(b & 0xFFFF) * stride + slot_of_bin[(b >> 16) & 0x7FFF];       \
            if (table[j] == 0) occupied[k++] = j;                                               \
            table[j]++;                                                                         \
        }                                                                                       \
        return k;                                                                               \
    }

COUNT_LOW(mp_count_low_i32, int32_t)
COUNT_LOW(mp_count_low_i64, int64_t)

/* counts[k] += elements equal to wanted[k], k = index_of_bin[upper 16 bits]; the last
 * counter (k = n_counts - 1) is the ignored one. Eight lanes per counter, so that runs of
 * elements on the same counter do not wait on each other's stores. Returns -1 without
 * memory. */
int mp_count_equal(const int32_t *bits, int64_t n, const int64_t *index_of_bin, const int32_t *wanted,
                          int64_t *counts, int64_t n_counts) {
    int64_t *lanes = calloc((size_t)n_counts * LANES, sizeof *lanes);
    if (!lanes) return -1;
    for (int64_t i = 0; i < n; i++) {
        int32_t b = bits[i];
        int64_t k = index_of_bin[((uint32_t)b >> 16) & 0x7FFF];
        lanes[k * LANES + (i & 7)] += wanted[k] == b;
    }
    for (int64_t k = 0; k < n_counts; k++) {
        int64_t s = 0;
        for (int l = 0; l < LANES; l++) s += lanes[k * LANES + l];
        counts[k] += s;
    }
    free(lanes);
    return 0;
}

/* An importable (empty) module, so the build and the loader can find this library. setup.py
 * builds this file once per x86-64 level, as _indexc, _indexc_v3 and _indexc_v4 (MP_MODULE):
 * util/cpu.py picks the build the CPU runs. */
#ifndef MP_MODULE
#define MP_MODULE _indexc
#endif
#define MP_CAT(a, b) a##b
#define MP_INIT(m) MP_CAT(PyInit_, m)
#define MP_STR(m) MP_XSTR(m)
#define MP_XSTR(m) #m
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MP_STR(MP_MODULE), NULL, -1, NULL};
PyMODINIT_FUNC MP_INIT(MP_MODULE)(void) { return PyModule_Create(&module); }
