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
#include <math.h>

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

/* Blocks where every expert is a sketch (the common block of a budgeted merge): each element's
 * merged delta is a function of its experts' codes alone, so it is computed once per block for
 * each combination of codes, by the same fp32 operations in the same order as the chunked
 * loops, into a table of 4^p entries (p <= TABLE_MAX); the element pass is then one table
 * lookup, one add and one rounding per element: out = bf16(f32(B) + table[codes]). */
#define TABLE_MAX 4 /* one code byte per expert spreads into 4 element keys of 8 bits */

/* code u's delta, as sketch_decode gives it */
static inline float code_value(unsigned u, float a) { return (float)((int)(u & 1u) - (int)(u >> 1)) * a; }

/* byte c's four 2-bit codes, element r's at bits 8r..8r+1 */
static inline uint32_t spread(uint32_t c) {
    return (c & 0x3u) | ((c & 0xCu) << 6) | ((c & 0x30u) << 12) | ((c & 0xC0u) << 18);
}

/* expert k's code of element j, at bits 2k..2k+1 of its key */
static inline uint32_t element_key(const uint8_t *const *codes, int p, int64_t j) {
    uint32_t key = 0;
    for (int k = 0; k < p; k++) key |= (uint32_t)((codes[k][j >> 2] >> (2 * (j & 3))) & 3u) << (2 * k);
    return key;
}

/* A chunk at a time: the elements' keys as bytes (element j's at byte j; a code byte of each
 * expert spreads into four keys, stored with one 4-byte store where the byte order allows),
 * then one flat loop of lookups, which the compiler vectorizes (gathers at x86-64-v3 and up):
 * 1.3-1.8x faster than one code byte's four elements at a time, each element's value the same. */
static inline __attribute__((always_inline)) void table_pass(const int p, const uint16_t *base,
        const uint8_t *const *codes, const float *table, uint16_t *out, int64_t n) {
    int64_t whole = n & ~(int64_t)3; /* elements whose code byte holds four of the block's */
    uint8_t key[CHUNK];
    for (int64_t s = 0; s < whole; s += CHUNK) {
        int64_t m = whole - s < CHUNK ? whole - s : CHUNK, t0 = s >> 2;
        for (int64_t t = 0; t < m >> 2; t++) {
            uint32_t keys = 0;
            for (int k = 0; k < p; k++) keys |= spread(codes[k][t0 + t]) << (2 * k);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            memcpy(key + 4 * t, &keys, 4); /* byte r is element r's key */
#else
            for (int r = 0; r < 4; r++) key[4 * t + r] = (uint8_t)(keys >> (8 * r));
#endif
        }
        const uint16_t *bs = base + s;
        uint16_t *o = out + s;
        for (int64_t j = 0; j < m; j++) o[j] = f32_to_bf16(bf16_to_f32(bs[j]) + table[key[j]]);
    }
    for (int64_t j = whole; j < n; j++)
        out[j] = f32_to_bf16(bf16_to_f32(base[j]) + table[element_key(codes, p, j)]);
}

/* out = bf16(f32(B) + table[key]) over the block, p (1..TABLE_MAX) a constant where inlined */
static void apply_table(int64_t p, const uint16_t *base, const uint8_t *const *codes, const float *table,
                        uint16_t *out, int64_t n) {
    switch (p) {
    case 1: table_pass(1, base, codes, table, out, n); break;
    case 2: table_pass(2, base, codes, table, out, n); break;
    case 3: table_pass(3, base, codes, table, out, n); break;
    default: table_pass(4, base, codes, table, out, n); break;
    }
}

/* Whether every one of the p experts is a sketch and their codes index one table. */
static int all_sketched(const uint16_t *const *experts, const uint8_t *const *codes, int64_t p) {
    if (codes == NULL || p < 1 || p > TABLE_MAX) return 0;
    for (int64_t k = 0; k < p; k++)
        if (experts[k] != NULL) return 0;
    return 1;
}

/* Task arithmetic's merged delta per code combination: the operations of
 * mp_task_arithmetic_sketch_bf16 (d = code * a; acc = d0 * w0 + d1 * w1 ..., left to right;
 * / divisor; * lambda) before the base is added. */
