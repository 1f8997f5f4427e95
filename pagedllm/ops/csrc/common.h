// Scalar helpers shared by the portable kernels: bf16 <-> fp32 (round to nearest even, as
// PyTorch rounds every bf16 op) and the function multi-versioning the portable loops use.
#pragma once

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

static inline uint16_t fp32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp32 -> bf16 -> fp32: the value a bf16 PyTorch op would have stored.
static inline float round_bf16(float f) { return bf16_to_fp32(fp32_to_bf16(f)); }

}  // namespace pagedllm
