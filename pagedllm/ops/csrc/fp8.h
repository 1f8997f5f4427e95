// fp8 KV caches (kv_cache_dtype "fp8" / "fp8_e4m3": torch.float8_e4m3fn; "fp8_e5m2":
// torch.float8_e5m2), with a scale per layer for K and one for V (1 unless calculate_kv_scales
// set them: attention/fp8_kv.py). A row is written from bf16 / fp32 values times 1 / scale (the
// reciprocal rounded to fp32 once), saturated at the format's largest finite value and
// rounded to nearest even: the bits `(x.float() * inv).clamp(-M, M).to(torch.float8_*)` stores
// (NaN stays NaN). It is read back as fp8 value times scale in fp32, rounded to the query's
// type; with scale 1 that is the fp8 value itself, exactly (every fp8 value is a bf16 and an
// fp32 value).
//
// The attention kernels never read fp8 rows themselves: an item (request, KV head) first
// widens the rows it attends to into a contiguous scratch of the query's type, from where the
// bf16 / fp32 kernels run unchanged (`Fp8Rows` in ops.cpp). The cache's bytes cross the
// memory bus once, at half bf16's size; the widened copy stays in L1 / L2.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace pagedllm {

enum class Fp8Kind { kE4M3, kE5M2 };

// 2^e as a compile-time float.
constexpr float pow2f(int e) { return e >= 0 ? (e == 0 ? 1.f : 2.f * pow2f(e - 1)) : 0.5f * pow2f(e + 1); }

// The format's bits of f (fp32): kMant mantissa bits, exponent bias kBias, largest finite value
// kMax (e4m3fn: 3, 7, 448; e5m2: 2, 15, 57344). Branch-free, so loops over it vectorize.
template <int kMant, int kBias>
static inline uint8_t fp8_bits(float f, float kMax) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 24) & 0x80u;
  float a = std::fabs(f);
  const bool nan = !(a == a);
  a = a < kMax ? a : kMax;
  // Below the smallest normal 2^(1 - kBias) the step is 2^(1 - kBias - kMant): adding and
  // subtracting 2^23 steps rounds to it (to nearest even), and a / step is the subnormal's
  // bits (the smallest normal's when it rounds up: bits 1 << kMant, exponent 1 mantissa 0).
  constexpr float kStepUp = pow2f(23 + 1 - kBias - kMant), kPerStep = pow2f(kBias - 1 + kMant);
  const float sub = ((a + kStepUp) - kStepUp) * kPerStep;
  // Normal: the fp32 bits rounded to kMant mantissa bits (a carry moves into the exponent),
  // then the exponent rebiased from 127 to kBias.
  uint32_t b;
  std::memcpy(&b, &a, 4);
  constexpr int kDrop = 23 - kMant;
  b = (b + ((1u << (kDrop - 1)) - 1u) + ((b >> kDrop) & 1u)) >> kDrop;
  const uint32_t normal = b - (static_cast<uint32_t>(127 - kBias) << kMant);
  const uint32_t bits = a < pow2f(1 - kBias) ? static_cast<uint32_t>(sub) : normal;
  return static_cast<uint8_t>(sign | (nan ? 0x7Fu : bits));
}

// dst[0..n) = src's n values (bf16 or fp32) times inv (1 / the cache's scale) as fp8 of `kind`.
template <class E>
PAGEDLLM_CLONES static void fp8_store_row_t(uint8_t* dst, const typename E::T* src, int64_t n,
                                            Fp8Kind kind, float inv) {
  if (kind == Fp8Kind::kE4M3)
    for (int64_t i = 0; i < n; ++i) dst[i] = fp8_bits<3, 7>(E::load(src[i]) * inv, 448.f);
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = fp8_bits<2, 15>(E::load(src[i]) * inv, 57344.f);
}

static inline void fp8_store_row(uint8_t* dst, const uint16_t* src, int64_t n, Fp8Kind kind,
                                 float inv) {
  fp8_store_row_t<Bf16>(dst, src, n, kind, inv);
}
static inline void fp8_store_row(uint8_t* dst, const float* src, int64_t n, Fp8Kind kind,
                                 float inv) {
  fp8_store_row_t<Fp32>(dst, src, n, kind, inv);
}

