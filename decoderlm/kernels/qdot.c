/* y = x · Wᵀ for blocks.c's Q4_1 / Q8_0 weights with integer activations and integer dot products, the
 * arithmetic of llama.cpp's CPU kernels: each block of 32 inputs of a row of x is rounded to integers
 * qx with a scale dx = max|x| / QMAX, and a block's products are summed exactly in int32:
 *
 *   x · w over a block = dw·dx · Σ qw·qx + m·dx·Σ qx     (Q8_0: m = 0)
 *
 * DIGITS = 1: qx is int8 (QMAX = 127, llama.cpp's Q8_1), an error of up to 1/254 of the block's largest
 * value, for 2-3x fewer instructions a weight than blocks.c's fp32 path.
 * DIGITS = 2: qx has two int8 digits, qx = 255·hi + lo with hi, lo in -127..127 (QMAX = 127·256 = 32512,
 * 16 bits): each digit's products are summed as for DIGITS = 1 and the two sums joined, exactly, as
 * 255·Σ qw·hi + Σ qw·lo. The error is 256 times smaller (1/65024 of the block's largest value), for
 * twice the integer products.
 *
 * Lanes: four blocks b..b+3 (a quad, 128 inputs) fill 16 int32 lanes, 4 a block: lane l of block j
 * sums inputs 4l..4l+3 and 16+4l..16+4l+3 of block j (Q4_1's byte order: low nibbles, then high).
 * Every level forms the same lanes (one 512-bit vector, two 256-bit or four 128-bit ones) and adds
 * them in the same order, so AVX-512 and AVX2 give the same bits (the SSSE3 level, without FMA,
 * rounds its own way). As in blocks.c, a row's result never depends on the other rows of the batch:
 * DIGITS = 2 sums batches of 3 rows or more another way (16-bit pairs, `pmaddwd`), to the same integers.
 *
 * Compiled once per instruction set with VL = 16 (AVX-512, with vpdpbusd where the CPU has VNNI),
 * 8 (AVX2) or 4 (SSSE3), and NAME = the suffix of its entry points; and once per DIGITS, whose entry
 * points are q4x8_matmul_NAME / q8x8_matmul_NAME (1) and q4x16_matmul_NAME / q8x16_matmul_NAME (2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>
#include <omp.h>

#include "stream.h"
#include "vec.h"

#define NV (16 / VL)  /* float vectors a quad */
#if VL == 16
#define NR 4          /* outputs at a time */
#define MR 2          /* rows of x at a time, where there are that many */
#else
#define NR 2
#define MR 2
#endif
#ifndef DIGITS
#define DIGITS 1
#endif
#define GLUE_(a, b, c) a##b##c
#define GLUE(a, b, c) GLUE_(a, b, c)
#if DIGITS == 2
#define QMAX 32512
#define XBITS x16
#else
#define QMAX 127
#define XBITS x8
#endif


/* A row of x quantized, per quad: its 128 int8 values (DIGITS = 2: their high digits, then the low
 * ones), inputs 0..15 of the four blocks and then their inputs 16..31; per lane the block's dx; and
 * dx·Σqx in each block's first lane (0 in the others). */
typedef struct {
    int8_t q[DIGITS][128];
    float dx[16], sx[16];
} xquad;

static inline vf tofloat(vi v) { return __builtin_convertvector(v, vf); }

/* A quad's weights in lane order as integer vectors: Q4_1's nibbles (unsigned), or Q8_0's magnitudes
 * (unsigned) with their signs moved onto x (u8·s8 is what the instructions multiply). `nb` blocks are
 * read (4; 2 or fewer at the end of a row, the rest 0). */
