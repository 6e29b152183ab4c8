/* Attention of one new query per row over that row's cached keys: a decode step's attention.
 *
 * For each row b and query head h (of group g = h / (H / Hkv), GQA):
 *     s_l = scale · (q · k_l) + mask_l       for the row's keys l < lens[b]
 *     y   = Σ_l exp(s_l − max s) · v_l  /  Σ_l exp(s_l − max s)
 * in fp32, every sum in a fixed order (keys one after another, a dot product's lanes pairwise), by one
 * thread per (row, K/V head) item, for the query heads of its group (each thread takes a run of items of
 * about equal work, counted in keys, so a batch's long rows do not all fall to one thread): a row's result
 * depends on nothing else in the batch, on no thread count, and not on how many masked keys follow its own
 * (their weights are exactly 0, and x + 0 is x). So a sequence gets the same bits from a contiguous cache,
 * a paged one, alone or in any batch.
 *
 * Keys and values are found by strides (in elements): row b's key l is at k + b·kb + l·ks + g·kh, or, with a
 * block table (a paged cache), in block table[b·W + l / bs] at k + block·kb + (l mod bs)·ks + g·kh. The
 * cache holds fp32 or, with fp16 = 1, fp16 (the default mode's: half the bytes to read), widened to fp32 as
 * they are loaded; every sum is fp32 either way.
 *
 * rope_attend_one does a decode step's attention from the fused q/k/v projection: RoPE on q and k, the
 * write of k and v (rounded to nearest even into an fp16 cache, as torch's .half() rounds), and attend_one,
 * each as the separate steps compute it.
 *
 * Compiled once per instruction set with VL = floats per vector and NAME = its entry point's suffix.
 */
#include <omp.h>
#include <stdlib.h>
#if VL > 4
#include <immintrin.h>
#endif

#include "stream.h"
#include "vec.h"

/* A cache's element: VL of them widened to a vector, one to a float, and a float stored into it (fp16:
 * vcvtph2ps at the AVX levels; vec.h's `widen` and `narrow`). */
static inline __attribute__((always_inline)) vf loadkv(const void *p, int fp16) {
    if (!fp16) return loadf(p);
#if VL == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(p));
#elif VL == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(p));
#else
    const half *h = p;
    return (vf){widen(h[0]), widen(h[1]), widen(h[2]), widen(h[3])};
#endif
}
static inline __attribute__((always_inline)) float getkv(const void *p, int64_t i, int fp16) {
    return fp16 ? widen(((const half *)p)[i]) : ((const float *)p)[i];
}
static inline void putkv(void *p, const float *x, int64_t n, int fp16) {
    if (!fp16) memcpy(p, x, n * sizeof(float));
    else for (int64_t i = 0; i < n; i++) ((half *)p)[i] = narrow(x[i]);
}

static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int64_t D, int fp16) {
    vf acc = {0};
    int64_t i = 0, es = fp16 ? 2 : 4;
    for (; i + VL <= D; i += VL) acc += loadf(a + i) * loadkv((const char *)b + i * es, fp16);
    float s = hsum(acc);
    for (; i < D; i++) s += a[i] * getkv(b, i, fp16);
    return s;
}

/* exp(x) for x <= 0, 0 below -87 (where float's normals end; masked keys land far below): x = n·ln 2 + r
 * with |r| <= ln 2 / 2, exp(r) by its Taylor series to r^7 (relative error ~3e-9 before rounding). */
