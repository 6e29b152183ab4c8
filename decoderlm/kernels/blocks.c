/* y = x · Wᵀ for W stored in llama.cpp's blocks of 32 inputs, with fp32 activations and fp32 sums.
 *
 * Q4_1: each block of a row has 16 bytes of 4-bit values q (byte j: input j in the low nibble, input
 * 16 + j in the high one), a scale d and an offset m (fp16, as in the file), w = q·d + m. Q8_0: 32
 * signed bytes and a scale, w = q·d. A block is unpacked to fp32 weights exactly as the float path
 * dequantizes it (q·d rounded, then + m rounded), so each product x·w is the float path's own.
 *
 * The weights are read once per call however many rows x has: each block is unpacked once for up to 12
 * rows of x at AVX2, 8 at AVX-512 (4 at the SSE level, where more rows share one unpacking through a
 * buffer). Every (row, output) pair is summed by the same sequence of operations whatever the number of
 * rows, so a row's result never depends on what else is in the batch.
 *
 * This file is compiled once per instruction set with VL = floats per vector (16: AVX-512, 8: AVX2,
 * 4: SSE2) and NAME = the suffix of its entry points; GCC's vector extensions become that ISA's code.
 */
#include <stdlib.h>

#define NV (32 / VL)   /* vectors per block */
#define NR 4   /* outputs a thread takes at a time (their sums are independent chains) */
/* Rows of x at most that a tile unpacks its blocks in registers for. AVX2: 12 rows cost per row what 8 do,
 * so a batch of 9-24 rows takes fewer, fuller tiles (9 rows: 15 % faster than 8 + 1, 17: 8 %). */
#define MR (VL == 4 ? 4 : VL == 8 ? 12 : 8)
#define EVEN (VL == 8)  /* a batch in the fewest tiles, as even as can be (12: 12; 16: 8 + 8); else MR at a time */
#define MF 3   /* SSE: rows at a time over a tile unpacked into a buffer (more rows than MR) */

#include <immintrin.h>

#include "stream.h"
#include "vec.h"

/* The conversions GCC does not vectorize by itself, and a·b + c rounded once where the ISA has FMA (the
 * file is compiled with -ffp-contract=off, so every other product is rounded on its own: the same code
 * then gives the same bits in every tile). */
#if VL == 16
static inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf splat(float a) { return _mm512_set1_ps(a); }
static inline void i8x32(const int8_t *p, vf *w) {
    for (int i = 0; i < 2; i++) w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i))));
}
#elif VL == 8
static inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf splat(float a) { return _mm256_set1_ps(a); }
static inline void i8x32(const int8_t *p, vf *w) {
    for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
}
#else
static inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
static inline vf splat(float a) { return _mm_set1_ps(a); }
static inline void u8x16(__m128i v, vf *w) {
    w[0] = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(v));
    w[1] = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(v, 4)));
    w[2] = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    w[3] = _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(v, 12)));
}
static inline void i8x32(const int8_t *p, vf *w) {
    for (int i = 0; i < 8; i++) {
        int32_t four;
        memcpy(&four, p + 4 * i, 4);
        w[i] = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
    }
}
#endif

/* Row n's `count` block scales d (and offsets m, where there are) in fp32: converted once per row, each
 * block's then splats from a load. */
static inline void scales(const half *d, const half *m, int64_t n, int64_t count, float *ds, float *ms) {
    d += n * count, m = m ? m + n * count : m;
    int64_t i = 0;
#if VL >= 8
    for (; i + 8 <= count; i += 8) {
        _mm256_storeu_ps(ds + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + i))));
        if (m) _mm256_storeu_ps(ms + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + i))));
    }
#endif
    for (; i < count; i++) ds[i] = widen(d[i]), ms[i] = m ? widen(m[i]) : 0;
}

/* The 32 weights of block b of row n as NV float vectors, inputs in order (ds, ms: the row's scales).
 * q·d is exact in fp32 (4 bits times fp16's 11), so fmadd(q, d, m) rounds once where the float path
 * rounds q·d (exactly) and then + m: the same bits. */
