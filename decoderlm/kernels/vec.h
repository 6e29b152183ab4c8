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

/* v folded by op (a function of two vectors) in pairwise halves: lanes i and i + VL/2 first, then the same on
 * the first half, ...; lane 0 holds the result. */
#if VL == 16
#define FOLD(v, op) ({ vf f_ = (v);                                                                          \
    f_ = op(f_, __builtin_shuffle(f_, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));           \
    f_ = op(f_, __builtin_shuffle(f_, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));                 \
    f_ = op(f_, __builtin_shuffle(f_, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));                 \
    f_ = op(f_, __builtin_shuffle(f_, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0})); f_[0]; })
#elif VL == 8
#define FOLD(v, op) ({ vf f_ = (v);                                                                          \
    f_ = op(f_, __builtin_shuffle(f_, (vi){4, 5, 6, 7, 0, 1, 2, 3}));                                         \
    f_ = op(f_, __builtin_shuffle(f_, (vi){2, 3, 0, 1, 2, 3, 0, 1}));                                         \
    f_ = op(f_, __builtin_shuffle(f_, (vi){1, 0, 1, 0, 1, 0, 1, 0})); f_[0]; })
#else
#define FOLD(v, op) ({ vf f_ = (v);                                                                          \
    f_ = op(f_, __builtin_shuffle(f_, (vi){2, 3, 0, 1}));                                                     \
    f_ = op(f_, __builtin_shuffle(f_, (vi){1, 0, 1, 0})); f_[0]; })
#endif
static inline vf vadd(vf a, vf b) { return a + b; }
/* Σ of the lanes, in FOLD's fixed order. */
static inline float hsum(vf v) { return FOLD(v, vadd); }