static inline vf exp_neg(vf x) {
    vi keep = x >= -87.0f;
    x = (vf)((vi)x & keep);
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;  /* ln 2 in two parts (Cody–Waite) */
    vf p = (vf){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vf two_n = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return (vf)((vi)(p * two_n) & keep);
}

/* Row b's key (or value) l: its address, es bytes an element. */
static inline const char *at(const void *base, int64_t es, const int64_t *table, int64_t W, int64_t bs, int64_t b,
                              int64_t l, int64_t rb, int64_t rs) {
    return (const char *)base + (table ? table[b * W + l / bs] * rb + (l % bs) * rs : b * rb + l * rs) * es;
}

/* hsum's pairing as shuffles of whole vectors: COMBINE(x, y, w) takes two vectors of groups of w lanes
 * (a group: one key's partial sums) and returns one of groups of w/2, x's then y's, each lane l of a group
 * the sum of its lanes l and l + w/2, as each step of hsum adds them. */
#define LO(t, w) ((t) < VL / 2 ? 0 : VL) + (((t) % (VL / 2)) / ((w) / 2)) * (w) + ((t) % (VL / 2)) % ((w) / 2)
#define HI(t, w) (LO(t, w) + (w) / 2)
#if VL == 4
#define MASK(f, w) ((vi){f(0, w), f(1, w), f(2, w), f(3, w)})
#elif VL == 8
#define MASK(f, w) ((vi){f(0, w), f(1, w), f(2, w), f(3, w), f(4, w), f(5, w), f(6, w), f(7, w)})
#else
#define MASK(f, w) ((vi){f(0, w), f(1, w), f(2, w), f(3, w), f(4, w), f(5, w), f(6, w), f(7, w), f(8, w), f(9, w), f(10, w), \
                         f(11, w), f(12, w), f(13, w), f(14, w), f(15, w)})
#endif
#define COMBINE(x, y, w) (__builtin_shuffle(x, y, MASK(LO, w)) + __builtin_shuffle(x, y, MASK(HI, w)))
#define LEVEL(w) for (int i = 0; i < (w) / 2; i++) a[i] = COMBINE(a[2 * i], a[2 * i + 1], w);

/* hsum of each of a[0..VL) (overwritten), lane j the sum of a[j]: the same bits as VL calls of hsum. */
static inline vf hsums(vf *a) {
#if VL == 16
    LEVEL(16)
#endif
#if VL >= 8
    LEVEL(8)
#endif
    LEVEL(4) LEVEL(2)
    return a[0];
}

/* One row's group of G query heads sharing a K/V head: each key and value is read once for all G.
 * s: scratch of G · padded scores (padded: the longest row rounded up to VL) and 2 · L addresses; acc: G · Dv sums.
 * Inlined with D = Dv = 64 or 128 as constants, so the loops over a row are unrolled.
 * Scores go VL keys at a time (their dot products' lanes summed together by hsums), the rest one by one.
 * Values go LB keys at a time (a block stays in L1 for all G heads), one head's sums for up to CW vectors
 * of channels in registers over the block. Keys and values are prefetched a step ahead: a paged cache's
 * blocks lie anywhere in the pool. */