// The fp32 value of fp8 bits b of `kind` (the portable path's lookup tables are built with it).
static inline float fp8_value(uint8_t b, Fp8Kind kind) {
  const float sign = b & 0x80 ? -1.f : 1.f;
  const int mant_bits = kind == Fp8Kind::kE4M3 ? 3 : 2, bias = kind == Fp8Kind::kE4M3 ? 7 : 15;
  const int e = (b & 0x7F) >> mant_bits, m = b & ((1 << mant_bits) - 1);
  if (kind == Fp8Kind::kE4M3 && (b & 0x7F) == 0x7F) return NAN;
  if (kind == Fp8Kind::kE5M2 && e == 31) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - bias - mant_bits);
  return sign * std::ldexp(1.f + static_cast<float>(m) / (1 << mant_bits), e - bias);
}

// 16 fp8 values of format K (bits in the low bytes of 16-bit lanes) -> 16 fp32 lanes: as fp16
// bits (e5m2 is fp16's upper byte; e4m3 shifted into fp16's fields is the value times 2^-8,
// subnormals included) widened by vcvtph2ps, e4m3 then times 2^8. Exact. (e4m3's NaN 0x7F
// comes out finite; the cache holds NaN only where the model produced one.)
template <Fp8Kind K>
PAGEDLLM_AVX512_TARGET static inline __m512 fp8x16_to_ps(__m256i w) {
  if constexpr (K == Fp8Kind::kE5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// The bf16 bits of the 128 non-negative fp8 values of `kind` (bits 0 .. 127).
struct Fp8Bf16Table {
  uint16_t bits[2][128];
  Fp8Bf16Table() {
    for (int k = 0; k < 2; ++k)
      for (int b = 0; b < 128; ++b) bits[k][b] = fp32_to_bf16(fp8_value(static_cast<uint8_t>(b), static_cast<Fp8Kind>(k)));
  }
};
static const Fp8Bf16Table kFp8Bf16;

// What a bf16 query reads for the 128 non-negative fp8 codes of `kind` in a cache of scale
// `scale`: each value times the scale in fp32, rounded to bf16 (at scale 1 the value itself,
// exactly). A negative code reads the negated value (rounding to nearest even is symmetric),
// so the lookups below put the sign bit back. The bits as words, and as their high and low
// bytes (the VBMI byte lookups' tables). Built once per layer call (two per op: K and V).
struct Fp8Bf16Lut {
  alignas(64) uint16_t bits[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  Fp8Bf16Lut(Fp8Kind kind, float scale) {
    const uint16_t* unit = kFp8Bf16.bits[static_cast<int>(kind)];
    for (int b = 0; b < 128; ++b) {
      const uint16_t v = scale == 1.f ? unit[b] : fp32_to_bf16(bf16_to_fp32(unit[b]) * scale);
      bits[b] = v, hi[b] = static_cast<uint8_t>(v >> 8), lo[b] = static_cast<uint8_t>(v);
    }
  }
};

// 32 fp8 values (bits in 16-bit lanes) -> their bf16 bits: the magnitude (7 bits) looked up
// in t (an Fp8Bf16Lut's words, four registers of 32), the sign put back.
PAGEDLLM_AVX512_TARGET static inline __m512i fp8x32_to_bf16(__m512i w, const __m512i t[4]) {
  const __mmask32 high = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
  // vpermt2w reads index bits 0-5 only: bit 6 picks the table pair; the sign (bit 7) moves
  // to bit 15.
  const __m512i v = _mm512_mask_mov_epi16(_mm512_permutex2var_epi16(t[0], w, t[1]), high,
                                          _mm512_permutex2var_epi16(t[2], w, t[3]));
  return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

// Requests the ahead_n rows (src_stride bytes apart, D bytes each) from ahead into L2 as the
// widening walks its own: a walk over scattered cache blocks keeps the memory busy ahead of it.
static inline void fp8_request_row(const uint8_t* ahead, int64_t i, int64_t ahead_n,
                                   int64_t src_stride, int64_t D) {
  if (i < ahead_n)
    for (int64_t off = 0; off < D; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + i * src_stride + off), _MM_HINT_T1);
}

// n fp8 rows of D values, src_stride bytes apart from src, widened into D-element bf16 rows at
// dst by word lookups in `lut` (32 values in 7 instructions).
PAGEDLLM_AVX512_TARGET static void fp8_widen_rows_bf16_avx512(uint16_t* dst, const uint8_t* src, int64_t n,
                                                              int64_t src_stride, int64_t D,
                                                              const Fp8Bf16Lut& lut,
                                                              const uint8_t* ahead, int64_t ahead_n) {
  __m512i table[4];
  for (int i = 0; i < 4; ++i) table[i] = _mm512_load_si512(lut.bits + 32 * i);
  for (int64_t i = 0; i < n; ++i, src += src_stride, dst += D) {
    fp8_request_row(ahead, i, ahead_n, src_stride, D);
    for (int64_t j = 0; j < D; j += 32) {
      const bool whole = D - j >= 32;
      const __mmask32 m = whole ? ~__mmask32(0) : (__mmask32(1) << (D - j)) - 1;
      const __m512i w = _mm512_cvtepu8_epi16(
          whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))
                : _mm256_maskz_loadu_epi8(m, src + j));
      // (A masked store only for a row's tail: on Zen 4 it is several times a plain one's cost.)
      if (whole)
        _mm512_storeu_si512(dst + j, fp8x32_to_bf16(w, table));
      else
        _mm512_mask_storeu_epi16(dst + j, m, fp8x32_to_bf16(w, table));
    }
  }
}

// The same into fp32 rows: through fp16 (exact), times the scale where it is not 1.
template <Fp8Kind K>
PAGEDLLM_AVX512_TARGET static void fp8_widen_rows_fp32_avx512(float* dst, const uint8_t* src, int64_t n,
                                                              int64_t src_stride, int64_t D, float scale,
                                                              const uint8_t* ahead, int64_t ahead_n) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; ++i, src += src_stride, dst += D) {
    fp8_request_row(ahead, i, ahead_n, src_stride, D);
    for (int64_t j = 0; j < D; j += 16) {
      const __mmask16 m = lanes16(j, D);
      __m512 v = fp8x16_to_ps<K>(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, src + j)));
      if (scale != 1.f) v = _mm512_mul_ps(v, s);
      _mm512_mask_storeu_ps(dst + j, m, v);
    }
  }
}