static inline void weights_q4(const void *q, const float *ds, const float *ms, int64_t n, int64_t b,
                              int64_t K, vf w[NV]) {
    const uint8_t *p = (const uint8_t *)q + n * (K / 2) + b * 16;
    const vf scale = splat(ds[b]), offset = splat(ms[b]);
#if VL == 16
    /* A block's weights take 16 values, q·d + m for q = 0..15: one FMA makes them all, and vpermps looks
     * each weight up by the low 4 bits of its 32-bit lane (the high nibbles shifted down first). */
    const vf table = fmadd((vf){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, scale, offset);
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(raw), table);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(raw, 4)), table);
#elif VL == 8
    /* Bytes 0-7 and 8-15 widened to 32-bit lanes: their low nibbles are inputs 0-15, their high ones 16-31. */
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i low = _mm256_set1_epi32(15);
    w[0] = fmadd(_mm256_cvtepi32_ps(_mm256_and_si256(lo, low)), scale, offset);
    w[1] = fmadd(_mm256_cvtepi32_ps(_mm256_and_si256(hi, low)), scale, offset);
    w[2] = fmadd(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), scale, offset);
    w[3] = fmadd(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), scale, offset);
#else
    const __m128i raw = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    u8x16(_mm_and_si128(raw, low), w);
    u8x16(_mm_and_si128(_mm_srli_epi16(raw, 4), low), w + NV / 2);
    for (int i = 0; i < NV; i++) w[i] = fmadd(w[i], scale, offset);
#endif
}

static inline void weights_q8(const void *q, const float *ds, const float *ms, int64_t n, int64_t b,
                              int64_t K, vf w[NV]) {
    (void)ms;
    i8x32((const int8_t *)q + n * K + b * 32, w);
    const vf scale = splat(ds[b]);
    for (int i = 0; i < NV; i++) w[i] = w[i] * scale;
}

/* Row n's K weights unpacked into w. */
#define UNPACK(KIND)                                                                                      \
static inline void unpack_##KIND(const void *q, const half *d, const half *m, int64_t n, int64_t K, float *w) { \
    float ds[K / 32], ms[K / 32];                                                                         \
    scales(d, m, n, K / 32, ds, ms);                                                                      \
    for (int64_t b = 0; b < K / 32; b++) {                                                                \
        vf v[NV];                                                                                         \
        weights_##KIND(q, ds, ms, n, b, K, v);                                                            \
        memcpy(w + b * 32, v, sizeof v);                                                                  \
    }                                                                                                     \
}
UNPACK(q4)
UNPACK(q8)

/* Outputs [n0, n0 + NRC) for rows [0, MRC) of x (x and y start at the tile's first row), each output's blocks
 * unpacked once, NC outputs at a time: a pass's sums and one output's unpacked block stay in registers (AVX2
 * and SSE have 16, AVX-512 32; a spilled sum costs a store and a load per product). The passes run over
 * chunks of KB blocks, so the rows' x of a chunk (16 KB) stays in L1 for all NRC outputs; between chunks
 * the sums wait in `part`. Every size is a compile-time constant. Each sum (row, output) is one chain of
 * products in block order, in every tile. */
