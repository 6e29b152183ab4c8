/* y = x · Wᵀ for blocks.c's Q4_1 / Q8_0 weights with integer activations and integer dot products, the
 * arithmetic of llama.cpp's CPU kernels: each block of 32 inputs of a row of x is rounded to integers
 * qx with a scale dx = max|x| / QMAX, and a block's products are summed exactly in int32, S = Σ qw·qx:
 *
 *   x · w over block b = (dw·dx)·S + m·sx,   sx = dx·Σ qx   (Q8_0: m = 0)
 *
 * DIGITS = 1: qx is int8 (QMAX = 127, llama.cpp's Q8_1), an error of up to 1/254 of the block's largest
 * value, for 2-3x fewer instructions a weight than blocks.c's fp32 path.
 * DIGITS = 2: qx is 16 bits (QMAX = 127·256 = 32512), an error 256 times smaller (1/65024 of the block's
 * largest value). One row at a time, qx is two int8 digits, qx = 255·hi + lo with hi, lo in -127..127,
 * each digit's products summed as for DIGITS = 1 and the two sums joined exactly; a batch multiplies the
 * 16-bit values by pairs (`pmaddwd`). Both give the same S.
 *
 * The blocks' terms are summed in four chains, block b in chain b mod 4, each in block order with one
 * FMA per term ((dw·dx)·S + A, then m·sx + A; the SSE4.1 level, without FMA, rounds each product
 * first), and y = (A0 + A2) + (A1 + A3). Every path computes exactly this for every (row, output): one
 * row or a batch, AVX-512, AVX2 or SSE4.1 give the same bits (tests/test_kernels.py writes it out).
 *
 * One row (and DIGITS = 1): four blocks b..b+3 (a quad, 128 inputs) fill 16 int32 lanes, 4 a block:
 * lane l of block j sums inputs 4l..4l+3 and 16+4l..16+4l+3 of block j (Q4_1's byte order: low nibbles,
 * then high), in one 512-bit vector, two 256-bit or four 128-bit ones; a tile of outputs' lanes are then
 * added into one S per (output, block) (`blocks_of`) and the chains are lanes of float vectors.
 * A batch (DIGITS = 2, MB rows or more; `wide`): the lanes as above, 16-bit x against the weights widened
 * to 16 bits once for up to 8 rows, and the lanes of 4 rows (2 below AVX-512) added into one S per (row,
 * block). At AVX-512 a batch of MZ rows or more puts its rows in the lanes instead (`batch_tile`): 16 rows
 * of x against each weight pair broadcast. Either way a weight is read once per call however many rows.
 * Where the CPU has AMX (and Linux grants its tiles, `amx_tiles`), a batch of MA rows or more multiplies
 * on the tile unit instead (`amx_*`): the same S and the same float steps.
 *
 * Compiled once per instruction set with VL = 16 (AVX-512, with vpdpbusd / vpdpwssd where the CPU has
 * VNNI, and tdpbusd / tdpbssd where it has AMX-INT8), 8 (AVX2) or 4 (SSE4.1), and NAME = the suffix of its
 * entry points; and once per DIGITS, whose entry points are q4x8_matmul_NAME / q8x8_matmul_NAME (1) and q4x16_matmul_NAME / q8x16_matmul_NAME (2).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>
#include <omp.h>

#include "stream.h"
#include "vec.h"

#define NV (16 / VL)  /* int vectors a quad */
#if VL == 16
#define NR 4          /* outputs at a time */
#else
#define NR 2
#endif
#define MR 2          /* rows of x at a time, where there are that many */
#define RV (NV * NR / 4)  /* float vectors of a tile's (output, block) sums: 1 (2 at SSE4.1) */
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
 * ones), inputs 0..15 of the four blocks and then their inputs 16..31; and each block's dx and sx in the
 * lanes of `blocks_of`'s vectors (lane_block). */
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
/* Per lane: Σ of its 8 products, exact; vectors past the quad's nb blocks are 0 (below AVX-512: not computed). */
static inline void dots(const wquad *w, const int8_t *x, int q8, int nb, vi s[NV]) {
    (void)nb;
    __m512i lo = _mm512_loadu_si512(x), hi = _mm512_loadu_si512(x + 64);
    if (q8) lo = _mm512_mask_sub_epi8(lo, w->neg[0], _mm512_setzero_si512(), lo), hi = _mm512_mask_sub_epi8(hi, w->neg[1], _mm512_setzero_si512(), hi);
    s[0] = (vi)dot(dot(_mm512_setzero_si512(), w->u[0], lo), w->u[1], hi);
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
static inline void dots(const wquad *w, const int8_t *x, int q8, int nb, vi s[NV]) {
    s[1] = (vi){0};
    for (int i = 0; i < (nb + 1) / 2; i++) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)(x + 32 * i)), hi = _mm256_loadu_si256((const __m256i *)(x + 64 + 32 * i));
        if (q8) lo = _mm256_sign_epi8(lo, w->sign[i]), hi = _mm256_sign_epi8(hi, w->sign[2 + i]);
        s[i] = (vi)dot2(w->u[i], w->u[2 + i], lo, hi, q8);
    }
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
static inline void dots(const wquad *w, const int8_t *x, int q8, int nb, vi s[NV]) {
    const __m128i one = _mm_set1_epi16(1);
    for (int j = nb; j < 4; j++) s[j] = (vi){0};
    for (int j = 0; j < nb; j++) {
        __m128i lo = _mm_loadu_si128((const __m128i *)(x + 16 * j)), hi = _mm_loadu_si128((const __m128i *)(x + 64 + 16 * j));
        if (q8) lo = _mm_sign_epi8(lo, w->sign[j]), hi = _mm_sign_epi8(hi, w->sign[4 + j]);
        const __m128i a = _mm_maddubs_epi16(w->u[j], lo), b = _mm_maddubs_epi16(w->u[4 + j], hi);
        s[j] = (vi)(q8 ? _mm_add_epi32(_mm_madd_epi16(a, one), _mm_madd_epi16(b, one)) : _mm_madd_epi16(_mm_add_epi16(a, b), one));
    }
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

/* A tile's (output, block) sums: NR outputs' NV vectors of lanes (block j in lanes 4j..4j+3 of the quad)
 * added, exactly, into RV vectors with one lane per (output, block). Each group of four lanes (128 bits) of
 * reduce4(a, b, c, d) holds the group's sums of a, b, c and d (shuffles within 128 bits: 64-bit halves, then
 * even and odd lanes). Lane L then holds block lane_block(L) of output L%4 at AVX-512; below, block
 * L/4 + 2·(L%2) of output (L%4)/2 (the SSE4.1 level's two vectors as one of 8 lanes). */
#if VL == 16
#define MM(op) _mm512_##op
#define ISI __m512i
#define AS_PS _mm512_castsi512_ps
#define AS_SI _mm512_castps_si512
#elif VL == 8
#define MM(op) _mm256_##op
#define ISI __m256i
#define AS_PS _mm256_castsi256_ps
#define AS_SI _mm256_castps_si256
#else
#define MM(op) _mm_##op
#define ISI __m128i
#define AS_PS _mm_castsi128_ps
#define AS_SI _mm_castps_si128
#endif
/* Per group: lanes 0 + 2 and 1 + 3 of a, then of b. */
static inline vi halves(vi a, vi b) { return (vi)MM(unpacklo_epi64)((ISI)a, (ISI)b) + (vi)MM(unpackhi_epi64)((ISI)a, (ISI)b); }
/* Per group: lanes 0 + 1 and 2 + 3 of a, then of b. */
static inline vi pairs_added(vi a, vi b) {
    return (vi)AS_SI(MM(shuffle_ps)(AS_PS((ISI)a), AS_PS((ISI)b), 0x88)) + (vi)AS_SI(MM(shuffle_ps)(AS_PS((ISI)a), AS_PS((ISI)b), 0xdd));
}
static inline vi reduce4(vi a, vi b, vi c, vi d) { return pairs_added(halves(a, b), halves(c, d)); }
static inline int lane_block(int L) { return VL == 16 ? L / 4 : L < 8 ? L / 4 + 2 * (L % 2) : -1; }
static inline void blocks_of(vi s[NR][NV], vi S[RV]) {
#if VL == 16
    S[0] = reduce4(s[0][0], s[1][0], s[2][0], s[3][0]);
#elif VL == 8
    S[0] = reduce4(s[0][0], s[0][1], s[1][0], s[1][1]);
#else
    S[0] = reduce4(s[0][0], s[0][2], s[1][0], s[1][2]), S[1] = reduce4(s[0][1], s[0][3], s[1][1], s[1][3]);
#endif
}
#if VL != 4
/* h[0..nb) (nb <= 4) in the low 64 bits, zeros after (loaded whole: a copy to the stack first stalls each load). */
static inline __m128i half4(const half *h, int nb) {
#if VL == 16
    return nb == 4 ? _mm_loadl_epi64((const __m128i *)h) : _mm_maskz_loadu_epi16((__mmask8)((1 << nb) - 1), h);
#else
    if (nb == 4) return _mm_loadl_epi64((const __m128i *)h);
    if (nb == 2) { int32_t two; memcpy(&two, h, 4); return _mm_cvtsi32_si128(two); }
    half b[4] = {{0}};
    memcpy(b, h, 2 * (size_t)nb);
    return _mm_loadl_epi64((const __m128i *)b);
#endif
}
#endif
/* h[n·B + j] (outputs n < nrc, blocks j < nb of a quad; the rest 0) in the lanes of blocks_of. */
static inline __attribute__((always_inline)) void scales_of(const half *h, int64_t B, int nrc, int nb, vf out[RV]) {
#if VL == 4
    float f[8] = {0};  /* SSE4.1 has no F16C */
    for (int n = 0; n < nrc; n++)
        for (int j = 0; j < nb; j++) f[4 * n + j] = widen(h[n * B + j]);
    out[0] = (vf){f[0], f[2], f[4], f[6]}, out[1] = (vf){f[1], f[3], f[5], f[7]};
#else
    __m128i u[NR];  /* output n's four fp16 in the low 64 bits */
    for (int n = 0; n < NR; n++) u[n] = n < nrc ? half4(h + n * B, nb) : _mm_setzero_si128();
#if VL == 16
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(u[0], u[1])), _mm_unpacklo_epi64(u[2], u[3]), 1);
    out[0] = _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), _mm512_cvtph_ps(v));  /* 4n + j -> 4j + n */
