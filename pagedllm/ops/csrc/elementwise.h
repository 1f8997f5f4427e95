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

// rms_norm's and RoPE's bf16 rows by hand on AVX512-BF16 (the compilers' 256-bit
// vectorization of the portable ones above spends ~40 instructions on 16 elements' bf16
// roundings alone; 2-4x faster on rows in cache): the same arithmetic in the same order, so
// the same bits, except that the rounding instruction (vcvtneps2bf16) flushes denormal inputs
// to zero and rms_norm's sum of squares is taken in another order (16 lanes, fused
// multiply-adds). 16 elements a step, the last one masked.
PAGEDLLM_BF16_TARGET static void rms_norm_row_bf16(uint16_t* out, const uint16_t* x,
                                                   uint16_t* residual, const uint16_t* w,
                                                   int64_t n, float eps, float* tmp) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(i, n);
    __m512 s = load16(x + i, m);
    if (residual) {
      s = round16(_mm512_add_ps(s, load16(residual + i, m)));
      store16(residual + i, s, m);
    }
    _mm512_mask_storeu_ps(tmp + i, m, s);
    ss = _mm512_fmadd_ps(s, s, ss);
  }
  const __m512 r =
      _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(i, n);
    const __m512 y = round16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, tmp + i), r));
    store16(out + i, _mm512_mul_ps(load16(w + i, m), y), m);
  }
}

PAGEDLLM_BF16_TARGET static void rope_row_bf16(uint16_t* x, int64_t heads, int64_t head_size,
                                               int64_t rot, const float* cos_sin) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes16(i, half);
    const __m512 c = round16(_mm512_maskz_loadu_ps(m, cos_sin + i));
    const __m512 s = round16(_mm512_maskz_loadu_ps(m, cos_sin + half + i));
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* xh = x + h * head_size + i;
      const __m512 x1 = load16(xh, m), x2 = load16(xh + half, m);
      store16(xh, _mm512_sub_ps(round16(_mm512_mul_ps(x1, c)), round16(_mm512_mul_ps(x2, s))), m);
      store16(xh + half,
              _mm512_add_ps(round16(_mm512_mul_ps(x2, c)), round16(_mm512_mul_ps(x1, s))), m);
    }
  }
}

// round(silu(g)) * u on 16 lanes of bf16 values g and u (the product before its rounding), with
// common.h's exp16; a division stays a division, as the portable row's.
PAGEDLLM_BF16_TARGET static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e))), u);
}

// SiLU x mul's bf16 row (silu_and_mul_row_t's formula: silu rounded to bf16, times up, rounded):
// 1.1-1.2x the portable row's speed (its exps dominate).
PAGEDLLM_BF16_TARGET static void silu_and_mul_row_bf16(uint16_t* out, const uint16_t* x,
                                                       int64_t d) {
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = lanes16(i, d);
    store16(out + i, silu_mul16(load16(x + i, m), load16(x + d + i, m)), m);
  }
}

// bf16 row -> fp32 row (exact).
PAGEDLLM_CLONES static void widen_row(float* out, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_fp32(x[i]);
}

}  // namespace pagedllm