#define TILE(KIND, MRC, NRC)                                                                              \
static inline void CAT(tile_##KIND##_##MRC##_##NRC, NAME)(const float *x, int64_t K, const void *q,     \
        const half *d, const half *m, int64_t n0, float *y, int64_t N) {                          \
    /* AVX2: 2 outputs a pass for 3-4 rows, 1 for 5-12; AVX-512 (32 registers): 2 for 5-8 */            \
    enum { NC = NRC == 1 ? 1 : MRC > 4 ? (VL == 16 ? 2 : 1) : VL == 8 && MRC > 2 ? NRC / 2 : NRC,       \
           KB = 128 / MRC };                                                                              \
    float ds[NRC][K / 32], ms[NRC][K / 32];                                                               \
    for (int n = 0; n < NRC; n++) scales(d, m, n0 + n, K / 32, ds[n], ms[n]);                             \
    vf part[NRC][MRC];                                                                                    \
    for (int n = 0; n < NRC; n++)                                                                         \
        for (int r = 0; r < MRC; r++) part[n][r] = (vf){0};                                               \
    for (int64_t b0 = 0; b0 < K / 32; b0 += KB) {                                                         \
        const int64_t b1 = b0 + KB < K / 32 ? b0 + KB : K / 32;                                           \
        for (int nc = 0; nc < NRC; nc += NC) {                                                            \
            vf acc[MRC][NC];                                                                              \
            for (int r = 0; r < MRC; r++)                                                                 \
                for (int n = 0; n < NC; n++) acc[r][n] = part[nc + n][r];                                 \
            for (int64_t b = b0; b < b1; b++)                                                             \
                for (int n = 0; n < NC; n++) {                                                            \
                    vf w[NV];                                                                             \
                    weights_##KIND(q, ds[nc + n], ms[nc + n], n0 + nc + n, b, K, w);                      \
                    for (int r = 0; r < MRC; r++)                                                         \
                        for (int i = 0; i < NV; i++)                                                      \
                            acc[r][n] = fmadd(w[i], loadf(x + r * K + b * 32 + i * VL), acc[r][n]);        \
                }                                                                                         \
            for (int r = 0; r < MRC; r++)                                                                 \
                for (int n = 0; n < NC; n++) part[nc + n][r] = acc[r][n];                                 \
        }                                                                                                 \
    }                                                                                                     \
    for (int r = 0; r < MRC; r++)                                                                         \
        for (int n = 0; n < NRC; n++) y[r * N + n0 + n] = hsum(part[n][r]);                               \
}

/* Outputs [n0, n0 + NRC) for all M rows of x, in tiles of at most MR rows (EVEN: the fewest tiles, their
 * sizes differing by one at most). */
#define T(KIND, MRC, NRC) TILE(KIND, MRC, NRC)  /* MRC expanded first */
#define CASE(KIND, MRC, NRC) case MRC: CAT(tile_##KIND##_##MRC##_##NRC, NAME)(xr, K, q, d, m, n0, yr, N); break;
#if MR >= 8
#define TILES_8(KIND, NRC) T(KIND, 5, NRC) T(KIND, 6, NRC) T(KIND, 7, NRC) T(KIND, 8, NRC)
#define CASES_8(KIND, NRC) CASE(KIND, 5, NRC) CASE(KIND, 6, NRC) CASE(KIND, 7, NRC) CASE(KIND, 8, NRC)
#else
#define TILES_8(KIND, NRC)
#define CASES_8(KIND, NRC)
#endif
#if MR >= 12
#define TILES_12(KIND, NRC) T(KIND, 9, NRC) T(KIND, 10, NRC) T(KIND, 11, NRC) T(KIND, 12, NRC)
#define CASES_12(KIND, NRC) CASE(KIND, 9, NRC) CASE(KIND, 10, NRC) CASE(KIND, 11, NRC) CASE(KIND, 12, NRC)
#else
#define TILES_12(KIND, NRC)
#define CASES_12(KIND, NRC)
#endif
#define COLUMNS(KIND, NRC)                                                                                \
T(KIND, 1, NRC) T(KIND, 2, NRC) T(KIND, 3, NRC) T(KIND, 4, NRC) TILES_8(KIND, NRC) TILES_12(KIND, NRC)    \
static void CAT(columns_##KIND##_##NRC, NAME)(const float *x, int64_t M, int64_t K, const void *q,      \
        const half *d, const half *m, int64_t n0, float *y, int64_t N) {                          \
    const int64_t tiles = (M + MR - 1) / MR;                                                              \
    for (int64_t t = 0, r = 0; t < tiles; t++) {                                                          \
        const int rows = EVEN ? (int)(M / tiles + (t < M % tiles)) : (int)(M - r < MR ? M - r : MR);      \
        const float *xr = x + r * K;                                                                      \
        float *yr = y + r * N;                                                                            \
        switch (rows) {                                                                                   \
        CASE(KIND, 1, NRC) CASE(KIND, 2, NRC) CASE(KIND, 3, NRC) CASE(KIND, 4, NRC)                       \
        CASES_8(KIND, NRC) CASES_12(KIND, NRC)                                                            \
        }                                                                                                 \
        r += rows;                                                                                        \
    }                                                                                                     \
}

/* The NR outputs of an unpacked tile w (NR, K) for rows [0, MRC) of x: each step loads the rows' x once, then
 * one weight vector at a time (sums, x and a weight in registers: 16 at most for 3 rows). */
