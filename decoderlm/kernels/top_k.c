/* The indices of each row's k largest values, for the LM head's exact rescoring (`quantize.rescore`): 32 of
 * 49,152 logits a row, where torch's topk looks at one value at a time (~80 µs a row, 0.3 ms a step of 8 rows).
 *
 * One pass a row keeps the k best values seen so far; the weakest of them is the threshold. Of a vector of VL
 * values only the lanes above it are looked at, one by one, and after the row's first few hundred values
 * most vectors have none. A later value must be strictly greater to enter, and the weakest of equal kept
 * values leaves first, so of equal values the lower index wins; a NaN counts as +inf. Each row's result is
 * sorted by value (largest first), then index. Compiled once per instruction set (VL, NAME).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "vec.h"

/* The kept slot to give up next: the smallest value, of equal ones the latest index. */
static inline int64_t weakest(const float *val, const int64_t *idx, int64_t k) {
    int64_t w = 0;
    for (int64_t j = 1; j < k; j++)
        if (val[j] < val[w] || (val[j] == val[w] && idx[j] > idx[w])) w = j;
    return w;
}

/* Value i of the row enters the kept slots if it beats their weakest, w (a NaN as +inf); w is then found again. */
static inline void consider(const float *yr, int64_t i, float *val, int64_t *idx, int64_t k, int64_t *w) {
    const float v = isnan(yr[i]) ? INFINITY : yr[i];
    if (v > val[*w]) val[*w] = v, idx[*w] = i, *w = weakest(val, idx, k);
}

/* The lanes of x above t or NaN (not less than or equal), as bits. */
static inline unsigned above(vf x, vf t) {
#if VL == 16
    return _mm512_cmp_ps_mask((__m512)x, (__m512)t, _CMP_NLE_UQ);
#elif VL == 8
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps((__m256)x, (__m256)t, _CMP_NLE_UQ));
#else
    return (unsigned)_mm_movemask_ps(_mm_cmpnle_ps((__m128)x, (__m128)t));
#endif
}

/* y (N, V) → out (N, k), 0 < k <= V. */
void CAT(top_k, NAME)(const float *y, int64_t N, int64_t V, int64_t k, int64_t *out) {
    _Pragma("omp parallel for schedule(static) if (N * V >= 65536)")
    for (int64_t r = 0; r < N; r++) {
        const float *yr = y + r * V;
        int64_t *idx = out + r * k;
        float *val = malloc(k * sizeof(float));
        for (int64_t j = 0; j < k; j++) val[j] = isnan(yr[j]) ? INFINITY : yr[j], idx[j] = j;
        int64_t w = weakest(val, idx, k), i = k;
        for (; i + VL <= V; i += VL)  /* a vector at a time; its lanes above the threshold one by one, in order */
            for (unsigned bits = above(loadf(yr + i), (vf){0} + val[w]); bits; bits &= bits - 1)
                consider(yr, i + __builtin_ctz(bits), val, idx, k, &w);  /* the threshold may have risen: checked again */
        for (; i < V; i++) consider(yr, i, val, idx, k, &w);
        for (int64_t a = 1; a < k; a++)  /* insertion sort: larger value first, then lower index */
            for (int64_t b = a; b > 0 && (val[b] > val[b - 1] || (val[b] == val[b - 1] && idx[b] < idx[b - 1])); b--) {
                const float tv = val[b]; val[b] = val[b - 1], val[b - 1] = tv;
                const int64_t ti = idx[b]; idx[b] = idx[b - 1], idx[b - 1] = ti;
            }
        free(val);
    }
}