static void ta_table(int64_t p, const float *alphas, const float *weights, float divisor, int normalize,
                     float lambda_, int apply_lambda, float *table) {
    for (uint32_t key = 0; key < (1u << (2 * p)); key++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < p; k++) {
            float t = code_value((key >> (2 * k)) & 3u, alphas[k]) * weights[k];
            acc = k == 0 ? t : acc + t;
        }
        if (normalize) acc = acc / divisor;
        if (apply_lambda) acc = acc * lambda_;
        table[key] = acc;
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
    if (all_sketched(experts, codes, p)) {
        float table[1 << (2 * TABLE_MAX)];
        ta_table(p, alphas, weights, divisor, normalize, lambda_, apply_lambda, table);
        apply_table(p, base, codes, table, out, n);
        return;
    }
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

/* 1.0f where c (0 or 1, a comparison), else +0.0f, made from bits: a select GCC vectorizes at
 * every x86-64 level (`c ? 1.0f : 0.0f` feeding a multiply, or `c != 0` here, stayed a branch
 * for SSE2 and AVX2: TIES ran 60x slower there) */
static inline float one_if(int c) {
    uint32_t bits = (0u - (uint32_t)c) & 0x3F800000u;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* |d|'s bits as an int32. For d not NaN, |d| > v exactly where they exceed above(v), and
 * |d| >= v where they exceed at_least(v): non-negative floats order as their bits, and
 * integer compares need no second compare for the equal case and ignore any
 * denormals-are-zero mode. A NaN d makes a NaN term whether it is kept or not. */
static inline int32_t magnitude_bits(float d) {
    uint32_t bits;
    memcpy(&bits, &d, sizeof bits);
    return (int32_t)(bits & 0x7FFFFFFFu);
}

static inline int32_t above(float v) {
    if (v != v) return 0x7F800000; /* |d| > NaN never holds (bits past inf's are a NaN d) */
    if (v < 0) return -1;          /* every |d| */
    return magnitude_bits(v);      /* -0 as 0 */
}

static inline int32_t at_least(float v) { return v >= 0 ? above(v) - 1 : above(v); }

/* TIES's divisor: 1 where the sum of agreeing weights is 0 (as `x == 0 ? 1 : x`, which
 * stayed a branch below AVX-512) */
static inline float nonzero(float x) { return x + one_if(x == 0.0f); }

static inline int is_threshold(uint16_t e, uint16_t b, float value) {
    float d = bf16_to_f32(e) - bf16_to_f32(b);
    return (d < 0 ? -d : d) == value;
}

int64_t mp_eq_limit(const uint16_t *base, const uint16_t *expert, float value, int64_t eq_keep, int64_t n) {
    /* flat position just past the eq_keep-th element with |E - B| == value, or n: counted a
     * chunk at a time (a loop the compiler vectorizes), then found inside its chunk */
    if (eq_keep <= 0) return 0;
    int64_t count = 0;
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t m = n - s < CHUNK ? n - s : CHUNK;
        const uint16_t *bs = base + s, *es = expert + s;
        int32_t c = 0;
        for (int64_t j = 0; j < m; j++) c += is_threshold(es[j], bs[j], value);
        if (count + c < eq_keep) {
            count += c;
            continue;
        }
        for (int64_t j = 0; j < m; j++)
            if (is_threshold(es[j], bs[j], value) && ++count == eq_keep) return s + j + 1;
    }
    return n;
}

/* Expert k's trim as bit thresholds: keep d where magnitude_bits(d) > eq_thr before flat
 * position lim, > gt_thr from it. CUT at v keeps |d| > v, and |d| == v before its limit;
 * KEEP_ALL is v = -inf (d * 1 is d) and DROP_ALL v = +inf, without a limit. */
struct trim {
    int32_t gt_thr, eq_thr;
    int64_t lim;
};

static inline struct trim trim_of(int64_t mode, float value, int64_t limit) {
    float v = mode == KEEP_ALL ? -INFINITY : mode == DROP_ALL ? INFINITY : value;
    struct trim t = {above(v), at_least(v), mode == CUT ? limit : 0};
    return t;
}

/* sign(t) agrees with the election: t > 0 where flip is 0 (sum >= 0), t < 0 where flip is
 * the sign bit; in bits, t ^ flip is a positive float (+0 and NaN excluded), one unsigned
 * compare where float selects stayed branches below AVX-512 */
static inline int agrees(float t, uint32_t flip) {
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    return ((bits ^ flip) - 1u) < 0x7F800000u;
}

#define MAX_FUSED 4 /* experts whose terms the one-pass TIES loop keeps in registers */

/* TIES's merged delta of one element from its p terms t[k] (weights w): the sign elected by
 * their left-to-right sum, the agreeing terms and their weights summed left to right, / the
 * divisor where normalize. The operations, in their order, of mp_ties_bf16's chunked loops. */
static inline __attribute__((always_inline)) float elect_and_mix(const int p, const int normalize,
        const float *t, const float *w) {
    const float zero = 0.0f;
    float total = zero, mixed = zero, div = zero;
    for (int k = 0; k < p; k++) total = k == 0 ? t[k] : total + t[k];
    uint32_t flip = (uint32_t)!(total >= zero) << 31;
    for (int k = 0; k < p; k++) {
        float a = one_if(agrees(t[k], flip));
        mixed = k == 0 ? t[k] * a : mixed + t[k] * a;
        div = k == 0 ? a * w[k] : div + a * w[k];
    }
    return normalize ? mixed / nonzero(div) : mixed;
}

/* Elements [lo, hi) of a chunk (bs, e[k], o at its start), every expert a read block, in one
 * pass per element; p and normalize are constants where this is inlined, so the expert loops
 * unroll. Expert k keeps d where magnitude_bits(d) > thr[k]. lambda_ is 1 where not applied
 * (x * 1 is x). The same operations as the chunked loops of mp_ties_bf16. */
static inline __attribute__((always_inline)) void ties_piece(const int p, const int normalize,
        const uint16_t *bs, const uint16_t *const *e, const float *w, const int32_t *thr, int64_t lo, int64_t hi,
        float lambda_, uint16_t *o) {
    for (int64_t j = lo; j < hi; j++) {
        float b = bf16_to_f32(bs[j]), t[MAX_FUSED];
        for (int k = 0; k < p; k++) {
            float d = bf16_to_f32(e[k][j]) - b;
            t[k] = (d * one_if(magnitude_bits(d) > thr[k])) * w[k];
        }
        o[j] = f32_to_bf16(b + elect_and_mix(p, normalize, t, w) * lambda_);
    }
}

/* TIES over 1..MAX_FUSED read blocks (no sketch) in one pass per element. Each chunk is cut
 * where an expert's limit falls, so that inside a piece each expert compares with one
 * threshold. Returns -1 (and does nothing) for a call it does not take. */
static int ties_fused(const uint16_t *base, const uint16_t *const *experts, int64_t p, const float *weights,
                      const int64_t *modes, const float *values, const int64_t *limits, int normalize,
                      float lambda_, int apply_lambda, uint16_t *out, int64_t n) {
    struct trim tr[MAX_FUSED];
    float w[MAX_FUSED], lam = apply_lambda ? lambda_ : 1.0f;
    if (p < 1 || p > MAX_FUSED) return -1;
    for (int64_t k = 0; k < p; k++) {
        if (experts[k] == NULL) return -1;
        tr[k] = trim_of(modes[k], values[k], limits[k]);
        w[k] = weights[k];
    }
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t m = n - s < CHUNK ? n - s : CHUNK;
        const uint16_t *e[MAX_FUSED], *bs = base + s;
        uint16_t *o = out + s;
        for (int64_t k = 0; k < p; k++) e[k] = experts[k] + s;
        for (int64_t lo = 0, hi; lo < m; lo = hi) {
            int32_t thr[MAX_FUSED];
            hi = m;
            for (int64_t k = 0; k < p; k++) {
                int64_t lim = tr[k].lim - s;
                thr[k] = lo < lim ? tr[k].eq_thr : tr[k].gt_thr;
                if (lim > lo && lim < hi) hi = lim;
            }
            switch (p * 2 + (normalize != 0)) { /* constants for the inlined loop */
            case 2: ties_piece(1, 0, bs, e, w, thr, lo, hi, lam, o); break;
            case 3: ties_piece(1, 1, bs, e, w, thr, lo, hi, lam, o); break;
            case 4: ties_piece(2, 0, bs, e, w, thr, lo, hi, lam, o); break;
            case 5: ties_piece(2, 1, bs, e, w, thr, lo, hi, lam, o); break;
            case 6: ties_piece(3, 0, bs, e, w, thr, lo, hi, lam, o); break;
            case 7: ties_piece(3, 1, bs, e, w, thr, lo, hi, lam, o); break;
            case 8: ties_piece(4, 0, bs, e, w, thr, lo, hi, lam, o); break;
            default: ties_piece(4, 1, bs, e, w, thr, lo, hi, lam, o); break;
            }
        }
    }
    return 0;
}