#else
    out[0] = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_unpacklo_epi64(u[0], u[1])), _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0));
#endif
#endif
}
/* The NR outputs of one row from its chains in the lanes of blocks_of: (A0 + A2) + (A1 + A3). */
static inline void outputs(const vf acc[RV], float y[NR]) {
#if VL == 16
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(acc[0]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[0]), 1)));  /* A0 + A2, A1 + A3 */
    _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#elif VL == 8
    const __m256 a = acc[0], t = _mm256_add_ps(a, _mm256_permute_ps(a, 0xb1));  /* lanes 0, 2, 4, 6: a0 + a1, a2 + a3, ... */
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    y[0] = u[0], y[1] = u[2];
#else
    const vf a = acc[0], b = acc[1];
    y[0] = (a[0] + a[1]) + (b[0] + b[1]), y[1] = (a[2] + a[3]) + (b[2] + b[3]);
#endif
}

/* Block xb (32 values) rounded as nearbyintf rounds: v = x·QMAX/max|x|; returns dx = max|x|/QMAX, with
 * Σ v in *total. */
static inline float round_block(const float *xb, int32_t v[32], int32_t *total) {
    vf top = {0};
    for (int i = 0; i < 32; i += VL) top = vmax(top, vabs(loadf(xb + i)));
    const float amax = hmax(top);
    const float inv = amax > 0 ? QMAX / amax : 0;
    vi sum = {0};
    for (int i = 0; i < 32; i += VL) {
        const vi r = __builtin_convertvector(vround(loadf(xb + i) * inv), vi);
        memcpy(v + i, &r, sizeof r);
        sum += r;
    }
    int32_t t = 0;
    for (int l = 0; l < VL; l++) t += sum[l];
    *total = t;
    return amax / QMAX;
}

typedef int8_t vb __attribute__((vector_size(VL)));

/* The high digit of 16-bit values v = 255·hi + lo (hi, lo in -127..127): v/255 to the nearest integer. v/255 is
 * never within 1/510 of a half, far more than fp32's error. */
static inline vi high_digit(vi v) { return __builtin_convertvector(vround(tofloat(v) / 255.0f), vi); }

#if DIGITS == 2
/* Where input k of block j of a quad goes among the quad's 128 values in pair order (`pairs`): vector i of
 * the quad's lanes, its pair t, lane within the vector, first or second of the pair. */
static inline int pair_at(int j, int k) {
    const int b = k % 16, lane = 4 * j + b / 4, t = 2 * (k / 16) + (b & 1), e = (b & 3) >> 1;
    return ((lane / VL * 4 + t) * VL + lane % VL) * 2 + e;
}
typedef int16_t vh32 __attribute__((vector_size(64)));
/* Block j's 32 values v into its quad's pairs: for each pair t, its four lanes' pairs (eight values, together). */
static inline void block_pairs(const int32_t v[32], int j, int16_t *quad) {
    vh32 s;
    for (int i = 0; i < 32; i++) s[i] = (int16_t)v[i / 16 * 16 + i % 16 / 8 + 2 * (i % 8)];  /* evens of each half, then odds */
    static const int first[4] = {0, 1, 16, 17};  /* input k of a lane's first pair t */
    for (int t = 0; t < 4; t++) memcpy(quad + pair_at(j, first[t]), (const int16_t *)&s + 8 * t, 16);
}
#endif

/* Row x (K) as ceil(K/128) quads (blocks past the row are 0); DIGITS = 2 and `pairs` not NULL: each quad's
 * 16-bit values in pair order (128 a quad) instead of the digits, for a batch (`wide`). */
