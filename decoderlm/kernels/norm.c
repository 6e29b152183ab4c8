/* RMSNorm of each row of x (M, N), fp32: y = x · (1 / sqrt(mean(x²) + eps)) · w.
 *
 * A decode step norms one row ~60 times (twice a layer); torch's own op costs tens of µs a call there,
 * most of it dispatch. Each row's sum of squares runs in one fixed order (VL lanes, then pairwise), so a
 * row's result does not depend on the other rows. Compiled once per instruction set (VL, NAME).
 */
#include <math.h>

#include "vec.h"

void CAT(rms_norm, NAME)(const float *x, int64_t M, int64_t N, const float *w, float eps, float *y) {
    _Pragma("omp parallel for schedule(static) if (M * N >= 65536)")
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * N;
        float *yr = y + r * N;
        vf acc = {0};
        int64_t i = 0;
        for (; i + VL <= N; i += VL) acc += loadf(xr + i) * loadf(xr + i);
        float sum = hsum(acc);
        for (; i < N; i++) sum += xr[i] * xr[i];
        const float rstd = 1.0f / sqrtf(sum / (float)N + eps);
        for (i = 0; i + VL <= N; i += VL) storef(yr + i, loadf(xr + i) * rstd * loadf(w + i));
        for (; i < N; i++) yr[i] = xr[i] * rstd * w[i];
    }
}