#define CW (VL == 16 ? 16 : 8)  /* vectors of sums in registers */
#define LB 32  /* keys a block */
static inline __attribute__((always_inline)) void attend(const float *q, int64_t qh, int64_t G, const void *k, int64_t kb,
                                                          int64_t ks, const void *v, int64_t vb, int64_t vs, int fp16,
                                                          const int64_t *table, int64_t W, int64_t bs, int64_t b, int64_t L,
                                                          const float *mask, int64_t D, int64_t Dv, float scale, float *s,
                                                          int64_t padded, float *acc, float *out) {
    const int64_t whole = D / VL, es = fp16 ? 2 : 4;
    const char **kp = (const char **)(s + G * padded), **vp = kp + L;  /* each key's and value's address */
    const int64_t run = table ? bs : L;  /* keys at one stride from the first */
    for (int64_t l0 = 0; l0 < L; l0 += run) {
        const char *k0 = at(k, es, table, W, bs, b, l0, kb, ks), *v0 = at(v, es, table, W, bs, b, l0, vb, vs);
        for (int64_t o = 0; o < run && l0 + o < L; o++) kp[l0 + o] = k0 + o * ks * es, vp[l0 + o] = v0 + o * vs * es;
    }
    int64_t l = 0;
    for (; l + VL <= L; l += VL) {
        const char *const *kl = kp + l;
        for (int64_t j = l + VL; j < l + 2 * VL && j < L; j++) prefetch(kp[j], D * es);  /* the next keys */
        const vf m = mask ? loadf(mask + l) : (vf){0};
        for (int64_t h = 0; h < G; h++) {
            const float *qg = q + h * qh;
            vf a[VL];
            for (int j = 0; j < VL; j++) {
                a[j] = (vf){0};
                for (int64_t c = 0; c < whole; c++) a[j] += loadf(qg + c * VL) * loadkv(kl[j] + c * VL * es, fp16);
            }
            vf dots = hsums(a);
            for (int64_t i = whole * VL; i < D; i++)
                for (int j = 0; j < VL; j++) dots[j] += qg[i] * getkv(kl[j], i, fp16);
            storef(s + h * padded + l, scale * dots + m);
        }
    }
    for (; l < L; l++) {
        const float m = mask ? mask[l] : 0.0f;
        for (int64_t h = 0; h < G; h++) s[h * padded + l] = scale * dot(q + h * qh, kp[l], D, fp16) + m;
    }
    float total[G];
    for (int64_t h = 0; h < G; h++) {
        float *sh = s + h * padded, best = -__builtin_inff();
        for (int64_t l = 0; l < L; l++) best = sh[l] > best ? sh[l] : best;
        for (int64_t l = L; l < (L + VL - 1) / VL * VL; l++) sh[l] = -__builtin_inff();
        const vf top = best - (vf){0};
        for (int64_t l = 0; l < L; l += VL) storef(sh + l, exp_neg(loadf(sh + l) - top));
        total[h] = 0;
    }
    for (int64_t l = 0; l < L; l++)
        for (int64_t h = 0; h < G; h++) total[h] += s[h * padded + l];
    memset(acc, 0, G * Dv * sizeof(float));
    for (int64_t l0 = 0; l0 < L; l0 += LB) {
        const int64_t l1 = l0 + LB < L ? l0 + LB : L;
        for (int64_t l = l1; l < l1 + LB && l < L; l++) prefetch(vp[l], Dv * es);  /* the next block */
        for (int64_t h = 0; h < G; h++) {
            const float *sh = s + h * padded;
            float *ah = acc + h * Dv;
            for (int64_t c0 = 0; c0 < Dv / VL; c0 += CW) {
                const int64_t n = Dv / VL - c0 < CW ? Dv / VL - c0 : CW;
                vf sum[CW];
                for (int c = 0; c < n; c++) sum[c] = loadf(ah + (c0 + c) * VL);
                for (int64_t l = l0; l < l1; l++) {
                    const char *vl = vp[l] + c0 * VL * es;
                    const float p = sh[l];
                    for (int c = 0; c < n; c++) sum[c] = sum[c] + p * loadkv(vl + c * VL * es, fp16);
                }
                for (int c = 0; c < n; c++) storef(ah + (c0 + c) * VL, sum[c]);
            }
        }
    }
    for (int64_t h = 0; h < G; h++) {
        const float *sh = s + h * padded;
        float *ah = acc + h * Dv;
        for (int64_t j = Dv / VL * VL; j < Dv; j++) {  /* channels past the last whole vector */
            float sum = 0;
            for (int64_t l = 0; l < L; l++) sum = sum + sh[l] * getkv(vp[l], j, fp16);
            ah[j] = sum;
        }
        for (int64_t j = 0; j < Dv; j++) out[h * Dv + j] = ah[j] / total[h];
    }
}