// The portable path: each value's bits looked up, its sign put back (bf16 rows: in `lut`;
// fp32 rows: the exact value, times the scale).
template <class E>
static void fp8_widen_rows_portable(typename E::T* dst, const uint8_t* src, int64_t n,
                                    int64_t src_stride, int64_t D, Fp8Kind kind, float scale,
                                    const Fp8Bf16Lut& lut) {
  const uint16_t* unit = kFp8Bf16.bits[static_cast<int>(kind)];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < D; ++j) {
      const uint8_t b = src[i * src_stride + j];
      const uint16_t sign = static_cast<uint16_t>((b & 0x80) << 8);
      if constexpr (std::is_same_v<E, Fp32>)
        dst[i * D + j] = bf16_to_fp32(unit[b & 0x7F] | sign) * scale;
      else
        dst[i * D + j] = lut.bits[b & 0x7F] | sign;
    }
}

// With AVX512-VBMI (Zen 4 has it; Ice Lake and later): bf16 rows 64 values at a time by byte
// lookups, twice fp8x32_to_bf16's values for about its instructions. The high and low bytes of
// each value's bf16 bits come from `lut`'s two 128-byte tables (vpermi2b: index bits 0-6, so
// the sign bit is not looked up but OR-ed into the high byte), then unpacked into words. The
// unpacks interleave within 128-bit lanes, so the 64 input bytes are first put in the order
// that makes the two 32-word results come out in the values' order.
#define PAGEDLLM_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))