#define TILE_F32(MRC)                                                                                     \
static inline void CAT(unpacked_##MRC, NAME)(const float *x, int64_t K, const float *w, float *y, int64_t N) { \
    vf acc[MRC][NR];                                                                                      \
    for (int r = 0; r < MRC; r++)                                                                         \
        for (int n = 0; n < NR; n++) acc[r][n] = (vf){0};                                                 \
    for (int64_t k = 0; k < K; k += VL) {                                                                 \
        vf xv[MRC];                                                                                       \
        for (int r = 0; r < MRC; r++) xv[r] = loadf(x + r * K + k);                                       \
        for (int n = 0; n < NR; n++) {                                                                    \
            const vf wv = loadf(w + n * K + k);                                                           \
            for (int r = 0; r < MRC; r++) acc[r][n] = fmadd(wv, xv[r], acc[r][n]);                        \
        }                                                                                                 \
    }                                                                                                     \
    for (int r = 0; r < MRC; r++)                                                                         \
        for (int n = 0; n < NR; n++) y[r * N + n] = hsum(acc[r][n]);                                      \
}
TILE_F32(1) TILE_F32(2) TILE_F32(3)

/* An unpacked tile's outputs for all M rows, MF rows at a time. */
static void CAT(unpacked, NAME)(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t N) {
    for (int64_t r = 0; r < M; r += MF) {
        switch (M - r < MF ? (int)(M - r) : MF) {
        case 1: CAT(unpacked_1, NAME)(x + r * K, K, w, y + r * N, N); break;
        case 2: CAT(unpacked_2, NAME)(x + r * K, K, w, y + r * N, N); break;
        case 3: CAT(unpacked_3, NAME)(x + r * K, K, w, y + r * N, N); break;
        }
    }
}

/* y (M, N) = x (M, K) · Wᵀ. The outputs are split between threads in tiles of NR (the last, partial
 * tile one output at a time: the same operations per output either way). A tile's blocks are unpacked in
 * registers once per MR rows; at the SSE level (no FMA: unpacking costs more than the products), with more
 * than MR rows, once into a buffer that every group of MF rows reads. */
#define MATMUL(KIND)                                                                                      \
COLUMNS(KIND, 4) COLUMNS(KIND, 1)  /* 4 = NR */                                                          \
void CAT(KIND##_matmul, NAME)(const float *x, int64_t M, int64_t K, const void *q, const half *d,   \
                             const half *m, int64_t N, float *y) {                                   \
    const int64_t tiles = N / NR;                                                                         \
    _Pragma("omp parallel")                                                                               \
    {                                                                                                     \
        float *w = VL == 4 && M > MR ? malloc(NR * K * sizeof(float)) : NULL;  /* this thread's unpacked tile */     \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t t = 0; t <= tiles; t++) {                                                            \
            if (t + AHEAD < tiles) PREFETCH_##KIND(q, d, m, (t + AHEAD) * NR, K);                         \
            if (t < tiles && w) {                                                                         \
                for (int n = 0; n < NR; n++) unpack_##KIND(q, d, m, t * NR + n, K, w + n * K);            \
                CAT(unpacked, NAME)(x, M, K, w, y + t * NR, N);                                           \
            } else if (t < tiles) CAT(columns_##KIND##_4, NAME)(x, M, K, q, d, m, t * NR, y, N);          \
            else for (int64_t n = tiles * NR; n < N; n++) CAT(columns_##KIND##_1, NAME)(x, M, K, q, d, m, n, y, N); \
        }                                                                                                 \
        free(w);                                                                                          \
    }                                                                                                     \
}

/* The fp32 weight (N, K) of the blocks, as the kernels compute with it and the float path dequantizes it
 * (a prefill multiplies by it with BLAS). */
#define DEQUANTIZE(KIND)                                                                                  \
void CAT(KIND##_dequantize, NAME)(const void *q, const half *d, const half *m, int64_t N,       \
                                 int64_t K, float *w) {                                                  \
    _Pragma("omp parallel for schedule(static)")                                                          \
    for (int64_t n = 0; n < N; n++) unpack_##KIND(q, d, m, n, K, w + n * K);                             \
}

MATMUL(q4)
MATMUL(q8)
DEQUANTIZE(q4)
DEQUANTIZE(q8)