#if VL == 16
typedef struct { __m512i u[2], sign[2]; __mmask64 neg[2]; } wquad;
static inline __m512i bytes64(const void *p, int n) {  /* n·16 bytes (n <= 4), zeros after */
    return n == 4 ? _mm512_loadu_si512(p) : n == 0 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi8((1ULL << 16 * n) - 1, p);
}
static inline void load_q4(const uint8_t *p, int nb, wquad *w) {
    const __m512i v = bytes64(p, nb), low = _mm512_set1_epi8(15);
    w->u[0] = _mm512_and_si512(v, low), w->u[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}
static inline void load_q8(const int8_t *p, int nb, wquad *w) {
    const __m512i a = bytes64(p, nb >= 2 ? 4 : 2 * nb), b = bytes64(p + 64, nb >= 2 ? 2 * (nb - 2) : 0);
    /* blocks j of a and b: 32 bytes each; lane order wants their first halves, then their second */
    const __m512i lo = _mm512_shuffle_i64x2(a, b, 0x88), hi = _mm512_shuffle_i64x2(a, b, 0xdd);
    w->sign[0] = lo, w->sign[1] = hi;
    w->neg[0] = _mm512_movepi8_mask(lo), w->neg[1] = _mm512_movepi8_mask(hi);
    w->u[0] = _mm512_abs_epi8(lo), w->u[1] = _mm512_abs_epi8(hi);
}
static inline __m512i dot(__m512i acc, __m512i u, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}
/* Per lane: Σ of its 8 products, exact. */
static inline void dots(const wquad *w, const int8_t *x, int q8, vi s[NV]) {
    __m512i lo = _mm512_loadu_si512(x), hi = _mm512_loadu_si512(x + 64);
    if (q8) lo = _mm512_mask_sub_epi8(lo, w->neg[0], _mm512_setzero_si512(), lo), hi = _mm512_mask_sub_epi8(hi, w->neg[1], _mm512_setzero_si512(), hi);
    s[0] = (vi)dot(dot(_mm512_setzero_si512(), w->u[0], lo), w->u[1], hi);
}
/* Per lane, its block's value of the fp16 h[0..nb). */
static inline void spread(const _Float16 *h, int nb, vf s[NV]) {
    const __m128 f = _mm_cvtph_ps(nb == 4 ? _mm_loadl_epi64((const __m128i *)h) : _mm_maskz_loadu_epi16((__mmask8)((1 << nb) - 1), h));
    s[0] = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(f));
}
#elif VL == 8
typedef struct { __m256i u[4], sign[4]; } wquad;
static inline __m256i bytes32(const void *p, int n) {  /* n bytes (0, 16 or 32), zeros after */
    return n == 32 ? _mm256_loadu_si256((const __m256i *)p) : n == 16 ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p)) : _mm256_setzero_si256();
}
static inline int part(int nb, int first) { return nb >= first + 2 ? 32 : nb == first + 1 ? 16 : 0; }  /* bytes of blocks first, first+1 (16 each) */
static inline void load_q4(const uint8_t *p, int nb, wquad *w) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int i = 0; i < 2; i++) {  /* blocks 2i, 2i+1 */
        const __m256i v = bytes32(p + 32 * i, part(nb, 2 * i));
        w->u[i] = _mm256_and_si256(v, low), w->u[2 + i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}
static inline void load_q8(const int8_t *p, int nb, wquad *w) {
    for (int i = 0; i < 2; i++) {  /* blocks 2i, 2i+1: 32 bytes each */
        const __m256i a = bytes32(p + 64 * i, nb > 2 * i ? 32 : 0), b = bytes32(p + 64 * i + 32, nb > 2 * i + 1 ? 32 : 0);
        w->sign[i] = _mm256_permute2x128_si256(a, b, 0x20), w->sign[2 + i] = _mm256_permute2x128_si256(a, b, 0x31);
    }
    for (int i = 0; i < 4; i++) w->u[i] = _mm256_abs_epi8(w->sign[i]);
}
static inline __m256i dot2(__m256i u0, __m256i u1, __m256i x0, __m256i x1, int q8) {
    const __m256i one = _mm256_set1_epi16(1), a = _mm256_maddubs_epi16(u0, x0), b = _mm256_maddubs_epi16(u1, x1);
    if (q8) return _mm256_add_epi32(_mm256_madd_epi16(a, one), _mm256_madd_epi16(b, one));  /* |a + b| could pass 2^15 */
    return _mm256_madd_epi16(_mm256_add_epi16(a, b), one);  /* |2·15·127| twice fits in int16 */
}
static inline void dots(const wquad *w, const int8_t *x, int q8, vi s[NV]) {
    for (int i = 0; i < 2; i++) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(x + 32 * i)), hi = _mm256_loadu_si256((const __m256i *)(x + 64 + 32 * i));
        if (q8) lo = _mm256_sign_epi8(lo, w->sign[i]), hi = _mm256_sign_epi8(hi, w->sign[2 + i]);
        s[i] = (vi)dot2(w->u[i], w->u[2 + i], lo, hi, q8);
    }
}
static inline void spread(const _Float16 *h, int nb, vf s[NV]) {
    __m128i raw;  /* the nb values, zeros after (loaded whole: a copy to the stack first stalls each load) */
    if (nb == 4) raw = _mm_loadl_epi64((const __m128i *)h);
    else if (nb == 2) { int32_t two; memcpy(&two, h, 4); raw = _mm_cvtsi32_si128(two); }
    else { _Float16 b[4] = {0, 0, 0, 0}; memcpy(b, h, 2 * (size_t)nb); raw = _mm_loadl_epi64((const __m128i *)b); }
    const __m256 f = _mm256_castps128_ps256(_mm_cvtph_ps(raw));
    s[0] = _mm256_permutevar8x32_ps(f, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
    s[1] = _mm256_permutevar8x32_ps(f, _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2));
}
#else
typedef struct { __m128i u[8], sign[8]; } wquad;
static inline __m128i bytes16(const void *p, int present) {
    return present ? _mm_loadu_si128((const __m128i *)p) : _mm_setzero_si128();
}
static inline void load_q4(const uint8_t *p, int nb, wquad *w) {
    const __m128i low = _mm_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m128i v = bytes16(p + 16 * j, j < nb);
        w->u[j] = _mm_and_si128(v, low), w->u[4 + j] = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    }
}
static inline void load_q8(const int8_t *p, int nb, wquad *w) {
    for (int j = 0; j < 4; j++) {
        w->sign[j] = bytes16(p + 32 * j, j < nb), w->sign[4 + j] = bytes16(p + 32 * j + 16, j < nb);
        w->u[j] = _mm_abs_epi8(w->sign[j]), w->u[4 + j] = _mm_abs_epi8(w->sign[4 + j]);
    }
}
static inline void dots(const wquad *w, const int8_t *x, int q8, vi s[NV]) {
    const __m128i one = _mm_set1_epi16(1);
    for (int j = 0; j < 4; j++) {
        __m128i lo = _mm_loadu_si128((const __m128i *)(x + 16 * j)), hi = _mm_loadu_si128((const __m128i *)(x + 64 + 16 * j));
        if (q8) lo = _mm_sign_epi8(lo, w->sign[j]), hi = _mm_sign_epi8(hi, w->sign[4 + j]);
        const __m128i a = _mm_maddubs_epi16(w->u[j], lo), b = _mm_maddubs_epi16(w->u[4 + j], hi);
        s[j] = (vi)(q8 ? _mm_add_epi32(_mm_madd_epi16(a, one), _mm_madd_epi16(b, one)) : _mm_madd_epi16(_mm_add_epi16(a, b), one));
    }
}
static inline void spread(const _Float16 *h, int nb, vf s[NV]) {
    for (int j = 0; j < 4; j++) s[j] = (vf){0} + (j < nb ? (float)h[j] : 0.0f);
}
#endif