static void quantize_row(const float *x, int64_t K, xquad *out, int16_t *pairs) {
    const int64_t B = K / 32;
    for (int64_t p = 0; p < (B + 3) / 4; p++) {
        xquad *o = out + p;
        memset(o, 0, sizeof *o);
#if DIGITS == 2
        if (pairs) memset(pairs + 128 * p, 0, 256);
#endif
        for (int j = 0; j < 4 && 4 * p + j < B; j++) {
            int32_t v[32], total;
            const float dx = round_block(x + (4 * p + j) * 32, v, &total);
            for (int l = 0; l < 16; l++)
                if (lane_block(l) == j) o->dx[l] = dx, o->sx[l] = dx * (float)total;
#if DIGITS == 2
            if (pairs) {
                block_pairs(v, j, pairs + 128 * p);
                continue;
            }
#else
            (void)pairs;
#endif
            for (int i = 0; i < 32; i += VL) {
                vi r;
                memcpy(&r, v + i, sizeof r);
                const int at = (i < 16 ? 0 : 64) + 16 * j + i % 16;
#if DIGITS == 2
                const vi hi = high_digit(r);
                const vb h = __builtin_convertvector(hi, vb), lo = __builtin_convertvector(r - 255 * hi, vb);
                memcpy(o->q[0] + at, &h, VL), memcpy(o->q[1] + at, &lo, VL);
#else
                const vb b = __builtin_convertvector(r, vb);
                memcpy(o->q[0] + at, &b, VL);
#endif
            }
        }
    }
}

/* Adds quad p of outputs [n0, n0 + NRC) for rows [0, MRC) of the quantized x (xs: P quads a row) to the
 * chains acc. `nb` (a constant where this is inlined) is the quad's blocks within the row. */
