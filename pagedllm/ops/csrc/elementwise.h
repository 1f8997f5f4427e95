// Row kernels of the decoder's elementwise work, each one pass over its row in fp32, for bf16
// rows (with the same bf16 roundings as the PyTorch code they replace, layers/*.py) and for
// fp32 rows (no rounding: the PyTorch code's own arithmetic). Both paths agree with PyTorch to
// the last bit wherever float summation order (the RMS mean) and exp (SiLU) do not enter.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace pagedllm {

// y = w * round(s * rsqrt(mean(s^2) + eps)); with `residual`: s = round(x + residual), which
// is also written back to `residual` (the next residual stream). Otherwise s = x.
template <class E>
static inline __attribute__((always_inline)) void rms_norm_row_t(
    typename E::T* out, const typename E::T* x, typename E::T* residual, const typename E::T* w,
    int64_t n, float eps, float* tmp) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    float s = E::load(x[i]);
    if (residual) s = E::round(s + E::load(residual[i]));
    tmp[i] = s;
    ss += s * s;
  }
  if (residual) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) residual[i] = E::store(tmp[i]);
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = E::store(E::load(w[i]) * E::round(tmp[i] * r));
}

// out[i] = round(round(silu(gate[i])) * up[i]) for x = [gate | up]. Two loops a chunk (the
// exps, then the rest): GCC vectorizes the one-loop form with the division inside exp's
// blends, ~3x slower.
template <class E>
static inline __attribute__((always_inline)) void silu_and_mul_row_t(
    typename E::T* out, const typename E::T* x, int64_t d) {
  constexpr int64_t kChunk = 256;
  float e[kChunk];
  for (int64_t i0 = 0; i0 < d; i0 += kChunk) {
    const int64_t n = d - i0 < kChunk ? d - i0 : kChunk;
    const typename E::T* g = x + i0;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) e[i] = exp_approx(-E::load(g[i]));
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float s = E::round(E::load(g[i]) / (1.f + e[i]));
      out[i0 + i] = E::store(s * E::load(g[d + i]));
    }
  }
}

// Neox-style RoPE of `heads` heads of one token in place: the first `rot` dims of each head
// are pairs (i, i + rot / 2); cos/sin (fp32 table row) are rounded to the element type first
// and every product and sum is rounded, as the PyTorch path computes it in that type (no FMA
// contraction: build.py compiles with -ffp-contract=off).
template <class E>
static inline __attribute__((always_inline)) void rope_row_t(
    typename E::T* x, int64_t heads, int64_t head_size, int64_t rot, const float* cos_sin) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    typename E::T* xh = x + h * head_size;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float c = E::round(cos_sin[i]), s = E::round(cos_sin[half + i]);
      const float x1 = E::load(xh[i]), x2 = E::load(xh[half + i]);
      xh[i] = E::store(E::round(x1 * c) - E::round(x2 * s));
      xh[half + i] = E::store(E::round(x2 * c) + E::round(x1 * s));
    }
  }
}

// One multi-versioned (PAGEDLLM_CLONES) entry point per kernel and element type.
#define PAGEDLLM_ROW_KERNELS(E)                                                               \
  PAGEDLLM_CLONES static void rms_norm_row(E::T* out, const E::T* x, E::T* residual,          \
                                           const E::T* w, int64_t n, float eps, float* tmp) { \
    rms_norm_row_t<E>(out, x, residual, w, n, eps, tmp);                                      \
  }                                                                                           \
  PAGEDLLM_CLONES static void silu_and_mul_row(E::T* out, const E::T* x, int64_t d) {         \
    silu_and_mul_row_t<E>(out, x, d);                                                         \
  }                                                                                           \
  PAGEDLLM_CLONES static void rope_row(E::T* x, int64_t heads, int64_t head_size, int64_t rot, \
                                       const float* cos_sin) {                                \
    rope_row_t<E>(x, heads, head_size, rot, cos_sin);                                         \
  }

PAGEDLLM_ROW_KERNELS(Bf16)
PAGEDLLM_ROW_KERNELS(Fp32)
#undef PAGEDLLM_ROW_KERNELS

// bf16 row -> fp32 row (exact).
PAGEDLLM_CLONES static void widen_row(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_fp32(x[i]);
}

}  // namespace pagedllm