/* Per lane: a·b + c (rounded once where the ISA has FMA), |v|, the larger of a and b, and v rounded to an
 * integer as nearbyintf rounds it. */
#if VL == 16
static inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vabs(vf v) { return _mm512_abs_ps(v); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vround(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_CUR_DIRECTION); }
#elif VL == 8
static inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vabs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC); }
#else
static inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }  /* no FMA below AVX2 */
static inline vf vabs(vf v) { return _mm_andnot_ps(_mm_set1_ps(-0.0f), v); }
static inline vf vmax(vf a, vf b) { return _mm_max_ps(a, b); }
static inline vf vround(vf v) { return _mm_round_ps(v, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC); }
#endif

/* The largest lane of v (exact: any order gives it). */
static inline float hmax(vf v) { return FOLD(v, vmax); }

/* A fixed order for the 16 lanes: pairwise halves (lanes i and i + 8 first). */
static inline float hsum_quad(const vf acc[NV]) {
#if NV == 1
    return hsum(acc[0]);
#elif NV == 2
    return hsum(acc[0] + acc[1]);  /* lanes i and i + 8 of the 16 */
#else
    return hsum((acc[0] + acc[2]) + (acc[1] + acc[3]));
#endif
}

typedef int8_t vb __attribute__((vector_size(VL)));
typedef int16_t vs __attribute__((vector_size(2 * VL)));

