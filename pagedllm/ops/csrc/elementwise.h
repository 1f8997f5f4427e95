// Row kernels of the decoder's elementwise work, each one pass over its row in fp32 with the
// same bf16 roundings as the PyTorch code it replaces (layers/*.py), so both paths agree to
// the last bit wherever float summation order does not enter (the RMS mean does).
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace pagedllm {

// y = w * bf16(s * rsqrt(mean(s^2) + eps)); with `residual`: s = bf16(x + residual), which is
// also written back to `residual` (the next residual stream). Otherwise s = x.
PAGEDLLM_CLONES static void rms_norm_row(uint16_t* out, const uint16_t* x, uint16_t* residual,
                                         const uint16_t* w, int64_t n, float eps, float* tmp) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    float s = bf16_to_fp32(x[i]);
    if (residual) s = round_bf16(s + bf16_to_fp32(residual[i]));
    tmp[i] = s;
    ss += s * s;
  }
  if (residual) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) residual[i] = fp32_to_bf16(tmp[i]);
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = fp32_to_bf16(bf16_to_fp32(w[i]) * round_bf16(tmp[i] * r));
}

// out[i] = bf16(bf16(silu(gate[i])) * up[i]) for x = [gate | up].
PAGEDLLM_CLONES static void silu_and_mul_row(uint16_t* out, const uint16_t* x, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float g = bf16_to_fp32(x[i]);
    const float s = round_bf16(g / (1.f + exp_approx(-g)));
    out[i] = fp32_to_bf16(s * bf16_to_fp32(x[d + i]));
  }
}

// Neox-style RoPE of `heads` heads of one token in place: the first `rot` dims of each head
// are pairs (i, i + rot / 2); cos/sin (fp32 table row) are rounded to bf16 first and every
// product and sum is rounded, as the PyTorch path computes it in bf16.
PAGEDLLM_CLONES static void rope_row(uint16_t* x, int64_t heads, int64_t head_size, int64_t rot,
                                     const float* cos_sin) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* xh = x + h * head_size;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float c = round_bf16(cos_sin[i]), s = round_bf16(cos_sin[half + i]);
      const float x1 = bf16_to_fp32(xh[i]), x2 = bf16_to_fp32(xh[half + i]);
      xh[i] = fp32_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
      xh[half + i] = fp32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
    }
  }
}

}  // namespace pagedllm