#define QUAD(KIND, MRC, NRC)                                                                              \
static inline __attribute__((always_inline)) void CAT(quad_##KIND##_##MRC##_##NRC, NAME)(               \
        const xquad *xs, int64_t P, int64_t K, const void *q, const half *d, const half *m,       \
        int64_t n0, int64_t p, int nb, vf acc[MRC][RV]) {                                                 \
    const int64_t B = K / 32;                                                                             \
    wquad w[NRC];                                                                                         \
    vf dw[RV], mw[RV];                                                                                    \
    for (int n = 0; n < NRC; n++)                                                                         \
        load_##KIND((const void *)((const char *)q + (n0 + n) * BYTES_##KIND(K) + 4 * p * BYTES_##KIND(32)), nb, &w[n]); \
    scales_of(d + n0 * B + 4 * p, B, NRC, nb, dw);                                                        \
    if (Q4_##KIND) scales_of(m + n0 * B + 4 * p, B, NRC, nb, mw);                                         \
    for (int r = 0; r < MRC; r++) {                                                                       \
        const xquad *xp = xs + r * P + p;                                                                 \
        vi s[NR][NV], S[RV];                                                                              \
        for (int n = NRC; n < NR; n++)  /* outputs past NRC: 0 */                                         \
            for (int i = 0; i < NV; i++) s[n][i] = (vi){0};                                               \
        for (int n = 0; n < NRC; n++) {                                                                   \
            dots(&w[n], xp->q[0], !Q4_##KIND, nb, s[n]);                                                  \
            if (DIGITS == 2) {  /* 255·Σ qw·hi + Σ qw·lo, exact */                                        \
                vi lo[NV];                                                                                \
                dots(&w[n], xp->q[DIGITS - 1], !Q4_##KIND, nb, lo);                                       \
                for (int i = 0; i < NV; i++) s[n][i] = (s[n][i] << 8) - s[n][i] + lo[i];                  \
            }                                                                                             \
        }                                                                                                 \
        blocks_of(s, S);                                                                                  \
        for (int v = 0; v < RV; v++) {                                                                    \
            acc[r][v] = fmadd(dw[v] * loadf(xp->dx + VL * v), tofloat(S[v]), acc[r][v]);                  \
            if (Q4_##KIND) acc[r][v] = fmadd(mw[v], loadf(xp->sx + VL * v), acc[r][v]);                   \
        }                                                                                                 \
    }                                                                                                     \
}
#define BYTES_q4(k) ((k) / 2)
#define BYTES_q8(k) (k)
#define Q4_q4 1
#define Q4_q8 0

/* Outputs [n0, n0 + NRC) for rows [0, MRC) of the quantized x. A row's last quad may be partial: two
 * blocks (inlined as such), or one or three. */
#define TILE(KIND, MRC, NRC)                                                                              \
QUAD(KIND, MRC, NRC)                                                                                      \
static void CAT(tile_##KIND##_##MRC##_##NRC, NAME)(const xquad *xs, int64_t K, const void *q,           \
        const half *d, const half *m, int64_t n0, float *y, int64_t N) {                          \
    const int64_t B = K / 32, P = (B + 3) / 4;                                                            \
    vf acc[MRC][RV];                                                                                      \
    for (int r = 0; r < MRC; r++)                                                                         \
        for (int v = 0; v < RV; v++) acc[r][v] = (vf){0};                                                 \
    for (int64_t p = 0; p < B / 4; p++) CAT(quad_##KIND##_##MRC##_##NRC, NAME)(xs, P, K, q, d, m, n0, p, 4, acc); \
    if (B % 4 == 2) CAT(quad_##KIND##_##MRC##_##NRC, NAME)(xs, P, K, q, d, m, n0, B / 4, 2, acc);         \
    else if (B % 4) CAT(quad_##KIND##_##MRC##_##NRC, NAME)(xs, P, K, q, d, m, n0, B / 4, (int)(B % 4), acc); \
    for (int r = 0; r < MRC; r++) {                                                                       \
        float o[NR];                                                                                      \
        outputs(acc[r], o);                                                                               \
        for (int n = 0; n < NRC; n++) y[r * N + n0 + n] = o[n];                                           \
    }                                                                                                     \
}
#define TILE_(KIND, MRC, NRC) TILE(KIND, MRC, NRC)  /* MR and NR expanded first */

#if DIGITS == 2
/* Batches of MB rows or more: x·w + x'·w' in one instruction (pmaddwd; vpdpwssd with VNNI), 16-bit x against
 * the weights widened to 16 bits once for up to RB rows (`wide`). A lane's four pairs are its eight inputs, so
 * its sum is exactly the two digits' sum above; the lanes of RG rows are then added into one S per (row,
 * block), in blocks_of's lanes with rows in place of outputs, for one float step per RG rows.
 * Pair order: per vector i of the quad's lanes (VL lanes, lane L = 4·block + l), four vectors of pairs t,
 * each lane's pair t taken from its inputs (4l, 4l+2), (4l+1, 4l+3), (16+4l, 16+4l+2), (16+4l+1, 16+4l+3):
 * in a lane's 32 bits of Q4_1's nibbles (bytes 4l..4l+3) or Q8_0's first or second 16 bytes, the even bytes
 * and the odd ones. */
#define MB 3
#define RB 8
#define RG NR  /* rows a vector of (row, block) sums */
#define RL (RV * VL)  /* its lanes */
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
    vi s = madd(t[0], x[0]);
    for (int k = 1; k < 4; k++) s += madd(t[k], x[k]);
    return s;
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
/* h[0..nb) (a quad's blocks; the rest 0) in blocks_of's lanes: each lane its block's value. */
static inline void spread_blocks(const half *h, int nb, vf out[RV]) {
#if VL == 16
    out[0] = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_castps128_ps512(_mm_cvtph_ps(half4(h, nb))));
#elif VL == 8
    out[0] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(half4(h, nb))), _mm256_set_epi32(3, 1, 3, 1, 2, 0, 2, 0));
#else
    float f[4] = {0, 0, 0, 0};
    for (int j = 0; j < nb; j++) f[j] = widen(h[j]);
    out[0] = (vf){f[0], f[2], f[0], f[2]}, out[1] = (vf){f[1], f[3], f[1], f[3]};
#endif
}
/* Row of lane L of blocks_of's vectors with rows in place of outputs. */
static inline int lane_row(int L) { return VL == 16 ? L % 4 : L % 4 / 2; }

/* Quad p of output n for rows [0, R): per RG rows, their S in blocks_of's lanes, one float step each.
 * dxT, sxT: per RG rows and quad, dx and sx in those lanes. */
#define WIDE_QUAD(KIND)                                                                                   \
static inline __attribute__((always_inline)) void CAT(wide_quad_##KIND, NAME)(const int16_t *xp,          \
        const float *dxT, const float *sxT, int64_t P, int64_t K, const void *q, const half *d,        \
        const half *m, int64_t n, int64_t p, int nb, int R, vf acc[][RV]) {                           \
    const int64_t B = K / 32;                                                                             \
    wquad w;                                                                                              \
    vf dw[RV], mw[RV];                                                                                    \
    load_##KIND((const void *)((const char *)q + n * BYTES_##KIND(K) + 4 * p * BYTES_##KIND(32)), nb, &w); \
    spread_blocks(d + n * B + 4 * p, nb, dw);                                                             \
    if (Q4_##KIND) spread_blocks(m + n * B + 4 * p, nb, mw);                                              \
    const int nv = (4 * nb + VL - 1) / VL;  /* vectors holding blocks (a partial quad's others: 0) */   \
    vi t[NV][4];                                                                                          \
    for (int i = 0; i < nv; i++) pairs_##KIND(&w, i, t[i]);                                               \
    for (int g = 0; g * RG < R; g++) {                                                                    \
        vi s[NR][NV], S[RV];                                                                              \
        for (int e = 0; e < RG; e++)                                                                      \
            for (int i = 0; i < NV; i++)                                                                  \
                s[e][i] = g * RG + e < R && i < nv ? dot4(t[i], (const vi *)(xp + ((g * RG + e) * P + p) * 128) + 4 * i) : (vi){0}; \
        blocks_of(s, S);                                                                                  \
        const float *dq = dxT + (g * P + p) * RL, *sq = sxT + (g * P + p) * RL;                           \
        for (int v = 0; v < RV; v++) {                                                                    \
            acc[g][v] = fmadd(dw[v] * loadf(dq + VL * v), tofloat(S[v]), acc[g][v]);                      \
            if (Q4_##KIND) acc[g][v] = fmadd(mw[v], loadf(sq + VL * v), acc[g][v]);                       \
        }                                                                                                 \
    }                                                                                                     \
}

/* Output n for rows [0, R) (R <= RB, a constant where inlined). */
#define WIDE(KIND, R)                                                                                     \
static void CAT(wide_##KIND##_##R, NAME)(const int16_t *xp, const float *dxT, const float *sxT, int64_t K, \
        const void *q, const half *d, const half *m, int64_t n, float *y, int64_t N) {            \
    const int64_t B = K / 32, P = (B + 3) / 4;                                                            \
    vf acc[(R + RG - 1) / RG][RV];                                                                        \
    for (int g = 0; g * RG < R; g++)                                                                      \
        for (int v = 0; v < RV; v++) acc[g][v] = (vf){0};                                                 \
    for (int64_t p = 0; p < B / 4; p++) CAT(wide_quad_##KIND, NAME)(xp, dxT, sxT, P, K, q, d, m, n, p, 4, R, acc); \
    if (B % 4) CAT(wide_quad_##KIND, NAME)(xp, dxT, sxT, P, K, q, d, m, n, B / 4, (int)(B % 4), R, acc);  \
    for (int g = 0; g * RG < R; g++) {                                                                    \
        float o[NR];                                                                                      \
        outputs(acc[g], o);                                                                               \
        for (int e = 0; e < RG && g * RG + e < R; e++) y[(g * RG + e) * N + n] = o[e];                     \
    }                                                                                                     \
}
/* WIDE_BATCH: output n for rows [r, r + R) (r a multiple of RG), RB at a time. */
#define WIDE_BATCH(KIND) WIDE_QUAD(KIND) WIDE(KIND, 1) WIDE(KIND, 2) WIDE(KIND, 3) WIDE(KIND, 4)          \
                    WIDE(KIND, 5) WIDE(KIND, 6) WIDE(KIND, 7) WIDE(KIND, 8)                               \
static void CAT(wide_##KIND, NAME)(const int16_t *xp, const float *dxT, const float *sxT, int64_t r, int64_t R, \
        int64_t K, const void *q, const half *d, const half *m, int64_t n, float *y, int64_t N) {  \
    const int64_t P = (K / 32 + 3) / 4;                                                                   \
    for (int64_t e = r + R; r < e; r += RB) {                                                             \
        const int16_t *xr = xp + r * P * 128;                                                             \
        const float *dr = dxT + r / RG * P * RL, *sr = sxT + r / RG * P * RL;                             \
        float *yr = y + r * N;                                                                            \
        switch (e - r < RB ? (int)(e - r) : RB) {                                                         \
        case 1: CAT(wide_##KIND##_1, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        case 2: CAT(wide_##KIND##_2, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        case 3: CAT(wide_##KIND##_3, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        case 4: CAT(wide_##KIND##_4, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        case 5: CAT(wide_##KIND##_5, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        case 6: CAT(wide_##KIND##_6, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        case 7: CAT(wide_##KIND##_7, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                      \
        default: CAT(wide_##KIND##_8, NAME)(xr, dr, sr, K, q, d, m, n, yr, N); break;                     \
        }                                                                                                 \
    }                                                                                                     \
}
/* dx and sx of rows [RG·g, RG·g + RG) of M in blocks_of's lanes, per quad (xs: the rows' xquads). */
static void transpose_scales(const xquad *xs, int64_t M, int64_t P, int64_t g, float *dxT, float *sxT) {
    int first[4];  /* a lane of each block in xquad's dx */
    for (int j = 0; j < 4; j++)
        for (int L = 0; L < 16; L++)
            if (lane_block(L) == j) { first[j] = L; break; }
    for (int64_t p = 0; p < P; p++)
        for (int L = 0; L < RL; L++) {
            const int64_t r = RG * g + lane_row(L);
            const xquad *o = xs + r * P + p;
            dxT[(g * P + p) * RL + L] = r < M ? o->dx[first[lane_block(L)]] : 0;
            sxT[(g * P + p) * RL + L] = r < M ? o->sx[first[lane_block(L)]] : 0;
        }
}
/* Rows a pass over the weights: as many as keep their pairs, dx and sx (about 320 bytes a quad) within 24 KB
 * of the L1 cache, since every output of the pass reads them all; a multiple of RG. */
static inline int64_t pass_rows(int64_t P) { const int64_t r = 24576 / (320 * P) / RG * RG; return r < RG ? RG : r; }
/* Tiles a span: as many as keep their weights (`bytes` an output) within 256 KB of the L2 cache, so that a
 * span's passes after the first read them from there. */
static inline int64_t span_tiles(int64_t bytes) { const int64_t t = 262144 / (NR * bytes); return t < 1 ? 1 : t; }
#define SCALES_q4(k) ((k) / 8)  /* an output's fp16 d and m */
#define SCALES_q8(k) ((k) / 16)
#define WIDE_ONE(KIND, r, R, n) CAT(wide_##KIND, NAME)(xp, dxT, sxT, r, R, K, q, d, m, n, y, N)
WIDE_BATCH(q4)
WIDE_BATCH(q8)
#else
#define MB (1 << 30)
static inline int64_t pass_rows(int64_t P) { (void)P; return 1; }
static inline int64_t span_tiles(int64_t bytes) { (void)bytes; return 1; }
static void transpose_scales(const xquad *xs, int64_t M, int64_t P, int64_t g, float *dxT, float *sxT) { (void)xs, (void)M, (void)P, (void)g, (void)dxT, (void)sxT; }
#define RG 1
#define RL 1
#define SCALES_q4(k) 0
#define SCALES_q8(k) 0
#define WIDE_ONE(KIND, r, R, n) ((void)(R))  /* never: no batch path (MB) */
#endif

#if DIGITS == 2 && VL == 16
/* Batches of MZ rows or more at AVX-512: lanes are rows, G = 16 of them (a 256-bit vector for a group of 8 or
 * fewer). x is laid out per group of G rows, block and pair k of inputs (2k, 2k+1), each row's two 16-bit
 * values in one int32 lane; a tile of NT outputs has its weights widened to 16-bit pairs once (in L1), and
 * each pair is broadcast against the group's lanes, which `vpdpwssd` (pmaddwd without VNNI) multiplies and
 * adds into the block's S for G rows at once: each (output, block) then takes one float step per G rows. */
#define MZ 16  /* fewer rows: `wide` is faster (qdot_ab.py at 12 rows: 1.02-1.34x; at 16, 0.76-1.10x) */
#define NT 4
#ifdef __AVX512VNNI__
#define SPLIT 2  /* S in two chains: vpdpwssd's sums wait 4 cycles for the last */
#define DOT(W, acc, x, w) (gi##W)_mm##W##_dpwssd_epi32((__m##W##i)(acc), (__m##W##i)(x), _mm##W##_set1_epi32(w))
#else
#define SPLIT 1  /* pmaddwd's products are apart from the sum's chain (an add) */
#define DOT(W, acc, x, w) ((acc) + (gi##W)_mm##W##_madd_epi16((__m##W##i)(x), _mm##W##_set1_epi32(w)))
#endif
typedef int32_t gi256 __attribute__((vector_size(32)));
typedef int32_t gi512 __attribute__((vector_size(64)));
typedef float gf256 __attribute__((vector_size(32)));
typedef float gf512 __attribute__((vector_size(64)));
#define G 16  /* in 512-bit vectors, or 256-bit ones for a group of 8 rows or fewer */
#define FMA(W, a, b, c) (gf##W)_mm##W##_fmadd_ps((__m##W)(a), (__m##W)(b), (__m##W)(c))
#define WIDTHS(X) X(256) X(512)
/* Lanes of group g (rows G·g..) where there are M rows: G, or 8 for 8 rows or fewer. */
static inline int64_t lanes(int64_t g, int64_t M) { return M - G * g <= 8 ? 8 : G; }

/* Block b of every row of x (M, K), rounded, into the rows' lanes: group g's pairs at xg + g·B·16·G,
 * [b][k][lane] (its lanes() lanes), its dx and sx at dxg, sxg + g·B·G, [b][lane]. (Threads take blocks, not
 * rows: a block's lanes share cache lines.) */
static void quantize_block(const float *x, int64_t M, int64_t K, int64_t b, int32_t *xg, float *dxg, float *sxg) {
    const int64_t B = K / 32;
    for (int64_t r = 0; r < M; r++) {
        const int64_t g = r / G, l = r % G, W = lanes(g, M);
        int32_t v[32], total;
        const float d = round_block(x + r * K + 32 * b, v, &total);
        int32_t *pairs = xg + g * B * 16 * G + 16 * b * W + l;
        for (int k = 0; k < 16; k++) pairs[k * W] = (int32_t)((uint32_t)(uint16_t)v[2 * k] | (uint32_t)(uint16_t)v[2 * k + 1] << 16);
        dxg[g * B * G + b * W + l] = d, sxg[g * B * G + b * W + l] = d * (float)total;
    }
}

/* One output's B blocks as 16-bit pairs, block b's 16 at w + b·NT·16 (in input order: Q4_1's low nibbles,
 * then its high ones). */
static void widen_q4(const uint8_t *p, int64_t B, int32_t *w) {
    for (int64_t b = 0; b < B; b++, p += 16, w += NT * 16) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        _mm256_store_si256((__m256i *)w, _mm256_and_si256(v, _mm256_set1_epi16(15)));
        _mm256_store_si256((__m256i *)(w + 8), _mm256_srli_epi16(v, 4));
    }
}
static void widen_q8(const int8_t *p, int64_t B, int32_t *w) {
    for (int64_t b = 0; b < B; b++, p += 32, w += NT * 16) {
        for (int h = 0; h < 2; h++) _mm256_store_si256((__m256i *)(w + 8 * h), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * h))));
    }
}
/* The tile's scales h + n·B (outputs n < nrc, B blocks; the rest 0) as fp32 at out[NT·b + n]: four blocks at a
 * time in scales_of's lanes (block L/4 of output L%4, NT = NR = 4). */
static void tile_scales(const half *h, int64_t B, int nrc, float *out) {
    for (int64_t b = 0; b < B; b += 4) {
        vf v[RV];
        if (nrc == NT && b + 4 <= B) scales_of(h + b, B, NT, 4, v);
        else scales_of(h + b, B, nrc, B - b < 4 ? (int)(B - b) : 4, v);
        storef(out + NT * b, v[0]);
    }
}

/* NT outputs for one group's rows (the W / 32 lanes of a W-bit vector): x (B blocks of 16 pair vectors), dx
 * and sx (B vectors), the tile's pairs w and its scales dw, mw (block b, output n at b·NT + n). The chains
 * in the order of their final sum. */
#define BATCH_TILE(W)                                                                                     \
static inline __attribute__((always_inline)) void batch_tile_##W(const gi##W *x, const gf##W *dx, const gf##W *sx, \
        int64_t B, const int32_t *w, const float *dw, const float *mw, int q4, gf##W out[NT]) {           \
    gf##W part[2][NT];                                                                                    \
    for (int c = 0; c < 4; c++) {                                                                         \
        const int j = 2 * (c & 1) + (c >> 1);  /* chains 0, 2, 1, 3 */                                    \
        gf##W A[NT];                                                                                      \
        for (int n = 0; n < NT; n++) A[n] = (gf##W){0};                                                   \
        for (int64_t b = j; b < B; b += 4) {                                                              \
            const gi##W *xb = x + 16 * b;                                                                 \
            const int32_t *wb = w + 16 * NT * b;                                                          \
            gi##W S[SPLIT][NT];                                                                           \
            for (int h = 0; h < SPLIT; h++)                                                               \
                for (int n = 0; n < NT; n++) S[h][n] = (gi##W){0};                                        \
            _Pragma("GCC unroll 16")                                                                      \
            for (int k = 0; k < 16; k += SPLIT)                                                           \
                for (int h = 0; h < SPLIT; h++)                                                           \
                    for (int n = 0; n < NT; n++) S[h][n] = DOT(W, S[h][n], xb[k + h], wb[16 * n + k + h]); \
            for (int n = 0; n < NT; n++) {                                                                \
                const gi##W s = SPLIT == 2 ? S[0][n] + S[SPLIT - 1][n] : S[0][n];                         \
                A[n] = FMA(W, dw[NT * b + n] * dx[b], __builtin_convertvector(s, gf##W), A[n]);           \
                if (q4) A[n] = FMA(W, (gf##W){0} + mw[NT * b + n], sx[b], A[n]);                          \
            }                                                                                             \
        }                                                                                                 \
        for (int n = 0; n < NT; n++) part[c >> 1][n] = c & 1 ? part[c >> 1][n] + A[n] : A[n];            \
    }                                                                                                     \
    for (int n = 0; n < NT; n++) out[n] = part[0][n] + part[1][n];                                        \
}
WIDTHS(BATCH_TILE)

/* batch_tile at the group's width: out[n][lane]. */
#define GROUP_AT(W) if (width * 32 == W) {                                                                \
        gf##W o[NT];                                                                                      \
        batch_tile_##W((const gi##W *)x, (const gf##W *)dx, (const gf##W *)sx, B, w, dw, mw, q4, o);     \
        for (int n = 0; n < NT; n++) memcpy(out[n], &o[n], sizeof o[n]);                                  \
    }
static inline __attribute__((always_inline)) void group_tile(const int32_t *x, const float *dx, const float *sx, int64_t B,
        const int32_t *w, const float *dw, const float *mw, int q4, int64_t width, float out[NT][G]) {
    WIDTHS(GROUP_AT)
}

#define BATCH(KIND, WIDEN, T)                                                                             \
static void CAT(batch_##KIND, NAME)(const float *x, int64_t M, int64_t K, const void *q, const half *d, \
        const half *m, int64_t N, float *y) {                                                         \
    const int64_t B = K / 32, groups = (M + G - 1) / G, tiles = (N + NT - 1) / NT;                        \
    int32_t *xg = aligned_alloc(64, (size_t)(groups * B * G) * 64);                                       \
    float *dxg = aligned_alloc(64, (size_t)(groups * B * G) * 4), *sxg = aligned_alloc(64, (size_t)(groups * B * G) * 4); \
    if (M % G) {  /* the last group's lanes past M: 0 */                                                  \
        const int64_t g = groups - 1, W = lanes(g, M);                                                    \
        memset(xg + g * B * 16 * G, 0, (size_t)(B * W) * 64);                                             \
        memset(dxg + g * B * G, 0, (size_t)(B * W) * 4), memset(sxg + g * B * G, 0, (size_t)(B * W) * 4); \
    }                                                                                                     \
    _Pragma("omp parallel")                                                                               \
    {                                                                                                     \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t b = 0; b < B; b++) quantize_block(x, M, K, b, xg, dxg, sxg);                                                \
        int32_t *w = aligned_alloc(64, (size_t)B * NT * 64);                                              \
        float *dw = aligned_alloc(64, (size_t)(B + 3) * NT * 4), *mw = aligned_alloc(64, (size_t)(B + 3) * NT * 4);   \
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();                              \
        for (int64_t t = tiles * id / nt; t < tiles * (id + 1) / nt; t++) {                                \
            const int64_t n0 = t * NT, nrc = N - n0 < NT ? N - n0 : NT;                                   \
            if ((t + AHEAD + 1) * NT <= N)  /* a later tile's blocks and scales, from memory */           \
                for (int h = 0; h < NT; h += NR) PREFETCH_##KIND(q, d, m, (t + AHEAD) * NT + h, K);          \
            for (int n = 0; n < NT; n++) {  /* the tile's weights (outputs past N: 0) */                  \
                if (n < nrc) WIDEN((const T *)q + (n0 + n) * BYTES_##KIND(K), B, w + 16 * n);             \
                else for (int64_t b = 0; b < B; b++) memset(w + 16 * (NT * b + n), 0, 64);               \
            }                                                                                             \
            tile_scales(d + n0 * B, B, (int)nrc, dw);                                                     \
            if (Q4_##KIND) tile_scales(m + n0 * B, B, (int)nrc, mw);                                      \
            for (int64_t g = 0; g < groups; g++) {                                                        \
                const int64_t W = lanes(g, M);                                                            \
                const int32_t *xi = xg + g * B * 16 * G;                                                  \
                const float *dx = dxg + g * B * G, *sx = sxg + g * B * G;                                 \
                float out[NT][G];                                                                         \
                group_tile(xi, dx, sx, B, w, dw, mw, Q4_##KIND, W, out);                                    \
                for (int64_t l = 0; l < W && G * g + l < M; l++)                                          \
                    for (int n = 0; n < nrc; n++) y[(G * g + l) * N + n0 + n] = out[n][l];                \
            }                                                                                             \
        }                                                                                                 \
        free(w), free(dw), free(mw);                                                                      \
    }                                                                                                     \
    free(xg), free(dxg), free(sxg);                                                                       \
}
BATCH(q4, widen_q4, uint8_t)
BATCH(q8, widen_q8, int8_t)

#ifdef __AMX_INT8__
/* Batches on AMX (Intel's tile unit): `tdpbusd` multiplies 16 outputs' weights (a block's 32, as bytes) by the
 * same 32 inputs of 16 rows of x (int8) and sums each (output, row) in int32 exactly, 8192 products an
 * instruction. Each block of 16 outputs × 16 rows takes two such products, one per digit of x (qx = 256·hi +
 * lo, lo in -128..127: a shift joins them, where the vector kernels' digits are 255·hi + lo), into two int32
 * tiles; their S = 256·S_hi + S_lo then takes the float step of every other path, in its order (chains by
 * block mod 4, (A0 + A2) + (A1 + A3)), with rows in a vector's lanes. Same S, same steps: the same bits as
 * without tiles. Linux lends a process the tiles when asked (`amx_tiles`). */
#include <sys/syscall.h>
#include <unistd.h>
#define MA 32  /* fewer rows: the vector kernels are as fast (16 rows) or faster (8; docs/performance.md) */
static int amx_on;  /* batches on the tiles: asked for and allowed */

/* Asks Linux for the tile state once (want = 1) or stops using it (0); returns whether batches use the tiles
 * (want < 0: only that). */
int amx_tiles(int want) {
    static int allowed = -1;
    if (want < 0) return amx_on;
    if (want && allowed < 0) allowed = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_on = want && allowed > 0;
}

typedef struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
/* Tiles 0-3: int32 sums (16 outputs × 16 rows); 4, 5: weights (16 outputs × a block's 32 inputs); 6, 7: x's two
 * digits (8 rows of inputs 4k..4k+3 of 16 rows of x, so that an output's row of sums holds the 16 rows). */
static void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = t < 6 ? 16 : 8, c.colsb[t] = t == 4 || t == 5 ? 32 : 64;
    _tile_loadconfig(&c);
}

/* Block b of every row of x (M, K), rounded, as two tiles of digits per group of 16 rows at xt + (g·B + b)·1024:
 * [digit][k / 4][row][k % 4]; dx and sx at dxt, sxt + (g·B + b)·16, [row]. */
static void digits_block(const float *x, int64_t M, int64_t K, int64_t b, int8_t *xt, float *dxt, float *sxt) {
    const int64_t B = K / 32;
    for (int64_t r = 0; r < M; r++) {
        int32_t v[32], total;
        const float dx = round_block(x + r * K + 32 * b, v, &total);
        const int64_t at = (r / 16 * B + b) * 16, l = r % 16;
        for (int h = 0; h < 2; h++) {  /* inputs 16h..16h+15: four dwords of each digit, 64 bytes apart */
            const vi q = (vi)_mm512_loadu_si512(v + 16 * h), hi = (q + 128) >> 8;  /* q = 256·hi + lo, lo in -128..127 */
            int32_t dh[4], dl[4];
            _mm_storeu_si128((__m128i *)dh, _mm512_cvtepi32_epi8((__m512i)hi)), _mm_storeu_si128((__m128i *)dl, _mm512_cvtepi32_epi8((__m512i)(q - (hi << 8))));
            for (int i = 0; i < 4; i++)
                memcpy(xt + at * 64 + 64 * (4 * h + i) + 4 * l, dh + i, 4), memcpy(xt + at * 64 + 512 + 64 * (4 * h + i) + 4 * l, dl + i, 4);
        }
        dxt[at + l] = dx, sxt[at + l] = dx * (float)total;
    }
}

/* Outputs [n0, n0 + nrc) as weight tiles, block b's 16 × 32 bytes at wt + 512·b (outputs past nrc 0), and their
 * scales as fp32 at dw, mw + 16·b. Q8_0's full tiles are read in place instead (TILE_OF_q8). */
static void tiles_q4(const uint8_t *q, const half *d, const half *m, int64_t K, int64_t n0, int nrc, uint8_t *wt, float *dw, float *mw) {
    const int64_t B = K / 32;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t b = 0; b < B; b++)
        for (int n = 0; n < 16; n++) {
            const __m128i v = n < nrc ? _mm_loadu_si128((const __m128i *)(q + (n0 + n) * (K / 2) + 16 * b)) : _mm_setzero_si128();
            _mm_store_si128((__m128i *)(wt + 512 * b + 32 * n), _mm_and_si128(v, low));
            _mm_store_si128((__m128i *)(wt + 512 * b + 32 * n + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
            dw[16 * b + n] = n < nrc ? widen(d[(n0 + n) * B + b]) : 0, mw[16 * b + n] = n < nrc ? widen(m[(n0 + n) * B + b]) : 0;
        }
}
static void tiles_q8(const int8_t *q, const half *d, const half *m, int64_t K, int64_t n0, int nrc, uint8_t *wt, float *dw, float *mw) {
    const int64_t B = K / 32;
    (void)m, (void)mw;
    for (int64_t b = 0; b < B; b++)
        for (int n = 0; n < 16; n++) {
            if (nrc < 16) n < nrc ? memcpy(wt + 512 * b + 32 * n, q + (n0 + n) * K + 32 * b, 32) : memset(wt + 512 * b + 32 * n, 0, 32);
            dw[16 * b + n] = n < nrc ? widen(d[(n0 + n) * B + b]) : 0;
        }
}
/* Block b's weight tile: (pointer, row stride). */
#define TILE_OF_q4(b) wt + 512 * (b), 32
#define TILE_OF_q8(b) (nrc < 16 ? wt + 512 * (b) : (const uint8_t *)q + n0 * K + 32 * (b)), (nrc < 16 ? 32 : K)
#define LOAD_TILE(t, ...) _tile_loadd(t, __VA_ARGS__)  /* TILE_OF's two arguments expanded first */
#define AMX_DOT_q4(c, w, x) _tile_dpbusd(c, w, x)  /* unsigned nibbles × signed digits */
#define AMX_DOT_q8(c, w, x) _tile_dpbssd(c, w, x)
/* Block b's products for the group (weights into tile w, sums into tiles c, c1: the tiles' numbers are literals). */
#define AMX_BLOCK(KIND, w, c, c1, b) {                                                                    \
    const int8_t *xb = xt + (g * B + (b)) * 1024;                                                         \
    _tile_zero(c); _tile_zero(c1);                                                                        \
    LOAD_TILE(w, TILE_OF_##KIND(b)); _tile_loadd(6, xb, 64); _tile_loadd(7, xb + 512, 64);                \
    AMX_DOT_##KIND(c, w, 6); AMX_DOT_##KIND(c1, w, 7);                                                    \
}
#define AMX_STORE(c, c1, i) { _tile_stored(c, s + 512 * (i), 64); _tile_stored(c1, s + 512 * (i) + 256, 64); }
/* The float step of block b's sums (s + 512·i: every output's row of 16 rows) into its chain A; the first block
 * of a chain (b < 4) starts it, the last folds it into the chains' sums P (chain 0 then 2 into P[0], 1 then 3
 * into P[1]). */
#define AMX_STEP(KIND, i, b) {                                                                            \
    const vf dx = loadf(dxt + (g * B + (b)) * 16), sx = loadf(sxt + (g * B + (b)) * 16);                  \
    if ((b) < 4) for (int n = 0; n < 16; n++) A[n] = (vf){0};                                             \
    _Pragma("GCC unroll 16") for (int n = 0; n < 16; n++) {                                               \
        const vi hi = (vi)_mm512_load_si512(s + 512 * (i) + 16 * n), S = (hi << 8) + (vi)_mm512_load_si512(s + 512 * (i) + 256 + 16 * n); \
        A[n] = fmadd(dw[16 * (b) + n] * dx, tofloat(S), A[n]);                                            \
        if (Q4_##KIND) A[n] = fmadd((vf){0} + mw[16 * (b) + n], sx, A[n]);                                \
    }                                                                                                     \
    if ((b) + 4 >= B) fold(P[(b) & 1], A, (b) & 2);                                                       \
}
/* Chain j's sum A into P: the first of its pair (j < 2) sets P, the second adds to it. */
static inline void fold(vf *P, const vf *A, int second) {
    for (int n = 0; n < 16; n++) P[n] = second ? P[n] + A[n] : A[n];
}
#define AMX_BATCH(KIND, T)                                                                                \
static void CAT(amx_##KIND, NAME)(const float *x, int64_t M, int64_t K, const void *q, const half *d, \
        const half *m, int64_t N, float *y) {                                                         \
    const int64_t B = K / 32, groups = (M + 15) / 16, tiles = (N + 15) / 16;                              \
    int8_t *xt = aligned_alloc(64, (size_t)(groups * B) * 1024);                                          \
    float *dxt = aligned_alloc(64, (size_t)(groups * B) * 64), *sxt = aligned_alloc(64, (size_t)(groups * B) * 64); \
    int64_t *order = malloc(B * sizeof *order);  /* blocks chain by chain: 0, 4, 8, …, 2, 6, …, 1, 5, …, 3, 7, … */ \
    for (int64_t j = 0, i = 0; j < 4; j++)                                                                \
        for (int64_t b = 2 * (j & 1) + (j >> 1); b < B; b += 4) order[i++] = b;                           \
    if (M % 16) {  /* the last group's rows past M: 0 */                                                  \
        memset(xt + (groups - 1) * B * 1024, 0, (size_t)B * 1024);                                        \
        memset(dxt + (groups - 1) * B * 16, 0, (size_t)B * 64), memset(sxt + (groups - 1) * B * 16, 0, (size_t)B * 64); \
    }                                                                                                     \
    _Pragma("omp parallel")                                                                               \
    {                                                                                                     \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t b = 0; b < B; b++) digits_block(x, M, K, b, xt, dxt, sxt);                           \
        configure_tiles();                                                                                \
        uint8_t *wt = aligned_alloc(64, (size_t)B * 512);                                                 \
        float *dw = aligned_alloc(64, (size_t)B * 64), *mw = aligned_alloc(64, (size_t)B * 64);           \
        int32_t *s = aligned_alloc(64, 4096);  /* two blocks' sums: [block][digit][output][row] */        \
        float out[16][16] __attribute__((aligned(64)));                                                   \
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();                              \
        for (int64_t t = tiles * id / nt; t < tiles * (id + 1) / nt; t++) {                               \
            const int64_t n0 = 16 * t;                                                                    \
            const int nrc = N - n0 < 16 ? (int)(N - n0) : 16;                                             \
            tiles_##KIND((const T *)q, d, m, K, n0, nrc, wt, dw, mw);                                     \
            for (int64_t g = 0; g < groups; g++) {                                                        \
                vf A[16], P[2][16];                                                                       \
                /* Software-pipelined: the tiles multiply the next block while the vectors step this one. */ \
                AMX_BLOCK(KIND, 4, 0, 1, order[0]) AMX_STORE(0, 1, 0)                                     \
                for (int64_t i = 0; i < B; i += 2) {                                                      \
                    if (i + 1 < B) AMX_BLOCK(KIND, 5, 2, 3, order[i + 1])                                 \
                    AMX_STEP(KIND, 0, order[i])                                                           \
                    if (i + 1 < B) AMX_STORE(2, 3, 1)                                                     \
                    if (i + 2 < B) AMX_BLOCK(KIND, 4, 0, 1, order[i + 2])                                 \
                    if (i + 1 < B) AMX_STEP(KIND, 1, order[i + 1])                                        \
                    if (i + 2 < B) AMX_STORE(0, 1, 0)                                                     \
                }                                                                                         \
                for (int64_t j = B; j < 4; j++) {  /* chains with no block (B < 4) fold zeros */          \
                    for (int n = 0; n < 16; n++) A[n] = (vf){0};                                          \
                    fold(P[j & 1], A, j & 2);                                                             \
                }                                                                                         \
                for (int n = 0; n < 16; n++) storef(out[n], P[0][n] + P[1][n]);                           \
                for (int64_t r = 16 * g; r < M && r < 16 * g + 16; r++)                                   \
                    for (int n = 0; n < nrc; n++) y[r * N + n0 + n] = out[n][r - 16 * g];                 \
            }                                                                                             \
        }                                                                                                 \
        _tile_release();                                                                                  \
        free(wt), free(dw), free(mw), free(s);                                                            \
    }                                                                                                     \
    free(xt), free(dxt), free(sxt), free(order);                                                          \
}
AMX_BATCH(q4, uint8_t)
AMX_BATCH(q8, int8_t)
#define AMX_CALL(KIND) if (M >= MA && amx_on) { CAT(amx_##KIND, NAME)(x, M, K, q, d, m, N, y); return; }
#else
#define AMX_CALL(KIND)
#endif
#define BATCH_CALL(KIND) AMX_CALL(KIND) if (M >= MZ) { CAT(batch_##KIND, NAME)(x, M, K, q, d, m, N, y); return; }
#else
#define BATCH_CALL(KIND)
#endif

/* y (M, N) = x (M, K) · Wᵀ: at AVX-512 a batch of MZ rows or more as rows in lanes; else outputs split between
 * threads in tiles of NR (the last, partial tile one output at a time): a batch (MB rows or more) each
 * thread's tiles in spans whose weights stay in L2, each span's rows in passes (`wide`); fewer rows MR at a
 * time and the rest one by one (the same operations per row either way). */
#define MATMUL(KIND)                                                                                      \
TILE_(KIND, 1, NR) TILE(KIND, 1, 1) TILE_(KIND, MR, NR) TILE_(KIND, MR, 1)                                \
static void CAT(columns_##KIND, NAME)(const xquad *xs, int64_t M, int64_t K, const void *q,             \
        const half *d, const half *m, int64_t n0, int wide, float *y, int64_t N) {                \
    const int64_t P = (K / 32 + 3) / 4;                                                                   \
    int64_t r = 0;                                                                                        \
    for (; r + MR <= M; r += MR)                                                                          \
        (wide ? CAT(CAT(CAT(tile_##KIND, MR), NR), NAME) : CAT(CAT(CAT(tile_##KIND, MR), 1), NAME))(      \
            xs + r * P, K, q, d, m, n0, y + r * N, N);                                                    \
    for (; r < M; r++)                                                                                    \
        (wide ? CAT(CAT(tile_##KIND##_1, NR), NAME) : CAT(tile_##KIND##_1_1, NAME))(xs + r * P, K, q, d, m, n0, y + r * N, N); \
}                                                                                                         \
void CAT(GLUE(KIND, XBITS, _matmul), NAME)(const float *x, int64_t M, int64_t K, const void *q, const half *d,  \
                                const half *m, int64_t N, float *y) {                                 \
    BATCH_CALL(KIND)                                                                                      \
    const int64_t P = (K / 32 + 3) / 4, tiles = N / NR, groups = (M + RG - 1) / RG;                       \
    xquad *xs = aligned_alloc(64, (size_t)(M * P) * sizeof(xquad));                                       \
    int16_t *xp = M >= MB ? aligned_alloc(64, (size_t)(M * P) * 256) : NULL;  /* pair order, for batches */ \
    float *dxT = xp ? aligned_alloc(64, (size_t)(groups * P * RL) * 4) : NULL, *sxT = xp ? aligned_alloc(64, (size_t)(groups * P * RL) * 4) : NULL; \
    if (M < MB)  /* a row or two: rounded by this thread before the others start */                     \
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, xs + r * P, NULL);                     \
    _Pragma("omp parallel")                                                                               \
    {                                                                                                     \
        if (xp) {  /* a batch: its rows rounded by the threads, all of them before any tile */           \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, xs + r * P, xp + r * P * 128);     \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t g = 0; g < groups; g++) transpose_scales(xs, M, P, g, dxT, sxT);                 \
            /* this thread's tiles in spans whose weights stay in L2, each span's rows in passes */       \
            const int64_t T = tiles + 1, nt = omp_get_num_threads(), id = omp_get_thread_num();          \
            const int64_t cap = pass_rows(P), passes = (M + cap - 1) / cap, span = span_tiles(BYTES_##KIND(K) + SCALES_##KIND(K)); \
            const int64_t each = ((M + passes - 1) / passes + RG - 1) / RG * RG;  /* even passes: 16 = 8 + 8, not 14 + 2 */ \
            for (int64_t c = T * id / nt, end = T * (id + 1) / nt; c < end; c += span) {                  \
                const int64_t ce = c + span < end ? c + span : end;                                       \
                for (int64_t r = 0; r < M; r += each) {                                                   \
                    const int64_t R = M - r < each ? M - r : each;                                        \
                    for (int64_t t = c; t < ce; t++) {                                                    \
                        if (r == 0 && t + AHEAD < tiles) PREFETCH_##KIND(q, d, m, (t + AHEAD) * NR, K);   \
                        for (int64_t n = t * NR; n < (t < tiles ? t * NR + NR : N); n++) WIDE_ONE(KIND, r, R, n); \
                    }                                                                                     \
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
    free(xs), free(xp), free(dxT), free(sxT);                                                             \
}

MATMUL(q4)
MATMUL(q8)