#if DIGITS == 2
/* Where input k of block j of a quad goes among the quad's 128 values in pair order (`pairs`): vector i of
 * the quad's lanes, its pair t, lane within the vector, first or second of the pair. */
static inline int pair_at(int j, int k) {
    const int b = k % 16, lane = 4 * j + b / 4, t = 2 * (k / 16) + (b & 1), e = (b & 3) >> 1;
    return ((lane / VL * 4 + t) * VL + lane % VL) * 2 + e;
}
typedef int16_t vh32 __attribute__((vector_size(64)));
/* Block j's 32 values v into its quad's pairs: for each pair t, its four lanes' pairs (eight values, together). */
static inline void block_pairs(const int16_t v[32], int j, int16_t *quad) {
    vh32 a, s;
    memcpy(&a, v, 64);
    s = __builtin_shufflevector(a, a, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  /* t = 0, 1 */
                                16, 18, 20, 22, 24, 26, 28, 30, 17, 19, 21, 23, 25, 27, 29, 31);  /* t = 2, 3 */
    static const int first[4] = {0, 1, 16, 17};  /* input k of a lane's first pair t */
    for (int t = 0; t < 4; t++) memcpy(quad + pair_at(j, first[t]), (const int16_t *)&s + 8 * t, 16);
}
#endif

/* Row x (K) as ceil(K/128) quads (blocks past the row are 0), VL inputs at a time; DIGITS = 2 and `pairs`
 * not NULL: also each quad's 16-bit values in pair order (128 a quad). */
static void quantize_row(const float *x, int64_t K, xquad *out, int16_t *pairs) {
    const int64_t B = K / 32;
    for (int64_t p = 0; p < (B + 3) / 4; p++) {
        xquad *o = out + p;
        memset(o, 0, sizeof *o);
#if DIGITS == 2
        if (pairs) memset(pairs + 128 * p, 0, 256);
#endif
        for (int j = 0; j < 4 && 4 * p + j < B; j++) {
            const float *xb = x + (4 * p + j) * 32;
            vf top = {0};
            for (int i = 0; i < 32; i += VL) top = vmax(top, vabs(loadf(xb + i)));
            const float amax = hmax(top);
            const float dx = amax / QMAX, inv = amax > 0 ? QMAX / amax : 0;
            vi sum = {0};
#if DIGITS == 2
            int16_t v16[32];  /* the block's values, for `pairs` */
#endif
            for (int i = 0; i < 32; i += VL) {
                const vi v = __builtin_convertvector(vround(loadf(xb + i) * inv), vi);
                const int at = (i < 16 ? 0 : 64) + 16 * j + i % 16;
#if DIGITS == 2
                if (pairs) {  /* a batch reads the pairs only */
                    const vs h16 = __builtin_convertvector(v, vs);
                    memcpy(v16 + i, &h16, 2 * VL);
                } else {
                    /* hi = v/255 to the nearest integer: v/255 is never within 1/510 of a half, far more than fp32's error */
                    const vi hi = __builtin_convertvector(vround(__builtin_convertvector(v, vf) / 255.0f), vi);
                    const vb h = __builtin_convertvector(hi, vb), lo = __builtin_convertvector(v - 255 * hi, vb);
                    memcpy(o->q[0] + at, &h, VL), memcpy(o->q[1] + at, &lo, VL);
                }
#else
                const vb b = __builtin_convertvector(v, vb);
                memcpy(o->q[0] + at, &b, VL);
#endif
                sum += v;
            }
#if DIGITS == 2
            if (pairs) block_pairs(v16, j, pairs + 128 * p);
#endif
            int32_t total = 0;
            for (int l = 0; l < VL; l++) total += sum[l];
            for (int l = 0; l < 4; l++) o->dx[4 * j + l] = dx;
            o->sx[4 * j] = dx * (float)total;
        }
    }
}

/* Adds quad p of outputs [n0, n0 + NRC) for rows [0, MRC) of the quantized x (xs: P quads a row) to
 * acc. `nb` (a constant where this is inlined) is the quad's blocks within the row. */
