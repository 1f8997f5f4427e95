// Decode attention read straight from the paged KV cache through the block table.
//
// Cache: [2, num_blocks, block_size, Hkv, D] of bf16 or fp32 (keys at 0, values at 1). One
// work item is one (request, KV head): its G = H / Hkv query heads share every K/V row read.
// Three passes over the request's context: scores q.k for each token (fp32), softmax, then
// the weighted sum of V rows. The scores of one item take G * seq_len floats of scratch.
// Kernels: AVX-512 (head sizes 64 / 128, queries in registers), AVX2 + FMA (any head size
// that is a multiple of 8), and a portable one for everything else.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace pagedllm {

template <class E>
struct DecodeAttnArgs {
  using T = typename E::T;
  T* out;                     // [B, H, D]
  const T* q;                 // [B, H, D], row stride q_stride (elements)
  int64_t q_stride;
  const T* kv;                // [2, num_blocks, block_size, Hkv, D]
  int64_t num_blocks, block_size, num_heads, num_kv_heads, head_size;
  const int32_t* block_table; // [B, bt_stride]
  int64_t bt_stride;
  const int32_t* seq_lens;    // [B]
  float scale;

  // Token t's key (value: `value` true) row of request b, KV head kvh.
  inline const T* row(int64_t b, int64_t kvh, int64_t t, bool value) const {
    const int32_t* table = block_table + b * bt_stride;
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const int64_t stride = num_kv_heads * head_size;
    return kv + (value ? num_blocks * block_size * stride : 0) + slot * stride + kvh * head_size;
  }
};

// ---- portable --------------------------------------------------------------------------

// scores[t] = q . k_t for the tokens of one request and KV head, G (scaled) queries at once.
template <class E>
static inline __attribute__((always_inline)) void decode_scores_t(
    const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh, const float* qf, int64_t G, int64_t L,
    float* scores, float* kf) {
  const int64_t D = a.head_size;
  for (int64_t t = 0; t < L; ++t) {
    const typename E::T* k = a.row(b, kvh, t, false);
    for (int64_t d = 0; d < D; ++d) kf[d] = E::load(k[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float lanes[16] = {0};
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        for (int64_t i = 0; i < 16 && d0 + i < D; ++i) lanes[i] += qg[d0 + i] * kf[d0 + i];
      float s = 0.f;
      for (int i = 0; i < 16; ++i) s += lanes[i];
      scores[g * L + t] = s;
    }
  }
}

// acc[g] = sum_t p[g, t] * v_t (p = softmaxed scores), then out = acc in the element type.
template <class E>
static inline __attribute__((always_inline)) void decode_values_t(
    const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh, int64_t G, int64_t L, const float* p,
    float* acc, float* vf) {
  const int64_t D = a.head_size;
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    const typename E::T* v = a.row(b, kvh, t, true);
    for (int64_t d = 0; d < D; ++d) vf[d] = E::load(v[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * L + t];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += w * vf[d];
    }
  }
  typename E::T* out = a.out + (b * a.num_heads + kvh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) out[i] = E::store(acc[i]);
}

#define PAGEDLLM_ATTN_PORTABLE(E)                                                             \
  PAGEDLLM_CLONES static void decode_scores(const DecodeAttnArgs<E>& a, int64_t b,            \
                                            int64_t kvh, const float* qf, int64_t G,          \
                                            int64_t L, float* scores, float* kf) {            \
    decode_scores_t<E>(a, b, kvh, qf, G, L, scores, kf);                                      \
  }                                                                                           \
  PAGEDLLM_CLONES static void decode_values(const DecodeAttnArgs<E>& a, int64_t b,            \
                                            int64_t kvh, int64_t G, int64_t L, const float* p, \
                                            float* acc, float* vf) {                          \
    decode_values_t<E>(a, b, kvh, G, L, p, acc, vf);                                          \
  }
PAGEDLLM_ATTN_PORTABLE(Bf16)
PAGEDLLM_ATTN_PORTABLE(Fp32)
#undef PAGEDLLM_ATTN_PORTABLE

// ---- AVX-512 ---------------------------------------------------------------------------

#define PAGEDLLM_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// 16 elements at p -> 16 fp32.
PAGEDLLM_AVX512_TARGET static inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PAGEDLLM_AVX512_TARGET static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 fp32 -> 16 elements at p; to bf16 rounded to nearest even (AVX-512F only; the
// attention outputs are finite).
PAGEDLLM_AVX512_TARGET static inline void store16(uint16_t* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
PAGEDLLM_AVX512_TARGET static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// Softmax of each of the G rows of scores [G, L] in place.
PAGEDLLM_AVX512_TARGET static void softmax_rows_avx512(float* scores, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    float m = _mm512_reduce_max_ps(mx);
    for (; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (t = 0; t < L; ++t) sum += (sg[t] = exp_approx(sg[t] - m));
    const float inv = 1.f / sum;
    for (t = 0; t < L; ++t) sg[t] *= inv;
  }
}

// The three passes with AVX-512 for head size 16 C and G query heads per KV head, with the
// G scaled queries and the G output accumulators held in registers (C * G <= 16): each K or
// V row is read and widened once per token and used by all G heads.
template <class E, int C, int G>
PAGEDLLM_AVX512_TARGET static void decode_item_avx512(const DecodeAttnArgs<E>& a, int64_t b,
                                                     int64_t kvh, float* scores) {
  constexpr int64_t D = 16 * C;
  const int64_t L = a.seq_lens[b];
  const typename E::T* q = a.q + b * a.q_stride + kvh * G * D;
  __m512 qr[G][C];
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qr[g][c] = _mm512_mul_ps(load16(q + g * D + 16 * c), scale);
  for (int64_t t = 0; t < L; ++t) {
    const typename E::T* k = a.row(b, kvh, t, false);
    __m512 kr[C];
    for (int c = 0; c < C; ++c) kr[c] = load16(k + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mul_ps(kr[0], qr[g][0]);
      for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(kr[c], qr[g][c], s);
      scores[g * L + t] = _mm512_reduce_add_ps(s);
    }
  }
  softmax_rows_avx512(scores, G, L);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const typename E::T* v = a.row(b, kvh, t, true);
    __m512 vr[C];
    for (int c = 0; c < C; ++c) vr[c] = load16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * L + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, vr[c], acc[g][c]);
    }
  }
  typename E::T* out = a.out + (b * a.num_heads + kvh * G) * D;
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(out + g * D + 16 * c, acc[g][c]);
}

