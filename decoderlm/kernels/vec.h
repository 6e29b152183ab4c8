/* What the kernel files share: GCC vectors of VL floats (VL is set per instruction set when a file is
 * compiled, with NAME, the suffix of its entry points), unaligned loads and stores, fp16 values and their
 * conversions, and a vector's sum in one fixed order. */
#pragma once
#include <stdint.h>
#include <string.h>

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf loadf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* An fp16 value as stored (block scales, an fp16 KV cache): its 16 bits, in a struct so that no arithmetic
 * takes them for a number unconverted. (Not _Float16: GCC 11 has none on x86, and would build no kernel.) */
typedef struct { uint16_t bits; } half;
#ifdef __F16C__
#include <immintrin.h>
static inline float widen(half h) { return _cvtsh_ss(h.bits); }
static inline half narrow(float x) { return (half){_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)}; }
#else
/* Without F16C (the plain level), in integer steps: widening is exact; narrowing rounds to nearest, ties to
 * even, as vcvtps2ph and torch's .half() do. */
static inline float widen(half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000) << 16, e = (h.bits >> 10) & 0x1f, m = h.bits & 0x3ff;
    float f = m * 0x1p-24f;  /* zero or subnormal: m · 2^-24, exact */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = e == 0 ? u | sign : sign | (e == 0x1f ? 0x7f800000 | m << 13 : (e + 112) << 23 | m << 13);  /* inf / NaN, or normal */
    memcpy(&f, &u, 4);
    return f;
}
static inline half narrow(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000) return (half){sign | 0x7e00 | ((a >> 13) & 0x3ff)};  /* NaN, quiet */
    if (a >= 0x477ff000) return (half){sign | 0x7c00};  /* from 65520 (halfway past the largest, 65504): inf */
    if (a >= 0x38800000) {  /* normal in fp16 (from 2^-14): rebias the exponent, round away 13 bits */
        const uint32_t r = a - 0x38000000;
        return (half){sign | ((r + 0xfff + ((r >> 13) & 1)) >> 13)};
    }
    float f;
    memcpy(&f, &a, 4);
    return (half){sign | (uint16_t)__builtin_rintf(f * 0x1p24f)};  /* subnormal: in units of 2^-24, exact, then rounded */
}
#endif

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