#define QUAD(KIND, MRC, NRC)                                                                              \
static inline __attribute__((always_inline)) void CAT(quad_##KIND##_##MRC##_##NRC, NAME)(               \
        const xquad *xs, int64_t P, int64_t K, const void *q, const _Float16 *d, const _Float16 *m,       \
        int64_t n0, int64_t p, int nb, vf acc[MRC][NRC][NV]) {                                            \
    const int64_t B = K / 32;                                                                             \
    wquad w[NRC];                                                                                         \
    vf dw[NRC][NV], mw[NRC][NV];                                                                          \
    for (int n = 0; n < NRC; n++) {                                                                       \
        load_##KIND((const void *)((const char *)q + (n0 + n) * BYTES_##KIND(K) + 4 * p * BYTES_##KIND(32)), nb, &w[n]); \
        spread(d + (n0 + n) * B + 4 * p, nb, dw[n]);                                                      \
        if (Q4_##KIND) spread(m + (n0 + n) * B + 4 * p, nb, mw[n]);                                       \
    }                                                                                                     \
    for (int r = 0; r < MRC; r++) {                                                                       \
        const xquad *xp = xs + r * P + p;                                                                 \
        vf dx[NV], sx[NV];                                                                                \
        for (int i = 0; i < NV; i++) dx[i] = loadf(xp->dx + VL * i), sx[i] = loadf(xp->sx + VL * i);     \
        for (int n = 0; n < NRC; n++) {                                                                   \
            vi s[NV];                                                                                     \
            dots(&w[n], xp->q[0], !Q4_##KIND, s);                                                         \
            if (DIGITS == 2) {  /* 255·Σ qw·hi + Σ qw·lo, exact */                                        \
                vi lo[NV];                                                                                \
                dots(&w[n], xp->q[DIGITS - 1], !Q4_##KIND, lo);                                           \
                for (int i = 0; i < NV; i++) s[i] = (s[i] << 8) - s[i] + lo[i];                           \
            }                                                                                             \
            for (int i = 0; i < NV; i++) {                                                                \
                acc[r][n][i] = fmadd(dw[n][i] * dx[i], tofloat(s[i]), acc[r][n][i]);                      \
                if (Q4_##KIND) acc[r][n][i] = fmadd(mw[n][i], sx[i], acc[r][n][i]);                       \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
}
#define BYTES_q4(k) ((k) / 2)
#define BYTES_q8(k) (k)
#define SCALES_q4(k) ((k) / 8)  /* an output's fp16 d and m */
#define SCALES_q8(k) ((k) / 16)
#define Q4_q4 1
#define Q4_q8 0

/* Outputs [n0, n0 + NRC) for rows [0, MRC) of the quantized x. A row's last quad may be partial: two
 * blocks (inlined as such), or one or three. */
#define TILE(KIND, MRC, NRC)                                                                              \
QUAD(KIND, MRC, NRC)                                                                                      \
static void CAT(tile_##KIND##_##MRC##_##NRC, NAME)(const xquad *xs, int64_t K, const void *q,           \
        const _Float16 *d, const _Float16 *m, int64_t n0, float *y, int64_t N) {                          \
    const int64_t B = K / 32, P = (B + 3) / 4;                                                            \
    vf acc[MRC][NRC][NV];                                                                                 \
    for (int r = 0; r < MRC; r++)                                                                         \
        for (int n = 0; n < NRC; n++)                                                                     \
            for (int i = 0; i < NV; i++) acc[r][n][i] = (vf){0};                                          \
    for (int64_t p = 0; p < B / 4; p++) CAT(quad_##KIND##_##MRC##_##NRC, NAME)(xs, P, K, q, d, m, n0, p, 4, acc); \
    if (B % 4 == 2) CAT(quad_##KIND##_##MRC##_##NRC, NAME)(xs, P, K, q, d, m, n0, B / 4, 2, acc);         \
    else if (B % 4) CAT(quad_##KIND##_##MRC##_##NRC, NAME)(xs, P, K, q, d, m, n0, B / 4, (int)(B % 4), acc); \
    for (int r = 0; r < MRC; r++)                                                                         \
        for (int n = 0; n < NRC; n++) y[r * N + n0 + n] = hsum_quad(acc[r][n]);                                \
}
#define TILE_(KIND, MRC, NRC) TILE(KIND, MRC, NRC)  /* MR and NR expanded first */

#if DIGITS == 2
/* Batches of 16-bit x (MB rows or more): integer products of pairs, x·w + x'·w' in one instruction (pmaddwd),
 * 16-bit x against the weights widened to 16 bits once for up to RB rows. A lane's four pairs are its eight
 * inputs, so its sum is Σ qw·qx, exactly the two digits' sum above, and each lane's float steps are QUAD's:
 * the same bits as the tiles above, one row or many.
 * Pair order: per vector i of the quad's lanes (VL lanes, lane L = 4·block + l), four vectors of pairs t,
 * each lane's pair t taken from its inputs (4l, 4l+2), (4l+1, 4l+3), (16+4l, 16+4l+2), (16+4l+1, 16+4l+3):
 * in a lane's 32 bits of Q4_1's nibbles (bytes 4l..4l+3) or Q8_0's first or second 16 bytes, the even bytes
 * and the odd ones. */
#define MB 3
#define RB 8
typedef int16_t vh __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
#if VL == 16
static inline vi madd(vi a, vi b) { return (vi)_mm512_madd_epi16((__m512i)a, (__m512i)b); }
#elif VL == 8
static inline vi madd(vi a, vi b) { return (vi)_mm256_madd_epi16((__m256i)a, (__m256i)b); }
#else
static inline vi madd(vi a, vi b) { return (vi)_mm_madd_epi16((__m128i)a, (__m128i)b); }
#endif
/* Σ_k of t[k]·x[k] by pairs, exact in int32 (8 products of at most 255 · 32512 a lane). With VNNI, vpdpwssd adds
 * a pmaddwd's pairs into the sum in the same instruction: 4 instructions instead of 7, 4-9 % faster batches. */
static inline vi dot4(const vi t[4], const vi *x) {
#if VL == 16 && defined(__AVX512VNNI__)
    __m512i s = (__m512i)madd(t[0], x[0]);
    for (int k = 1; k < 4; k++) s = _mm512_dpwssd_epi32(s, (__m512i)t[k], (__m512i)x[k]);
    return (vi)s;
#else
    return (madd(t[0], x[0]) + madd(t[1], x[1])) + (madd(t[2], x[2]) + madd(t[3], x[3]));
#endif
}
static inline void pairs_q4(const wquad *w, int i, vi t[4]) {  /* nibbles 0..15 */
    const vi lo = (vi)w->u[i], hi = (vi)w->u[NV + i];
    t[0] = lo & 0x00ff00ff, t[1] = (vi)((vu)lo >> 8) & 0x00ff00ff;
    t[2] = hi & 0x00ff00ff, t[3] = (vi)((vu)hi >> 8) & 0x00ff00ff;
}
static inline void pairs_q8(const wquad *w, int i, vi t[4]) {  /* signed bytes, sign-extended */
    const vh lo = (vh)w->sign[i], hi = (vh)w->sign[NV + i];
    t[0] = (vi)((lo << 8) >> 8), t[1] = (vi)(lo >> 8), t[2] = (vi)((hi << 8) >> 8), t[3] = (vi)(hi >> 8);
}

/* Quad p's lanes i for output n and rows [0, R): as QUAD's, the sums from the pairs. */
#define WIDE_QUAD(KIND)                                                                                   \
static inline __attribute__((always_inline)) void CAT(wide_quad_##KIND, NAME)(const int16_t *xp,          \
        const xquad *xs, int64_t P, int64_t K, const void *q, const _Float16 *d, const _Float16 *m,       \
        int64_t n, int64_t p, int nb, int i, int R, vf *acc) {                                            \
    const int64_t B = K / 32;                                                                             \
    wquad w;                                                                                              \
    vf dw[NV], mw[NV];                                                                                    \
    load_##KIND((const void *)((const char *)q + n * BYTES_##KIND(K) + 4 * p * BYTES_##KIND(32)), nb, &w); \
    spread(d + n * B + 4 * p, nb, dw);                                                                    \
    if (Q4_##KIND) spread(m + n * B + 4 * p, nb, mw);                                                     \
    vi t[4];                                                                                              \
    pairs_##KIND(&w, i, t);                                                                               \
    for (int r = 0; r < R; r++) {                                                                         \
        const vi *x = (const vi *)(xp + (r * P + p) * 128) + 4 * i;                                       \
        const vi s = dot4(t, x);                                                                          \
        const xquad *xq = xs + r * P + p;                                                                 \
        acc[r] = fmadd(dw[i] * loadf(xq->dx + VL * i), tofloat(s), acc[r]);                               \
        if (Q4_##KIND) acc[r] = fmadd(mw[i], loadf(xq->sx + VL * i), acc[r]);                             \
    }                                                                                                     \
}

/* Output n for rows [0, R) (R <= RB, a constant where inlined): lanes i = 0.. NV-1 one after another. */
#define WIDE(KIND, R)                                                                                     \
static void CAT(wide_##KIND##_##R, NAME)(const int16_t *xp, const xquad *xs, int64_t K, const void *q,    \
        const _Float16 *d, const _Float16 *m, int64_t n, float *y, int64_t N) {                           \
    const int64_t B = K / 32, P = (B + 3) / 4;                                                            \
    vf out[R][NV];                                                                                        \
    _Pragma("GCC unroll 4")  /* i a constant in each copy: the quad's vectors i stay in registers */      \
    for (int i = 0; i < NV; i++) {                                                                        \
        vf acc[R];                                                                                        \
        for (int r = 0; r < R; r++) acc[r] = (vf){0};                                                     \
        for (int64_t p = 0; p < B / 4; p++) CAT(wide_quad_##KIND, NAME)(xp, xs, P, K, q, d, m, n, p, 4, i, R, acc); \
        if (B % 4) CAT(wide_quad_##KIND, NAME)(xp, xs, P, K, q, d, m, n, B / 4, (int)(B % 4), i, R, acc); \
        for (int r = 0; r < R; r++) out[r][i] = acc[r];                                                   \
    }                                                                                                     \
    for (int r = 0; r < R; r++) y[r * N + n] = hsum_quad(out[r]);                                         \
}
/* BATCH: output n for rows [r, r + R), RB at a time. */
#define BATCH(KIND) WIDE_QUAD(KIND) WIDE(KIND, 1) WIDE(KIND, 2) WIDE(KIND, 3) WIDE(KIND, 4) WIDE(KIND, 5)  \
                    WIDE(KIND, 6) WIDE(KIND, 7) WIDE(KIND, 8)                                             \
static void CAT(wide_##KIND, NAME)(const int16_t *xp, const xquad *xs, int64_t r, int64_t R, int64_t K, const void *q, \
        const _Float16 *d, const _Float16 *m, int64_t n, float *y, int64_t N) {                           \
    const int64_t P = (K / 32 + 3) / 4;                                                                   \
    for (int64_t e = r + R; r < e; r += RB) {                                                             \
        const int16_t *xr = xp + r * P * 128;                                                             \
        const xquad *sr = xs + r * P;                                                                     \
        float *yr = y + r * N;                                                                            \
        switch (e - r < RB ? (int)(e - r) : RB) {                                                         \
        case 1: CAT(wide_##KIND##_1, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        case 2: CAT(wide_##KIND##_2, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        case 3: CAT(wide_##KIND##_3, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        case 4: CAT(wide_##KIND##_4, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        case 5: CAT(wide_##KIND##_5, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        case 6: CAT(wide_##KIND##_6, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        case 7: CAT(wide_##KIND##_7, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                          \
        default: CAT(wide_##KIND##_8, NAME)(xr, sr, K, q, d, m, n, yr, N); break;                         \
        }                                                                                                 \
    }                                                                                                     \
}
/* Rows a pass over the weights: as many as keep their pairs, dx and sx (384 bytes a quad) within 24 KB of
 * the L1 cache, since every output of the pass reads them all. */
static inline int64_t pass_rows(int64_t P) { const int64_t r = 24576 / (384 * P); return r < 1 ? 1 : r; }
/* Tiles a span: as many as keep their weights (`bytes` an output) within 256 KB of the L2 cache, so that a
 * span's passes after the first read them from there. */
static inline int64_t span_tiles(int64_t bytes) { const int64_t t = 262144 / (NR * bytes); return t < 1 ? 1 : t; }
#define WIDE_ONE(KIND, r, R, n) CAT(wide_##KIND, NAME)(xp, xs, r, R, K, q, d, m, n, y, N)
#else
#define MB (1 << 30)
#define BATCH(KIND)
static inline int64_t pass_rows(int64_t P) { (void)P; return 1; }
static inline int64_t span_tiles(int64_t bytes) { (void)bytes; return 1; }
#define WIDE_ONE(KIND, r, R, n) ((void)0)  /* never: no batch path (MB) */
#endif

/* y (M, N) = x (M, K) · Wᵀ: outputs split between threads in tiles of NR (the last, partial tile one
 * output at a time), rows MR at a time and the rest one by one (the same operations per row either way). */
#define MATMUL(KIND)                                                                                      \
TILE_(KIND, 1, NR) TILE(KIND, 1, 1) TILE_(KIND, MR, NR) TILE_(KIND, MR, 1)                                \
static void CAT(columns_##KIND, NAME)(const xquad *xs, int64_t M, int64_t K, const void *q,             \
        const _Float16 *d, const _Float16 *m, int64_t n0, int wide, float *y, int64_t N) {                \
    const int64_t P = (K / 32 + 3) / 4;                                                                   \
    int64_t r = 0;                                                                                        \
    for (; r + MR <= M; r += MR)                                                                          \
        (wide ? CAT(CAT(CAT(tile_##KIND, MR), NR), NAME) : CAT(CAT(CAT(tile_##KIND, MR), 1), NAME))(      \
            xs + r * P, K, q, d, m, n0, y + r * N, N);                                                    \
    for (; r < M; r++)                                                                                    \
        (wide ? CAT(CAT(tile_##KIND##_1, NR), NAME) : CAT(tile_##KIND##_1_1, NAME))(xs + r * P, K, q, d, m, n0, y + r * N, N); \
}                                                                                                         \
void CAT(GLUE(KIND, XBITS, _matmul), NAME)(const float *x, int64_t M, int64_t K, const void *q, const _Float16 *d,  \
                                const _Float16 *m, int64_t N, float *y) {                                 \
    const int64_t P = (K / 32 + 3) / 4, tiles = N / NR;                                                   \
    xquad *xs = aligned_alloc(64, (size_t)(M * P) * sizeof(xquad));                                       \
    int16_t *xp = M >= MB ? aligned_alloc(64, (size_t)(M * P) * 256) : NULL;  /* pair order, for batches */ \
    if (M < MB)  /* a row or two: rounded by this thread before the others start */                     \
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, xs + r * P, NULL);                     \
    _Pragma("omp parallel")                                                                               \
    {                                                                                                     \
        if (M >= MB) {  /* a batch: its rows rounded by the threads, all of them before any tile */      \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, xs + r * P, xp + r * P * 128);     \
        }                                                                                                 \
        if (xp) {  /* a batch: this thread's tiles in spans whose weights stay in L2, each span's rows in passes */ \
            const int64_t T = tiles + 1, nt = omp_get_num_threads(), id = omp_get_thread_num();          \
            const int64_t cap = pass_rows(P), passes = (M + cap - 1) / cap, span = span_tiles(BYTES_##KIND(K) + SCALES_##KIND(K)); \
            for (int64_t c = T * id / nt, end = T * (id + 1) / nt; c < end; c += span) {                  \
                const int64_t ce = c + span < end ? c + span : end;                                       \
                for (int64_t i = 0, r = 0; i < passes; i++) {                                             \
                    const int64_t R = (M - r) / (passes - i);  /* rows split evenly between the passes */ \
                    for (int64_t t = c; t < ce; t++) {                                                    \
                        if (i == 0 && t + AHEAD < tiles) PREFETCH_##KIND(q, d, m, (t + AHEAD) * NR, K);   \
                        for (int64_t n = t * NR; n < (t < tiles ? t * NR + NR : N); n++) WIDE_ONE(KIND, r, R, n); \
                    }                                                                                     \
                    r += R;                                                                               \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t t = 0; t <= tiles; t++) {                                                        \
                if (t + AHEAD < tiles) PREFETCH_##KIND(q, d, m, (t + AHEAD) * NR, K);                     \
                const int64_t n0 = t * NR, n1 = t < tiles ? n0 + NR : N;                                  \
                if (t < tiles) CAT(columns_##KIND, NAME)(xs, M, K, q, d, m, n0, 1, y, N);                 \
                else for (int64_t n = n0; n < n1; n++) CAT(columns_##KIND, NAME)(xs, M, K, q, d, m, n, 0, y, N); \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    free(xs);                                                                                             \
    free(xp);                                                                                             \
}

BATCH(q4)
BATCH(q8)
MATMUL(q4)
MATMUL(q8)