#define ITEM 16  /* an item's work besides its keys, in keys: each thread takes a run of items of equal work */
void CAT(attend_one, NAME)(const float *q, int64_t qb, int64_t qh, const void *k, int64_t kb, int64_t ks, int64_t kh,
                           const void *v, int64_t vb, int64_t vs, int64_t vh, int64_t fp16, const int64_t *table, int64_t W, int64_t bs,
                           const int64_t *lens, const float *mask, int64_t mb, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t Dv, float scale, float *y) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = lens[b] > longest ? lens[b] : longest;
    const int64_t G = H / Hkv, padded = (longest + VL - 1) / VL * VL;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += Hkv * (lens[b] + ITEM);
    _Pragma("omp parallel if (B * H * longest * D >= 65536)")
    {
        float *s = malloc(G * padded * sizeof(float) + 2 * longest * sizeof(float *)), *acc = malloc(G * Dv * sizeof(float));  /* this thread's */
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t before = 0;  /* the work of the items before bg: their keys, and ITEM for each */
        for (int64_t bg = 0; bg < B * Hkv; before += lens[bg / Hkv] + ITEM, bg++) {
            if (before * threads < me * work || before * threads >= (me + 1) * work) continue;  /* another thread's share */
            const int64_t b = bg / Hkv, g = bg % Hkv;
            const int64_t es = fp16 ? 2 : 4;
            const float *qg = q + b * qb + g * G * qh, *m = mask ? mask + b * mb : 0;
            const char *kg = (const char *)k + g * kh * es, *vg = (const char *)v + g * vh * es;
            float *out = y + bg * G * Dv;  /* heads g·G .. g·G + G − 1 of row b */
#define ATTEND(h, d, dv) attend(qg, qh, G, kg, kb, ks, vg, vb, vs, h, table, W, bs, b, lens[b], m, d, dv, scale, s, padded, acc, out)
            if (D == 64 && Dv == 64) fp16 ? ATTEND(1, 64, 64) : ATTEND(0, 64, 64);
            else if (D == 128 && Dv == 128) fp16 ? ATTEND(1, 128, 128) : ATTEND(0, 128, 128);
            else fp16 ? ATTEND(1, D, Dv) : ATTEND(0, D, Dv);
#undef ATTEND
        }
        free(s);
        free(acc);
    }
}

/* A decode step's attention from a fused projection, in one call: each row's qkv holds its H query, Hkv key
 * and Hkv value heads of D floats. The first rot channels of every query and key head are rotated in place
 * (RoPE: x·cos + (x2, x1)·sin, sin's first half negated, each product rounded, as `apply_rope_` computes),
 * row b's key and value heads are written as its key pos[b] (found as attend_one finds keys: by strides,
 * or through the block table), and every row attends over its first lens[b] keys as attend_one does.
 * cos and sin: rot floats per row, cb and sb apart (0: one row for all). */
void CAT(rope_attend_one, NAME)(float *qkv, int64_t qkvb, const float *cos, const float *sin, int64_t cb, int64_t sb, int64_t rot,
                                const int64_t *pos, void *k, int64_t kb, int64_t ks, int64_t kh, void *v, int64_t vb, int64_t vs,
                                int64_t vh, int64_t fp16, const int64_t *table, int64_t W, int64_t bs, const int64_t *lens,
                                const float *mask, int64_t mb, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, float *y) {
    const int64_t mid = rot / 2;
    float old[rot];
    for (int64_t b = 0; b < B; b++) {
        float *row = qkv + b * qkvb;
        const float *c = cos + b * cb, *s = sin + b * sb;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *x = row + h * D;
            memcpy(old, x, rot * sizeof(float));
            for (int64_t j = 0; j < rot; j++) {
                const float straight = old[j] * c[j], swapped = old[(j + mid) % rot] * s[j];
                x[j] = straight + swapped;
            }
        }
        const int64_t es = fp16 ? 2 : 4;
        char *kd = (char *)at(k, es, table, W, bs, b, pos[b], kb, ks), *vd = (char *)at(v, es, table, W, bs, b, pos[b], vb, vs);
        for (int64_t g = 0; g < Hkv; g++) {
            putkv(kd + g * kh * es, row + (H + g) * D, D, fp16);
            putkv(vd + g * vh * es, row + (H + Hkv + g) * D, D, fp16);
        }
    }
    CAT(attend_one, NAME)(qkv, qkvb, D, k, kb, ks, kh, v, vb, vs, vh, fp16, table, W, bs, lens, mask, mb, B, H, Hkv, D, D, scale, y);
}