PAGEDLLM_VBMI_TARGET static void fp8_widen_rows_vbmi(uint16_t* dst, const uint8_t* src, int64_t n,
                                                     int64_t src_stride, int64_t D,
                                                     const Fp8Bf16Lut& lut, const uint8_t* ahead,
                                                     int64_t ahead_n) {
  const __m512i hi0 = _mm512_load_si512(lut.hi), hi1 = _mm512_load_si512(lut.hi + 64);
  const __m512i lo0 = _mm512_load_si512(lut.lo), lo1 = _mm512_load_si512(lut.lo + 64);
  // Position p of lane k = p / 16 takes value 8 k + p % 16 (first half of the lane) or
  // 32 + 8 k + p % 16 - 8 (second half): unpacklo then yields values 0-31, unpackhi 32-63.
  alignas(64) static const uint8_t order_bytes[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,
      8,  9,  10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
      16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
      24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i order = _mm512_load_si512(order_bytes);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < n; ++i, src += src_stride, dst += D) {
    fp8_request_row(ahead, i, ahead_n, src_stride, D);
    for (int64_t j = 0; j < D; j += 64) {
      const int64_t rest = D - j;
      const __m512i raw = rest >= 64 ? _mm512_loadu_si512(src + j)
                                     : _mm512_maskz_loadu_epi8((__mmask64(1) << rest) - 1, src + j);
      const __m512i x = _mm512_permutexvar_epi8(order, raw);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, sign, 0xF8);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
      const __m512i first = _mm512_unpacklo_epi8(lo, hi), second = _mm512_unpackhi_epi8(lo, hi);
      if (rest >= 64) {  // (masked stores only at a row's tail: on Zen 4 they cost several plain ones)
        _mm512_storeu_si512(dst + j, first);
        _mm512_storeu_si512(dst + j + 32, second);
      } else {
        _mm512_mask_storeu_epi16(dst + j, rest >= 32 ? ~__mmask32(0) : (__mmask32(1) << rest) - 1, first);
        if (rest > 32) _mm512_mask_storeu_epi16(dst + j + 32, (__mmask32(1) << (rest - 32)) - 1, second);
      }
    }
  }
}

static inline bool cpu_has_avx512_vbmi() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
  return ok;
}
// Whether bf16 rows take the VBMI lookups where the CPU has them (the cpu_fp8_vbmi op; the
// tests run both ways: the same bits).
static std::atomic<bool>& fp8_vbmi() {
  static std::atomic<bool> use{true};
  return use;
}

// n fp8 rows of format `kind` (src_stride bytes apart), read as E's type with `scale` into
// D-element rows at dst, on any CPU (lut: `kind` and `scale`'s table, for bf16 rows).
template <class E>
static void fp8_widen_rows(typename E::T* dst, const uint8_t* src, int64_t n, int64_t src_stride,
                           int64_t D, Fp8Kind kind, float scale, const Fp8Bf16Lut& lut,
                           const uint8_t* ahead, int64_t ahead_n) {
  if (!cpu_has_avx512())
    return fp8_widen_rows_portable<E>(dst, src, n, src_stride, D, kind, scale, lut);
  if constexpr (std::is_same_v<E, Fp32>) {
    if (kind == Fp8Kind::kE4M3)
      return fp8_widen_rows_fp32_avx512<Fp8Kind::kE4M3>(dst, src, n, src_stride, D, scale, ahead, ahead_n);
    return fp8_widen_rows_fp32_avx512<Fp8Kind::kE5M2>(dst, src, n, src_stride, D, scale, ahead, ahead_n);
  } else {
    if (cpu_has_avx512_vbmi() && fp8_vbmi().load(std::memory_order_relaxed))
      return fp8_widen_rows_vbmi(dst, src, n, src_stride, D, lut, ahead, ahead_n);
    fp8_widen_rows_bf16_avx512(dst, src, n, src_stride, D, lut, ahead, ahead_n);
  }
}

}  // namespace pagedllm
