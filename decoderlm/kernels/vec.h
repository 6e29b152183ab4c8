/* What the kernel files share: GCC vectors of VL floats (VL is set per instruction set when a file is
 * compiled, with NAME, the suffix of its entry points), unaligned loads and stores, and a vector's sum
 * in one fixed order. */
#pragma once
#include <stdint.h>
#include <string.h>

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf loadf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Σ of the lanes, pairwise halves: lanes i and i + VL/2 first, then the same on the first half, ... */
static inline float hsum(vf v) {
#if VL == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
#elif VL == 8
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0});
#else
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 1, 0});
#endif
    return v[0];
}