/* One read expert's chunk of terms, t = (d * keep) * w, added to total (set by the first). */
static inline void trimmed_terms(const uint16_t *ek, const float *b, float w, struct trim tr, int64_t s, int64_t m,
                                 int first, float *tk, float *total) {
    int64_t lim = tr.lim - s < 0 ? 0 : tr.lim - s > m ? m : tr.lim - s;
    for (int64_t j = 0; j < lim; j++) {
        float d = bf16_to_f32(ek[j]) - b[j];
        tk[j] = (d * one_if(magnitude_bits(d) > tr.eq_thr)) * w;
    }
    for (int64_t j = lim; j < m; j++) {
        float d = bf16_to_f32(ek[j]) - b[j];
        tk[j] = (d * one_if(magnitude_bits(d) > tr.gt_thr)) * w;
    }
    if (first)
        for (int64_t j = 0; j < m; j++) total[j] = tk[j];
    else
        for (int64_t j = 0; j < m; j++) total[j] = total[j] + tk[j];
}

/* TIES's merged delta per code combination, every expert a sketch (untrimmed): the
 * operations of mp_ties_bf16's chunked loop (t_k = (code * a_k) * w_k; the sign election on
 * their left-to-right sum; the agreeing terms and weights summed; / divisor; * lambda)
 * before the base is added. */
