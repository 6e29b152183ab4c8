// blocks.c's, qdot.c's, attention.c's and top_k.c's kernels as torch operators (decoderlm::block_matmul, block_matmul_int8x,
// block_matmul_int16x, block_dequantize, attend_paged, top_k; their schemas and shapes are declared in __init__.py). A compiled step (AOTInductor) calls an operator
// written in C++ without going back to Python: ~3 µs a call against ~15 through Python, ~200 calls a token.
// Written against torch's stable ABI, whose headers compile in a second.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <optional>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

extern "C" {
typedef void (*matmul_fn)(const float *x, int64_t M, int64_t K, const void *q, const void *d, const void *m,
                          int64_t N, float *y);
typedef void (*dequantize_fn)(const void *q, const void *d, const void *m, int64_t N, int64_t K, float *w);
#define DECLARE(level)                                                                            \
  void q4_matmul_##level(const float *, int64_t, int64_t, const void *, const void *, const void *, int64_t, float *); \
  void q8_matmul_##level(const float *, int64_t, int64_t, const void *, const void *, const void *, int64_t, float *); \
  void q4x8_matmul_##level(const float *, int64_t, int64_t, const void *, const void *, const void *, int64_t, float *); \
  void q8x8_matmul_##level(const float *, int64_t, int64_t, const void *, const void *, const void *, int64_t, float *); \
  void q4x16_matmul_##level(const float *, int64_t, int64_t, const void *, const void *, const void *, int64_t, float *); \
  void q8x16_matmul_##level(const float *, int64_t, int64_t, const void *, const void *, const void *, int64_t, float *); \
  void q4_dequantize_##level(const void *, const void *, const void *, int64_t, int64_t, float *);  \
  void q8_dequantize_##level(const void *, const void *, const void *, int64_t, int64_t, float *);  \
  void attend_one_##level(const float *, int64_t, int64_t, const void *, int64_t, int64_t, int64_t, const void *, int64_t, \
                          int64_t, int64_t, int64_t, const int64_t *, int64_t, int64_t, const int64_t *, const float *, int64_t,   \
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float *);                          \
  void top_k_##level(const float *, int64_t, int64_t, int64_t, int64_t *);
DECLARE(avx512)
DECLARE(avx2)
DECLARE(default)
}

namespace {
// Per level, in the order of VARIANTS in __init__.py: {q4, q8}, with fp32 x (blocks.c), and int8 or 16-bit x (qdot.c).
const matmul_fn MATMUL[3][2] = {{q4_matmul_avx512, q8_matmul_avx512}, {q4_matmul_avx2, q8_matmul_avx2},
                                {q4_matmul_default, q8_matmul_default}};
const matmul_fn MATMUL_INT8X[3][2] = {{q4x8_matmul_avx512, q8x8_matmul_avx512}, {q4x8_matmul_avx2, q8x8_matmul_avx2},
                                      {q4x8_matmul_default, q8x8_matmul_default}};
const matmul_fn MATMUL_INT16X[3][2] = {{q4x16_matmul_avx512, q8x16_matmul_avx512}, {q4x16_matmul_avx2, q8x16_matmul_avx2},
                                       {q4x16_matmul_default, q8x16_matmul_default}};
const dequantize_fn DEQUANTIZE[3][2] = {{q4_dequantize_avx512, q8_dequantize_avx512},
                                        {q4_dequantize_avx2, q8_dequantize_avx2},
                                        {q4_dequantize_default, q8_dequantize_default}};
typedef void (*attend_fn)(const float *, int64_t, int64_t, const void *, int64_t, int64_t, int64_t, const void *, int64_t,
                          int64_t, int64_t, int64_t, const int64_t *, int64_t, int64_t, const int64_t *, const float *, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float *);
const attend_fn ATTEND[3] = {attend_one_avx512, attend_one_avx2, attend_one_default};
typedef void (*top_k_fn)(const float *, int64_t, int64_t, int64_t, int64_t *);
const top_k_fn TOP_K[3] = {top_k_avx512, top_k_avx2, top_k_default};
int level = -1;  // set once by Python (use_level): the level torch runs at

void check(const Tensor &q, const Tensor &d, const std::optional<Tensor> &m) {
  STD_TORCH_CHECK(level >= 0, "decoderlm's kernels were loaded without a level (kernels.library() sets it)");
  STD_TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && d.is_contiguous() && d.scalar_type() == ScalarType::Half,
                  "blocks: q (N, K/2 or K) and fp16 scales d (N, K/32), contiguous");
  STD_TORCH_CHECK(q.scalar_type() == (m ? ScalarType::Byte : ScalarType::Char), "blocks: Q4_1 q is uint8, Q8_0 q int8");
  STD_TORCH_CHECK(!m || (m->is_contiguous() && m->scalar_type() == ScalarType::Half), "blocks: offsets m fp16, contiguous");
}

