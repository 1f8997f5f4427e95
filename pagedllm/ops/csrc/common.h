// Scalar helpers shared by the portable kernels: bf16 <-> fp32 (round to nearest even, as
// PyTorch rounds every bf16 op) and the function multi-versioning the portable loops use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// The portable kernels are compiled for AVX-512, AVX2 and baseline x86-64 and picked at load
// time (GCC function multi-versioning), so one build runs anywhere and vectorizes where it can.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDLLM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PAGEDLLM_CLONES
#endif

namespace pagedllm {

static inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t fp32_to_bf16(float f) {  // branch-free, so loops over it vectorize
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// fp32 -> bf16 -> fp32: the value a bf16 PyTorch op would have stored.
static inline float round_bf16(float f) { return bf16_to_fp32(fp32_to_bf16(f)); }

// The element types the kernels take (tensors of torch.bfloat16 / torch.float32): T is the
// stored type; load widens to fp32, store narrows (rounding to nearest even), round is the
// rounding a PyTorch op in that type applies to each result (none for fp32).
struct Bf16 {
  using T = uint16_t;
  static inline float load(T v) { return bf16_to_fp32(v); }
  static inline T store(float f) { return fp32_to_bf16(f); }
  static inline float round(float f) { return round_bf16(f); }
};
struct Fp32 {
  using T = float;
  static inline float load(T v) { return v; }
  static inline T store(float f) { return f; }
  static inline float round(float f) { return f; }
};

// exp(x) to ~1 ulp (Cody-Waite reduction, Cephes' degree-6 polynomial): plain arithmetic, so
// loops over it vectorize (libm's expf does not without -ffast-math). x is clamped to
// [-87.3, 88.3] (exp underflows to ~1e-38 / stays below FLT_MAX).
static inline __attribute__((always_inline)) float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  // Round to nearest by the 1.5 * 2^23 trick (no SSE4.1 rounding instruction needed).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace pagedllm
