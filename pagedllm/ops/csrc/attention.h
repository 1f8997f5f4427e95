// Decode attention read straight from the paged KV cache through the block table.
//
// Cache: [2, num_blocks, block_size, Hkv, D] bf16 (keys at 0, values at 1). One work item is
// one (request, KV head): its G = H / Hkv query heads share every K/V row read. Three passes
// over the request's context: scores q.k for each token (fp32), softmax, then the weighted
// sum of V rows. The scores of one item take G * seq_len floats of scratch.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace pagedllm {

struct DecodeAttnArgs {
  uint16_t* out;              // [B, H, D]
  const uint16_t* q;          // [B, H, D], row stride q_stride (elements)
  int64_t q_stride;
  const uint16_t* kv;         // [2, num_blocks, block_size, Hkv, D]
  int64_t num_blocks, block_size, num_heads, num_kv_heads, head_size;
  const int32_t* block_table; // [B, bt_stride]
  int64_t bt_stride;
  const int32_t* seq_lens;    // [B]
  float scale;
};

// scores[t] = scale * q . k_t for the tokens of one request and KV head, G queries at once.
PAGEDLLM_CLONES static void decode_scores(const DecodeAttnArgs& a, int64_t b, int64_t kvh,
                                          const float* qf, int64_t G, int64_t L, float* scores,
                                          float* kf) {
  const int64_t D = a.head_size, row = a.num_kv_heads * D;
  const int32_t* table = a.block_table + b * a.bt_stride;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const uint16_t* k = a.kv + slot * row + kvh * D;
    for (int64_t d = 0; d < D; ++d) kf[d] = bf16_to_fp32(k[d]);
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

// acc[g] = sum_t p[g, t] * v_t (p = softmaxed scores), then out = bf16(acc).
PAGEDLLM_CLONES static void decode_values(const DecodeAttnArgs& a, int64_t b, int64_t kvh,
                                          int64_t G, int64_t L, const float* p, float* acc,
                                          float* vf) {
  const int64_t D = a.head_size, row = a.num_kv_heads * D;
  const int64_t values = a.num_blocks * a.block_size * row;  // offset of the value half
  const int32_t* table = a.block_table + b * a.bt_stride;
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const uint16_t* v = a.kv + values + slot * row + kvh * D;
    for (int64_t d = 0; d < D; ++d) vf[d] = bf16_to_fp32(v[d]);
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * L + t];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += w * vf[d];
    }
  }
  uint16_t* out = a.out + (b * a.num_heads + kvh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) out[i] = fp32_to_bf16(acc[i]);
}

#define PAGEDLLM_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// 16 bf16 at p -> 16 fp32.
PAGEDLLM_AVX512_TARGET static inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 fp32 -> 16 bf16, rounded to nearest even (AVX-512F only; the attention outputs are
// finite).
PAGEDLLM_AVX512_TARGET static inline __m256i store_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// Softmax of each of the G rows of scores [G, L] in place.
PAGEDLLM_AVX512_TARGET static void softmax_rows(float* scores, int64_t G, int64_t L) {
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
template <int C, int G>
PAGEDLLM_AVX512_TARGET static void decode_item_avx512(const DecodeAttnArgs& a, int64_t b,
                                                     int64_t kvh, float* scores) {
  constexpr int64_t D = 16 * C;
  const int64_t L = a.seq_lens[b], row = a.num_kv_heads * D;
  const int64_t values = a.num_blocks * a.block_size * row;
  const int32_t* table = a.block_table + b * a.bt_stride;
  const uint16_t* q = a.q + b * a.q_stride + kvh * G * D;
  __m512 qr[G][C];
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qr[g][c] = _mm512_mul_ps(load_bf16x16(q + g * D + 16 * c), scale);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const uint16_t* k = a.kv + slot * row + kvh * D;
    __m512 kr[C];
    for (int c = 0; c < C; ++c) kr[c] = load_bf16x16(k + 16 * c);
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mul_ps(kr[0], qr[g][0]);
      for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(kr[c], qr[g][c], s);
      scores[g * L + t] = _mm512_reduce_add_ps(s);
    }
  }
  softmax_rows(scores, G, L);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size +
                         t % a.block_size;
    const uint16_t* v = a.kv + values + slot * row + kvh * D;
    __m512 vr[C];
    for (int c = 0; c < C; ++c) vr[c] = load_bf16x16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * L + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, vr[c], acc[g][c]);
    }
  }
  uint16_t* out = a.out + (b * a.num_heads + kvh * G) * D;
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + 16 * c),
                          store_bf16x16(acc[g][c]));
}

// Head sizes 64 and 128 with up to 4 / 2 query heads per KV head take the register kernel.
static bool decode_item_fast(const DecodeAttnArgs& a, int64_t b, int64_t kvh, float* scores) {
  if (!__builtin_cpu_supports("avx512f")) return false;
  const int64_t D = a.head_size, G = a.num_heads / a.num_kv_heads;
  switch (D * 16 + G) {
    case 64 * 16 + 1: decode_item_avx512<4, 1>(a, b, kvh, scores); return true;
    case 64 * 16 + 2: decode_item_avx512<4, 2>(a, b, kvh, scores); return true;
    case 64 * 16 + 3: decode_item_avx512<4, 3>(a, b, kvh, scores); return true;
    case 64 * 16 + 4: decode_item_avx512<4, 4>(a, b, kvh, scores); return true;
    case 128 * 16 + 1: decode_item_avx512<8, 1>(a, b, kvh, scores); return true;
    case 128 * 16 + 2: decode_item_avx512<8, 2>(a, b, kvh, scores); return true;
    default: return false;
  }
}

// One (request b, KV head kvh) item. scratch: >= G * (seq_len + 2 * D) + D floats.
static void decode_item(const DecodeAttnArgs& a, int64_t b, int64_t kvh, float* scratch) {
  const int64_t D = a.head_size, G = a.num_heads / a.num_kv_heads;
  if (decode_item_fast(a, b, kvh, scratch)) return;
  const int64_t L = a.seq_lens[b];
  float* qf = scratch;             // [G, D]
  float* scores = qf + G * D;      // [G, L]
  float* tmp = scores + G * L;     // [D] converted K / V row
  float* acc = tmp + D;            // [G, D]
  const uint16_t* q = a.q + b * a.q_stride + kvh * G * D;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = bf16_to_fp32(q[i]) * a.scale;
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