// y (M, N) = x (M, K) · Wᵀ, fp32, with fp32 x or x rounded to int8 or 16 bits (`kernels`).
Tensor matmul(const matmul_fn (&kernels)[3][2], Tensor x, Tensor q, Tensor d, std::optional<Tensor> m) {
  check(q, d, m);
  STD_TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == ScalarType::Float, "x: (M, K) fp32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  STD_TORCH_CHECK(K % 32 == 0 && d.size(0) == N && d.size(1) == K / 32, "x's K does not match the blocks");
  Tensor y = torch::stable::new_empty(x, {M, N});
  kernels[level][m ? 0 : 1](static_cast<const float *>(x.data_ptr()), M, K, q.data_ptr(), d.data_ptr(),
                           m ? m->data_ptr() : nullptr, N, static_cast<float *>(y.data_ptr()));
  return y;
}

Tensor block_matmul(Tensor x, Tensor q, Tensor d, std::optional<Tensor> m) { return matmul(MATMUL, x, q, d, m); }
Tensor block_matmul_int8x(Tensor x, Tensor q, Tensor d, std::optional<Tensor> m) { return matmul(MATMUL_INT8X, x, q, d, m); }
Tensor block_matmul_int16x(Tensor x, Tensor q, Tensor d, std::optional<Tensor> m) { return matmul(MATMUL_INT16X, x, q, d, m); }

// The fp32 weight (N, K).
Tensor block_dequantize(Tensor q, Tensor d, std::optional<Tensor> m) {
  check(q, d, m);
  const int64_t N = q.size(0), K = d.size(1) * 32;
  Tensor w = torch::stable::new_empty(d, {N, K}, ScalarType::Float);
  DEQUANTIZE[level][m ? 0 : 1](q.data_ptr(), d.data_ptr(), m ? m->data_ptr() : nullptr, N, K,
                               static_cast<float *>(w.data_ptr()));
  return w;
}

// A decode step's attention over a paged pool (attention.c): q (B, H, 1, D) over row b's first lens[b] keys,
// key l in slot table[b, l / block_size] · block_size + l % block_size of k, v (slots, Hkv, D), fp32 or fp16 → (B, H, 1, Dv).
// The pools' rows need only be contiguous: a static cache's (Hkv, L, D) buffer seen as (L, Hkv, D) is one block of L slots.
Tensor attend_paged(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lens, double scale, int64_t block_size) {
  STD_TORCH_CHECK(level >= 0, "decoderlm's kernels were loaded without a level (kernels.library() sets it)");
  STD_TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && q.stride(3) == 1 && q.scalar_type() == ScalarType::Float,
                  "attend_paged: q (B, H, 1, D) fp32, its last dimension contiguous");
  const bool half = k.scalar_type() == ScalarType::Half;
  STD_TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.scalar_type() == v.scalar_type() &&
                  (half || k.scalar_type() == ScalarType::Float), "attend_paged: pools k, v (slots, Hkv, D) both fp32 or both fp16, rows contiguous");
  STD_TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == ScalarType::Long && lens.is_contiguous() &&
                  lens.scalar_type() == ScalarType::Long && table.size(0) == q.size(0) && lens.numel() == q.size(0),
                  "attend_paged: table (B, W) and lens (B,) int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), Dv = v.size(2);
  Tensor y = torch::stable::new_empty(q, {B, H, 1, Dv});
  ATTEND[level](static_cast<const float *>(q.data_ptr()), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0) * block_size, k.stride(0),
                k.stride(1), v.data_ptr(), v.stride(0) * block_size, v.stride(0), v.stride(1), half, static_cast<const int64_t *>(table.data_ptr()), table.size(1), block_size,
                static_cast<const int64_t *>(lens.data_ptr()), nullptr, 0, B, H, Hkv, D, Dv, static_cast<float>(scale),
                static_cast<float *>(y.data_ptr()));
  return y;
}

// The indices (N, k) of each row's k largest values of y (N, V) (top_k.c): largest first, of equal ones the lower index.
Tensor top_k(Tensor y, int64_t k) {
  STD_TORCH_CHECK(level >= 0, "decoderlm's kernels were loaded without a level (kernels.library() sets it)");
  STD_TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == ScalarType::Float && 0 < k && k <= y.size(1),
                  "top_k: y (N, V) fp32, contiguous, and 0 < k <= V");
  Tensor out = torch::stable::new_empty(y, {y.size(0), k}, ScalarType::Long);
  TOP_K[level](static_cast<const float *>(y.data_ptr()), y.size(0), y.size(1), k, static_cast<int64_t *>(out.data_ptr()));
  return out;
}
}  // namespace

extern "C" void use_level(int index) { level = index; }

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) {
  m.impl("block_matmul", TORCH_BOX(&block_matmul));
  m.impl("block_matmul_int8x", TORCH_BOX(&block_matmul_int8x));
  m.impl("block_matmul_int16x", TORCH_BOX(&block_matmul_int16x));
  m.impl("block_dequantize", TORCH_BOX(&block_dequantize));
  m.impl("attend_paged", TORCH_BOX(&attend_paged));
  m.impl("top_k", TORCH_BOX(&top_k));
}
