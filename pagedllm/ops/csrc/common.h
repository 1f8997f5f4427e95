// Scalar helpers shared by the portable kernels: bf16 <-> fp32 (round to nearest even, as
// PyTorch rounds every bf16 op) and the function multi-versioning the portable loops use.
#pragma once

#include <immintrin.h>

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

// AVX2 + FMA helpers: 8 bf16 / fp32 values <-> 8 fp32 lanes (bf16 stored rounded to nearest
// even, NaN not special-cased: the vector kernels' outputs are finite).
#define PAGEDLLM_AVX2_TARGET __attribute__((target("avx2,fma")))

PAGEDLLM_AVX2_TARGET static inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PAGEDLLM_AVX2_TARGET static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

PAGEDLLM_AVX2_TARGET static inline void store8(uint16_t* p, __m256 v) {  // round to nearest even
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  // packus works within 128-bit lanes: [r0-3 r0-3 | r4-7 r4-7] -> r0-7 in the low half.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
PAGEDLLM_AVX2_TARGET static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// exp_approx on 8 lanes (the same reduction and polynomial, FMAs for the polynomial steps).
PAGEDLLM_AVX2_TARGET static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 big = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), big), big);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// The sum / maximum of 8 lanes.
PAGEDLLM_AVX2_TARGET static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

PAGEDLLM_AVX2_TARGET static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// AVX-512 without its BF16 extension: the AVX-512 attention kernels.
#define PAGEDLLM_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// Whether this CPU runs PAGEDLLM_AVX512_TARGET code (checked once).
static inline bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

// exp8 on 16 lanes (the same steps, the power of two applied by vscalefps: one instruction for
// four, the same product, since 2^n is a normal float over the clamped range): the AVX-512
// softmaxes' and SiLU's exps.
PAGEDLLM_AVX512_TARGET static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 big = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// AVX-512 with the bf16 pair dot product (vdpbf16ps): the bf16 GEMMs and decode attention.
#define PAGEDLLM_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

// AVX512-BF16 helpers, load8 / store8's 16-lane kin: 16 bf16 values <-> 16 fp32 lanes, stored
// rounded to nearest even by vcvtneps2bf16 (which also flushes denormal inputs to zero). With
// a mask m, only its lanes are read (the others are zero) or written.
// (The loads need only AVX-512F / BW: kernels without the BF16 extension widen rows with
// them too, as gemm_int8.h's row quantizer; the float overload reads fp32 rows alike.)
PAGEDLLM_AVX512_TARGET static inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PAGEDLLM_AVX512_TARGET static inline __m512 load16(const uint16_t* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PAGEDLLM_AVX512_TARGET static inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return widen16(_mm256_maskz_loadu_epi16(m, p));
}
PAGEDLLM_AVX512_TARGET static inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
PAGEDLLM_BF16_TARGET static inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
PAGEDLLM_BF16_TARGET static inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
PAGEDLLM_BF16_TARGET static inline __m512 round16(__m512 v) {  // Bf16::round on 16 lanes
  return widen16((__m256i)_mm512_cvtneps_pbh(v));
}
// The lanes of [i, min(i + 16, n)).
static inline __mmask16 lanes16(int64_t i, int64_t n) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}

}  // namespace pagedllm