// Head sizes 64 and 128 with up to 4 / 2 query heads per KV head take the register kernel.
template <class E>
static bool decode_item_avx512_dispatch(const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh,
                                        float* scores) {
  const int64_t D = a.head_size, G = a.num_heads / a.num_kv_heads;
  switch (D * 16 + G) {
    case 64 * 16 + 1: decode_item_avx512<E, 4, 1>(a, b, kvh, scores); return true;
    case 64 * 16 + 2: decode_item_avx512<E, 4, 2>(a, b, kvh, scores); return true;
    case 64 * 16 + 3: decode_item_avx512<E, 4, 3>(a, b, kvh, scores); return true;
    case 64 * 16 + 4: decode_item_avx512<E, 4, 4>(a, b, kvh, scores); return true;
    case 128 * 16 + 1: decode_item_avx512<E, 8, 1>(a, b, kvh, scores); return true;
    case 128 * 16 + 2: decode_item_avx512<E, 8, 2>(a, b, kvh, scores); return true;
    default: return false;
  }
}

// ---- AVX2 ------------------------------------------------------------------------------

PAGEDLLM_AVX2_TARGET static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

PAGEDLLM_AVX2_TARGET static void softmax_rows_avx2(float* scores, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) sum += (sg[t] = exp_approx(sg[t] - m));
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
}

// Head size D = 8 * C (any multiple of 8), G query heads a KV head: one query head at a time
// with its scaled query (up to 8 vectors) and accumulators in registers; the request's K/V
// rows (L * D elements) are read once from memory and G - 1 more times from cache.
template <class E, int C>
PAGEDLLM_AVX2_TARGET static void decode_item_avx2(const DecodeAttnArgs<E>& a, int64_t b,
                                                  int64_t kvh, float* scores) {
  constexpr int64_t D = 8 * C;
  const int64_t L = a.seq_lens[b], G = a.num_heads / a.num_kv_heads;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t g = 0; g < G; ++g) {
    const typename E::T* q = a.q + b * a.q_stride + (kvh * G + g) * D;
    __m256 qr[C];
    for (int c = 0; c < C; ++c) qr[c] = _mm256_mul_ps(load8(q + 8 * c), scale);
    float* sg = scores + g * L;
    for (int64_t t = 0; t < L; ++t) {
      const typename E::T* k = a.row(b, kvh, t, false);
      __m256 s0 = _mm256_mul_ps(load8(k), qr[0]);
      __m256 s1 = _mm256_setzero_ps();
      for (int c = 1; c < C; ++c) {
        if (c % 2) s1 = _mm256_fmadd_ps(load8(k + 8 * c), qr[c], s1);
        else s0 = _mm256_fmadd_ps(load8(k + 8 * c), qr[c], s0);
      }
      sg[t] = hsum8(_mm256_add_ps(s0, s1));
    }
  }
  softmax_rows_avx2(scores, G, L);
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = scores + g * L;
    typename E::T* out = a.out + (b * a.num_heads + kvh * G + g) * D;
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      const typename E::T* v = a.row(b, kvh, t, true);
      const __m256 w = _mm256_set1_ps(pg[t]);
      for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < C; ++c) store8(out + 8 * c, acc[c]);
  }
}

template <class E>
static bool decode_item_avx2_dispatch(const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh,
                                      float* scores) {
  switch (a.head_size) {
    case 32: decode_item_avx2<E, 4>(a, b, kvh, scores); return true;
    case 64: decode_item_avx2<E, 8>(a, b, kvh, scores); return true;
    case 80: decode_item_avx2<E, 10>(a, b, kvh, scores); return true;
    case 96: decode_item_avx2<E, 12>(a, b, kvh, scores); return true;
    case 128: decode_item_avx2<E, 16>(a, b, kvh, scores); return true;
    default: return false;
  }
}

// ---- dispatch --------------------------------------------------------------------------

// One (request b, KV head kvh) item. scratch: >= G * (seq_len + 2 * D) + D floats.
template <class E>
static void decode_item(const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh, float* scratch) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && decode_item_avx512_dispatch(a, b, kvh, scratch)) return;
  if (avx2 && decode_item_avx2_dispatch(a, b, kvh, scratch)) return;
  const int64_t D = a.head_size, G = a.num_heads / a.num_kv_heads;
  const int64_t L = a.seq_lens[b];
  float* qf = scratch;             // [G, D]
  float* scores = qf + G * D;      // [G, L]
  float* tmp = scores + G * L;     // [D] converted K / V row
  float* acc = tmp + D;            // [G, D]
  const typename E::T* q = a.q + b * a.q_stride + kvh * G * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = E::load(q[i]) * a.scale;
  decode_scores(a, b, kvh, qf, G, L, scores, tmp);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * L;
    const float mx = *std::max_element(s, s + L);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) sum += (s[t] = exp_approx(s[t] - mx));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  decode_values(a, b, kvh, G, L, scores, acc, tmp);
}

}  // namespace pagedllm