static void ties_table(int64_t p, const float *alphas, const float *weights, int normalize, float lam,
                       float *table) {
    for (uint32_t key = 0; key < (1u << (2 * p)); key++) {
        float t[TABLE_MAX];
        for (int64_t k = 0; k < p; k++) t[k] = code_value((key >> (2 * k)) & 3u, alphas[k]) * weights[k];
        table[key] = elect_and_mix((int)p, normalize, t, weights) * lam;
    }
}

/* Returns 0, or -1 when p < 1 or the per-expert chunk buffer cannot be allocated.
 * codes (may be NULL): where experts[k] is NULL, expert k is the ternary sketch codes[k] with
 * scale alphas[k] (as in mp_task_arithmetic_sketch_bf16), untrimmed: term = (alpha * code) * w.
 * Up to MAX_FUSED read experts take ties_fused; up to TABLE_MAX experts that are all sketches
 * one table lookup per element (ties_table); the others a chunk of fp32 terms per expert. */
int mp_ties_bf16(const uint16_t *base, const uint16_t *const *experts, const uint8_t *const *codes,
                 const float *alphas, int64_t p, const float *weights,
                 const int64_t *modes, const float *values, const int64_t *limits, int normalize,
                 float lambda_, int apply_lambda, uint16_t *out, int64_t n) {
    if (codes == NULL && ties_fused(base, experts, p, weights, modes, values, limits, normalize, lambda_,
                                    apply_lambda, out, n) == 0)
        return 0;
    if (p < 1) return -1;
    if (all_sketched(experts, codes, p)) {
        float table[1 << (2 * TABLE_MAX)];
        ties_table(p, alphas, weights, normalize, apply_lambda ? lambda_ : 1.0f, table);
        apply_table(p, base, codes, table, out, n);
        return 0;
    }
    float (*terms)[CHUNK] = malloc((size_t)p * sizeof *terms); /* p chunks of fp32 terms */
    if (terms == NULL) return -1;
    float b[CHUNK], total[CHUNK], mixed[CHUNK], div[CHUNK];
    const float zero = 0.0f, lam = apply_lambda ? lambda_ : 1.0f;
    for (int64_t s = 0; s < n; s += CHUNK) {
        int64_t m = n - s < CHUNK ? n - s : CHUNK;
        const uint16_t *bs = base + s;
        for (int64_t j = 0; j < m; j++) b[j] = bf16_to_f32(bs[j]);
        for (int64_t k = 0; k < p; k++) {
            float *tk = terms[k];
            float w = weights[k];
            if (experts[k] != NULL) {
                trimmed_terms(experts[k] + s, b, w, trim_of(modes[k], values[k], limits[k]), s, m, k == 0, tk, total);
                continue;
            }
            sketch_decode(codes[k] + (s >> 2), alphas[k], tk, m);
            for (int64_t j = 0; j < m; j++) tk[j] = tk[j] * w;
            if (k == 0)
                for (int64_t j = 0; j < m; j++) total[j] = tk[j];
            else
                for (int64_t j = 0; j < m; j++) total[j] = total[j] + tk[j];
        }
        for (int64_t k = 0; k < p; k++) {
            const float *tk = terms[k];
            float w = weights[k];
            if (k == 0) {
                for (int64_t j = 0; j < m; j++) {
                    float a = one_if(agrees(tk[j], (uint32_t)!(total[j] >= zero) << 31));
                    mixed[j] = tk[j] * a;
                    div[j] = a * w;
                }
            } else {
                for (int64_t j = 0; j < m; j++) {
                    float a = one_if(agrees(tk[j], (uint32_t)!(total[j] >= zero) << 31));
                    mixed[j] = mixed[j] + tk[j] * a;
                    div[j] = div[j] + a * w;
                }
            }
        }
        uint16_t *o = out + s;
        if (normalize)
            for (int64_t j = 0; j < m; j++) mixed[j] = mixed[j] / nonzero(div[j]);
        for (int64_t j = 0; j < m; j++) o[j] = f32_to_bf16(b[j] + mixed[j] * lam);
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
