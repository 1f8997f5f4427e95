// Decode attention read straight from the paged KV cache through the block table.
//
// Cache: [2, num_blocks, block_size, Hkv, D] of bf16 or fp32 (keys at 0, values at 1). One
// work item is one (request, KV head): its G = H / Hkv query heads share every K/V row read.
// Three passes over the request's context: scores q.k for each token (fp32), softmax, then
// the weighted sum of V rows. The scores of one item take G * seq_len floats of scratch.
// Kernels: AVX512-BF16 for bf16 caches (head sizes 32, 64, 96, 128, 256; at the end of this
// file), AVX2 + FMA (any head size that is a multiple of 8; AVX-512 CPUs without BF16 take it
// too: a token-by-token AVX-512 kernel with the queries in registers was 1.4-1.7x slower there
// than this one's block-by-block walk, BENCHMARKS.md), and a portable one for everything else.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

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
  // Elements from one cache slot's row to the next's, and from one KV head's to the next's:
  // Hkv * D and D in the paged cache; D and 0 where an item's rows were widened into a
  // contiguous scratch of their own (fp8 caches, below).
  int64_t kv_stride, kv_head_stride;

  // Token t's key (value: `value` true) row of request b, KV head kvh.
  inline const T* row(int64_t b, int64_t kvh, int64_t t, bool value) const {
    const int32_t* table = block_table + b * bt_stride;
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    return kv + (value ? num_blocks * block_size * kv_stride : 0) + slot * kv_stride +
           kvh * kv_head_stride;
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

// ---- AVX2 ------------------------------------------------------------------------------

// Each of the G rows of scores [G, L] in place -> exp(score - the row's max); inv[g] = 1 / the
// row's sum (the caller scales the outputs instead of the probabilities).
PAGEDLLM_AVX2_TARGET static void softmax_rows_avx2(float* scores, int64_t G, int64_t L,
                                                   float* inv) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
    float m = hmax8(mv);
    for (int64_t u = t; u < L; ++u) m = std::max(m, sg[u]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= L; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mb));
      _mm256_storeu_ps(sg + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum8(sv);
    for (; t < L; ++t) sum += (sg[t] = exp_approx(sg[t] - m));
    inv[g] = 1.f / sum;
  }
}

// The nk K rows (V rows when value) of request b's cache block holding token j0, KV head kvh,
// as fp32 rows rs floats apart: widened into rows [nk][D], or (fp32 caches) in place. Also
// prefetches the next block's rows.
template <class E, int C>
PAGEDLLM_AVX2_TARGET static inline const float* decode_block_rows(
    const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh, int64_t j0, int64_t L, bool value,
    float* rows, int64_t& rs) {
  using T = typename E::T;
  constexpr int64_t D = 8 * C;
  const int64_t bs = a.block_size, stride = a.kv_stride;
  const int32_t* table = a.block_table + b * a.bt_stride;
  const T* base = a.kv + (value ? a.num_blocks * bs * stride : 0) + kvh * a.kv_head_stride;
  const T* src = base + table[j0 / bs] * bs * stride;
  if (j0 + bs < L) {
    const char* next = reinterpret_cast<const char*>(base + table[j0 / bs + 1] * bs * stride);
    const int64_t n = std::min(bs, L - j0 - bs);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t off = 0; off < D * int64_t(sizeof(T)); off += 64)
        _mm_prefetch(next + t * stride * int64_t(sizeof(T)) + off, _MM_HINT_T0);
  }
  const int64_t nk = std::min(bs, L - j0);
  if constexpr (std::is_same_v<T, float>) {
    rs = stride;
    return src;
  } else {
    for (int64_t t = 0; t < nk; ++t)
      for (int c = 0; c < C; ++c)
        _mm256_storeu_ps(rows + t * D + 8 * c, load8(src + t * stride + 8 * c));
    rs = D;
    return rows;
  }
}

// Head size D = 8 * C (any multiple of 8), G query heads a KV head. The context goes by one
// cache block at a time (one block-table lookup per block, the next block's rows prefetched):
// a block's K rows are widened once into fp32 scratch (fp32 caches are read in place) and
// every query head takes its scores from there, four keys per pass (four accumulators, one
// 4-way horizontal add); after the softmax, the V rows go the same way, each head adding
// p * v into its output. Every K and V row is read from memory once, whatever G.
template <class E, int C>
PAGEDLLM_AVX2_TARGET static void decode_item_avx2(const DecodeAttnArgs<E>& a, int64_t b,
                                                  int64_t kvh, float* scratch) {
  using T = typename E::T;
  constexpr int64_t D = 8 * C;
  const int64_t L = a.seq_lens[b], G = a.num_heads / a.num_kv_heads, bs = a.block_size;
  float* scores = scratch;          // [G][L]
  float* acc = scores + G * L;      // [G][D] outputs, unnormalized until the end
  float* rows = acc + G * D;        // [bs][D] one block's widened K or V rows; then [G] 1 / sums
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < L; j0 += bs) {
    const int64_t nk = std::min(bs, L - j0);
    int64_t rs;
    const float* k = decode_block_rows<E, C>(a, b, kvh, j0, L, false, rows, rs);
    for (int64_t g = 0; g < G; ++g) {
      const T* q = a.q + b * a.q_stride + (kvh * G + g) * D;
      __m256 qr[C];
      for (int c = 0; c < C; ++c) qr[c] = _mm256_mul_ps(load8(q + 8 * c), scale);
      float* sg = scores + g * L + j0;
      int64_t t = 0;
      for (; t + 4 <= nk; t += 4) {
        const float* k0 = k + t * rs;
        __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(k0), qr[0]);
        __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(k0 + rs), qr[0]);
        __m256 s2 = _mm256_mul_ps(_mm256_loadu_ps(k0 + 2 * rs), qr[0]);
        __m256 s3 = _mm256_mul_ps(_mm256_loadu_ps(k0 + 3 * rs), qr[0]);
        for (int c = 1; c < C; ++c) {
          s0 = _mm256_fmadd_ps(_mm256_loadu_ps(k0 + 8 * c), qr[c], s0);
          s1 = _mm256_fmadd_ps(_mm256_loadu_ps(k0 + rs + 8 * c), qr[c], s1);
          s2 = _mm256_fmadd_ps(_mm256_loadu_ps(k0 + 2 * rs + 8 * c), qr[c], s2);
          s3 = _mm256_fmadd_ps(_mm256_loadu_ps(k0 + 3 * rs + 8 * c), qr[c], s3);
        }
        // [s0 s1 s2 s3] lane sums: pairwise adds within 128-bit halves, then the halves.
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
        _mm_storeu_ps(sg + t, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      }
      for (; t < nk; ++t) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(k + t * rs), qr[0]);
        for (int c = 1; c < C; ++c) s = _mm256_fmadd_ps(_mm256_loadu_ps(k + t * rs + 8 * c), qr[c], s);
        sg[t] = hsum8(s);
      }
    }
  }
  float* inv = rows + bs * D;  // [G]
  softmax_rows_avx2(scores, G, L, inv);
  for (int64_t i = 0; i < G * D; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
  for (int64_t j0 = 0; j0 < L; j0 += bs) {
    const int64_t nk = std::min(bs, L - j0);
    int64_t rs;
    const float* v = decode_block_rows<E, C>(a, b, kvh, j0, L, true, rows, rs);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = scores + g * L + j0;
      __m256 o[C];
      for (int c = 0; c < C; ++c) o[c] = _mm256_loadu_ps(acc + g * D + 8 * c);
      for (int64_t t = 0; t < nk; ++t) {
        const __m256 w = _mm256_broadcast_ss(pg + t);
        for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + t * rs + 8 * c), o[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * D + 8 * c, o[c]);
    }
  }
  T* out = a.out + (b * a.num_heads + kvh * G) * D;
  for (int64_t g = 0; g < G; ++g) {
    const __m256 s = _mm256_set1_ps(inv[g]);
    for (int c = 0; c < C; ++c)
      store8(out + g * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + 8 * c), s));
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

// One (request b, KV head kvh) item. scratch: >= G * (seq_len + 2 * D + 1) + (block_size + 1) * D
// floats.
static bool decode_item_bf16_dispatch(const DecodeAttnArgs<Bf16>& a, int64_t b, int64_t kvh,
                                      float* scratch, int64_t next_b, int64_t next_kvh);

// (next_b, next_kvh): the item this thread runs next (next_b < 0: none), whose K / V the
// AVX512-BF16 kernel prefetches.
template <class E>
static void decode_item(const DecodeAttnArgs<E>& a, int64_t b, int64_t kvh, float* scratch,
                        int64_t next_b = -1, int64_t next_kvh = 0) {
  if constexpr (std::is_same_v<E, Bf16>) {
    static const bool bf16 = __builtin_cpu_supports("avx512bf16") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
    if (bf16 && decode_item_bf16_dispatch(a, b, kvh, scratch, next_b, next_kvh)) return;
  }
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

// ---- multi-token queries (prefills, chunked prefills, prefix-cache hits), AVX2 ---------
// (bf16 caches on AMX CPUs take attention_amx.h's kernel instead, head sizes 64 and 128.)
//
// Every query row attends to keys 0 .. its position, read from the paged cache (the step's
// K/V rows are written first). Work item: (request, KV head, up to kPrefillRows query rows),
// i.e. G * rows query vectors. Keys go by in blocks of 16: the block's K rows transposed to
// fp32 [D][16] (8 x 8 register transposes) and its V rows widened to [16][D] once, then for
// each query vector that sees the block: 16 scores (broadcast q[d] times row d of K^T, 4
// vectors at a time), an online softmax update (running max m and sum l, the output rescaled
// when m grows) and O += p V. A query vector's arithmetic depends only on its own position and
// keys: the same in a whole prefill, in chunks, or after a prefix-cache hit, whatever else is
// in the batch.

constexpr int64_t kPrefillRows = 16;
constexpr int64_t kPrefillKeys = 16;

// r[0..8) (8 rows of 8) transposed in place: r[i] lane j <- r[j] lane i.
PAGEDLLM_AVX2_TARGET static inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Floats of scratch one prefill item needs (G query heads per KV head, head size D).
static inline int64_t prefill_scratch(int64_t G, int64_t D) {
  const int64_t nq = kPrefillRows * G + 3;  // + 3 zero vectors: score blocks of 4
  return nq * D * 2 + nq * 2 + D * kPrefillKeys * 2;
}

// One prefill item's state in scratch (prefill_scratch's floats): its query vectors
// (G per row, rows [r0, r1)) scaled, their unnormalized outputs and running max / sum, and
// one key block.
struct PrefillItem {
  int64_t G, ctx, r0, r1, nq;
  float* qf;  // [nq + 3][D] scaled queries (3 zero vectors after)
  float* o;   // [nq + 3][D] unnormalized outputs
  float* ml;  // [nq][2] running max, running sum
  float* kt;  // [D][kPrefillKeys] the key block, transposed
  float* vf;  // [kPrefillKeys][D] the value block
};

// Rows [r0, r0 + kPrefillRows) of request b, KV head kvh (head size D = 8 C): the scratch
// laid out, the queries scaled into qf, outputs and sums zeroed.
template <class E, int C>
PAGEDLLM_AVX2_TARGET static inline __attribute__((always_inline)) PrefillItem prefill_item_start(
    const DecodeAttnArgs<E>& a, const int64_t* qsl, int64_t b, int64_t kvh, int64_t r0,
    float* scratch) {
  constexpr int64_t D = 8 * C;
  PrefillItem it;
  it.G = a.num_heads / a.num_kv_heads;
  const int64_t qlen = qsl[b + 1] - qsl[b];
  it.ctx = a.seq_lens[b] - qlen;
  it.r0 = r0;
  it.r1 = std::min(qlen, r0 + kPrefillRows);
  it.nq = (it.r1 - r0) * it.G;
  it.qf = scratch;
  it.o = it.qf + (it.nq + 3) * D;
  it.ml = it.o + (it.nq + 3) * D;
  it.kt = it.ml + 2 * (it.nq + 3);
  it.vf = it.kt + D * kPrefillKeys;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t i = 0; i < it.nq + 3; ++i) {
    const typename E::T* q =
        a.q + (qsl[b] + r0 + i / it.G) * a.q_stride + (kvh * it.G + i % it.G) * D;
    for (int c = 0; c < C; ++c) {
      const __m256 v = i < it.nq ? _mm256_mul_ps(load8(q + 8 * c), scale) : _mm256_setzero_ps();
      _mm256_storeu_ps(it.qf + i * D + 8 * c, v);
      _mm256_storeu_ps(it.o + i * D + 8 * c, _mm256_setzero_ps());
    }
    if (i < it.nq) it.ml[2 * i] = -INFINITY, it.ml[2 * i + 1] = 0.f;
  }
  return it;
}

// The item's outputs divided by their sums, into out (rows H * D apart).
template <class E, int C>
PAGEDLLM_AVX2_TARGET static inline __attribute__((always_inline)) void prefill_item_finish(
    const DecodeAttnArgs<E>& a, const int64_t* qsl, int64_t b, int64_t kvh, const PrefillItem& it) {
  constexpr int64_t D = 8 * C;
  for (int64_t i = 0; i < it.nq; ++i) {
    typename E::T* out =
        a.out + (qsl[b] + it.r0 + i / it.G) * a.num_heads * D + (kvh * it.G + i % it.G) * D;
    const __m256 inv = _mm256_set1_ps(1.f / it.ml[2 * i + 1]);
    for (int c = 0; c < C; ++c)
      store8(out + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(it.o + i * D + 8 * c), inv));
  }
}

// Keys j0 .. j0 + nk of request b, KV head kvh (head size D = 8 C) in fp32: K transposed into
// kt [D][kPrefillKeys], V into vf [kPrefillKeys][D], zeros past nk.
template <class E, int C>
PAGEDLLM_AVX2_TARGET static inline void prefill_key_block(const DecodeAttnArgs<E>& a, int64_t b,
                                                          int64_t kvh, int64_t j0, int64_t nk,
                                                          float* kt, float* vf) {
  constexpr int64_t D = 8 * C, KB = kPrefillKeys;
  for (int64_t h = 0; h < KB; h += 8) {  // keys j0 + h .. + 8: transpose 8 x 8 tiles
    const typename E::T* k[8];
    for (int64_t j = 0; j < 8; ++j) {
      k[j] = h + j < nk ? a.row(b, kvh, j0 + h + j, false) : nullptr;
      const typename E::T* v = h + j < nk ? a.row(b, kvh, j0 + h + j, true) : nullptr;
      for (int c = 0; c < C; ++c)
        _mm256_storeu_ps(vf + (h + j) * D + 8 * c, v ? load8(v + 8 * c) : _mm256_setzero_ps());
    }
    for (int c = 0; c < C; ++c) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = k[j] ? load8(k[j] + 8 * c) : _mm256_setzero_ps();
      transpose8(r);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kt + (8 * c + d) * KB + h, r[d]);
    }
  }
}

// One item: rows [r0, r0 + kPrefillRows) of request b, KV head kvh; out rows are H * D apart.
template <class E, int C>
PAGEDLLM_AVX2_TARGET static void prefill_item_avx2(const DecodeAttnArgs<E>& a, const int64_t* qsl,
                                                   int64_t b, int64_t kvh, int64_t r0,
                                                   float* scratch) {
  constexpr int64_t D = 8 * C, KB = kPrefillKeys;
  const PrefillItem it = prefill_item_start<E, C>(a, qsl, b, kvh, r0, scratch);
  const int64_t G = it.G, ctx = it.ctx, r1 = it.r1, nq = it.nq;
  float *qf = it.qf, *o = it.o, *ml = it.ml, *kt = it.kt, *vf = it.vf;
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t end = ctx + r1;  // the last row's keys: 0 .. end - 1
  for (int64_t j0 = 0; j0 < end; j0 += KB) {
    const int64_t nk = std::min(KB, end - j0);
    prefill_key_block<E, C>(a, b, kvh, j0, nk, kt, vf);
    // Rows before j0 - ctx see none of this block.
    for (int64_t i = std::max<int64_t>(0, j0 - ctx - r0) * G; i < nq; i += 4) {
      // Eight named accumulators: as an array, GCC keeps them on the stack.
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0,
             d1 = a0;
      const float* q0 = qf + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * KB), k1 = _mm256_loadu_ps(kt + d * KB + 8);
        __m256 qb = _mm256_broadcast_ss(q0 + d);
        a0 = _mm256_fmadd_ps(qb, k0, a0), a1 = _mm256_fmadd_ps(qb, k1, a1);
        qb = _mm256_broadcast_ss(q0 + D + d);
        b0 = _mm256_fmadd_ps(qb, k0, b0), b1 = _mm256_fmadd_ps(qb, k1, b1);
        qb = _mm256_broadcast_ss(q0 + 2 * D + d);
        c0 = _mm256_fmadd_ps(qb, k0, c0), c1 = _mm256_fmadd_ps(qb, k1, c1);
        qb = _mm256_broadcast_ss(q0 + 3 * D + d);
        d0 = _mm256_fmadd_ps(qb, k0, d0), d1 = _mm256_fmadd_ps(qb, k1, d1);
      }
      const __m256 s[4][2] = {{a0, a1}, {b0, b1}, {c0, c1}, {d0, d1}};
      for (int u = 0; u < 4 && i + u < nq; ++u) {
        const int64_t qi = i + u, pos = ctx + r0 + qi / G;
        const __m256i seen = _mm256_set1_epi32(static_cast<int32_t>(pos - j0 + 1));
        const __m256 v0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, iota));
        const __m256 v1 = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(seen, _mm256_add_epi32(iota, _mm256_set1_epi32(8))));
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        const __m256 sc0 = _mm256_blendv_ps(ninf, s[u][0], v0);
        const __m256 sc1 = _mm256_blendv_ps(ninf, s[u][1], v1);
        float* oq = o + qi * D;
        float& m = ml[2 * qi];
        const float mb = hmax8(_mm256_max_ps(sc0, sc1));
        if (mb > m) {
          const float corr = exp_approx(m - mb);
          m = mb;
          ml[2 * qi + 1] *= corr;
          const __m256 cv = _mm256_set1_ps(corr);
          for (int c = 0; c < C; ++c)
            _mm256_storeu_ps(oq + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(oq + 8 * c), cv));
        }
        const __m256 mv = _mm256_set1_ps(m);
        const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(sc0, mv)), v0);
        const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(sc1, mv)), v1);
        ml[2 * qi + 1] += hsum8(_mm256_add_ps(p0, p1));
        alignas(32) float pj[KB];
        _mm256_store_ps(pj, p0);
        _mm256_store_ps(pj + 8, p1);
        const int64_t last = std::min(nk, pos - j0 + 1);  // keys this row sees
        __m256 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm256_loadu_ps(oq + 8 * c);
        for (int64_t j = 0; j < last; ++j) {
          const __m256 w = _mm256_set1_ps(pj[j]);
          for (int c = 0; c < C; ++c)
            acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vf + j * D + 8 * c), acc[c]);
        }
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(oq + 8 * c, acc[c]);
      }
    }
  }
  prefill_item_finish<E, C>(a, qsl, b, kvh, it);
}

// ---- the same on AVX-512 (head sizes that are multiples of 16) ----------------------------
// A key block's 16 scores are one vector, and a row's softmax step and P V take half the
// instructions. A query vector's arithmetic is still its own (the same in any batch or chunk);
// its sums differ from the AVX2 kernel's only in the order of each row's 16-term sum of p.

// prefill_item_avx2 for head size D = 16 C.
template <class E, int C>
PAGEDLLM_AVX512_TARGET static void prefill_item_avx512(const DecodeAttnArgs<E>& a,
                                                       const int64_t* qsl, int64_t b,
                                                       int64_t kvh, int64_t r0, float* scratch) {
  static_assert(kPrefillKeys == 16, "a key block is one 16-lane vector");
  constexpr int64_t D = 16 * C, KB = kPrefillKeys;
  const PrefillItem it = prefill_item_start<E, 2 * C>(a, qsl, b, kvh, r0, scratch);
  const int64_t G = it.G, ctx = it.ctx, r1 = it.r1, nq = it.nq;
  float *qf = it.qf, *o = it.o, *ml = it.ml, *kt = it.kt, *vf = it.vf;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const int64_t end = ctx + r1;  // the last row's keys: 0 .. end - 1
  for (int64_t j0 = 0; j0 < end; j0 += KB) {
    const int64_t nk = std::min(KB, end - j0);
    prefill_key_block<E, 2 * C>(a, b, kvh, j0, nk, kt, vf);
    // Rows before j0 - ctx see none of this block.
    for (int64_t i = std::max<int64_t>(0, j0 - ctx - r0) * G; i < nq; i += 4) {
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      const float* q0 = qf + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 k = _mm512_loadu_ps(kt + d * KB);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), k, s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[D + d]), k, s1);
        s2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * D + d]), k, s2);
        s3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * D + d]), k, s3);
      }
      const __m512 s[4] = {s0, s1, s2, s3};
      // The softmax step of each of the 4 query vectors (rows past nq: weights 0), then P V
      // for the 4 together, each V vector loaded once for all of them. A key a vector does
      // not see has weight 0 and adds exactly nothing.
      alignas(64) float pj[4][KB];
      int64_t last = 0;  // keys any of the 4 sees
      for (int u = 0; u < 4; ++u) {
        const int64_t qi = i + u, pos = ctx + r0 + qi / G;
        if (qi >= nq) {
          _mm512_store_ps(pj[u], _mm512_setzero_ps());
          continue;
        }
        const __mmask16 seen = _mm512_cmpgt_epi32_mask(
            _mm512_set1_epi32(static_cast<int32_t>(pos - j0 + 1)), iota);
        const __m512 sc = _mm512_mask_blend_ps(seen, ninf, s[u]);
        float* oq = o + qi * D;
        float& m = ml[2 * qi];
        const float mb = _mm512_reduce_max_ps(sc);
        if (mb > m) {
          const float corr = exp_approx(m - mb);
          m = mb;
          ml[2 * qi + 1] *= corr;
          const __m512 cv = _mm512_set1_ps(corr);
          for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(oq + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(oq + 16 * c), cv));
        }
        const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
        ml[2 * qi + 1] += _mm512_reduce_add_ps(p);
        _mm512_store_ps(pj[u], p);
        last = std::max(last, std::min(nk, pos - j0 + 1));
      }
      __m512 acc[4][C];
      for (int u = 0; u < 4; ++u)
        for (int c = 0; c < C; ++c) acc[u][c] = _mm512_loadu_ps(o + (i + u) * D + 16 * c);
      for (int64_t j = 0; j < last; ++j) {
        const __m512 w0 = _mm512_set1_ps(pj[0][j]), w1 = _mm512_set1_ps(pj[1][j]);
        const __m512 w2 = _mm512_set1_ps(pj[2][j]), w3 = _mm512_set1_ps(pj[3][j]);
        for (int c = 0; c < C; ++c) {
          const __m512 v = _mm512_loadu_ps(vf + j * D + 16 * c);
          acc[0][c] = _mm512_fmadd_ps(w0, v, acc[0][c]);
          acc[1][c] = _mm512_fmadd_ps(w1, v, acc[1][c]);
          acc[2][c] = _mm512_fmadd_ps(w2, v, acc[2][c]);
          acc[3][c] = _mm512_fmadd_ps(w3, v, acc[3][c]);
        }
      }
      for (int u = 0; u < 4; ++u)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + (i + u) * D + 16 * c, acc[u][c]);
    }
  }
  prefill_item_finish<E, 2 * C>(a, qsl, b, kvh, it);
}

// Whether prefill_item runs head size D (the Python side asks before choosing it).
static inline bool prefill_head_size_ok(int64_t D) {
  return D == 32 || D == 64 || D == 80 || D == 96 || D == 128;
}

template <class E>
static void prefill_item(const DecodeAttnArgs<E>& a, const int64_t* qsl, int64_t b, int64_t kvh,
                         int64_t r0, float* scratch) {
  if (cpu_has_avx512()) switch (a.head_size) {
      case 32: return prefill_item_avx512<E, 2>(a, qsl, b, kvh, r0, scratch);
      case 64: return prefill_item_avx512<E, 4>(a, qsl, b, kvh, r0, scratch);
      case 128: return prefill_item_avx512<E, 8>(a, qsl, b, kvh, r0, scratch);
    }
  switch (a.head_size) {
    case 32: return prefill_item_avx2<E, 4>(a, qsl, b, kvh, r0, scratch);
    case 64: return prefill_item_avx2<E, 8>(a, qsl, b, kvh, r0, scratch);
    case 80: return prefill_item_avx2<E, 10>(a, qsl, b, kvh, r0, scratch);
    case 96: return prefill_item_avx2<E, 12>(a, qsl, b, kvh, r0, scratch);
    default: return prefill_item_avx2<E, 16>(a, qsl, b, kvh, r0, scratch);
  }
}

// ---- decode on AVX512-BF16 (bf16 caches, head sizes that are multiples of 32) ------------
// The same three passes as decode_item_avx2, a chunk of up to 16 tokens (within one cache
// block) at a time, with no widened copies of K or V:
// - scores: q . k with vdpbf16ps on the bf16 rows as stored (bf16 x bf16 products are exact
//   in fp32; the scale is applied to the sum). The chunk's rows are half transposed (two
//   unpack steps: each 128-bit lane then holds one column of four rows) and multiplied by
//   the query's columns spread the same way; a 4 x 4 lane reduction per query head at the
//   end of the chunk gives its 16 scores in one vector.
// - softmax on 16 lanes; the weights rounded to bf16 (softmax_row_bf16, as the prefill tile
//   kernels' rows), the sum taken over the rounded weights.
// - P V with vdpbf16ps on token pairs: two V rows interleaved by two unpacks (each 32-bit
//   lane then holds one column of both rows) against the pair's two weights, half the
//   multiply instructions of widening V to fp32. The unpacks permute the columns within
//   128-bit lanes; the accumulators keep that order and are put back in place once, at the
//   store.
// Registers hold the output of up to 16 / (D / 16) query heads at a time.

// One chunk's K or V rows: n valid rows from src (stride elements apart); rows past n repeat
// the last valid one (their lanes are computed and never stored).
struct DecodeChunk {
  const uint16_t* src;
  int64_t stride, n;
  inline const uint16_t* row(int64_t t) const { return src + std::min(t, n - 1) * stride; }
};

// The chunks of one request's context (KV head kvh, keys or values) in order: a chunk is up to
// 16 tokens within one cache block. next() requests the rows of the kLookahead tokens after
// the chunk it returns into L2, from the first chunk on (a thread's first item, which nobody
// prefetched, starts its stream at once). Each block lies anywhere in the cache, so the
// hardware prefetchers do not run ahead across them: with one chunk of lookahead into L1 a
// batch-1 layer's attention (context 192, blocks scattered, the cache flushed between layers
// as a step's weights flush it) took 32-37 us on Zen 4, with 64 tokens into L2 25-28 us
// (context 1,024: 1.15-1.24x; 64 requests: 1.1x; 128 tokens: no better; BENCHMARKS.md).
struct DecodeChunks {
  static constexpr int64_t kLookahead = 64;
  const uint16_t* base;
  const int32_t* table;
  int64_t bs, stride, L, row_bytes;
  int64_t requested = 0;  // the first token whose rows were not requested yet

  DecodeChunks(const DecodeAttnArgs<Bf16>& a, int64_t b, int64_t kvh, bool value)
      : base(a.kv + (value ? a.num_blocks * a.block_size * a.kv_stride : 0) +
             kvh * a.kv_head_stride),
        table(a.block_table + b * a.bt_stride), bs(a.block_size),
        stride(a.kv_stride), L(a.seq_lens[b]),
        row_bytes(a.head_size * 2) {}

  inline DecodeChunk at(int64_t j) const {
    const int64_t off = j % bs;
    return {base + (table[j / bs] * bs + off) * stride, stride,
            std::min({int64_t(16), bs - off, L - j})};
  }
  // Requests the rows of tokens [requested, end) (a whole chunk at a time) with `hint`.
  template <int hint>
  inline void request(int64_t end) {
    const int64_t stop = std::min(end, L);
    while (requested < stop) {
      const DecodeChunk ch = at(requested);
      for (int64_t t = 0; t < ch.n; ++t)
        for (int64_t off = 0; off < row_bytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ch.src + t * stride) + off,
                       static_cast<_mm_hint>(hint));
      requested += ch.n;
    }
  }
  // The chunk starting at token j (j < L; the previous call's chunk ended there).
  inline DecodeChunk next(int64_t j) {
    const DecodeChunk cur = at(j);
    request<_MM_HINT_T1>(j + cur.n + kLookahead);
    return cur;
  }
};

// The thread's next item's K and V rows, requested into L2 a chunk at a time while this item
// runs: its K during this item's K pass, its V during the V pass, so that the next item finds
// its first rows there too (64 requests x 192 tokens: 30 layers' attention in 22-24 ms from
// memory, 11-15 ms with one layer's cache in L2 / L3; with this prefetch 1.11x faster from
// memory, alternated; into L1 instead, slower).
struct DecodeNext {
  DecodeChunks k, v;

  // Item (b, kvh), or none when b < 0.
  DecodeNext(const DecodeAttnArgs<Bf16>& a, int64_t b, int64_t kvh)
      : k(a, std::max<int64_t>(b, 0), kvh, false), v(a, std::max<int64_t>(b, 0), kvh, true) {
    if (b < 0) k.L = v.L = 0;
  }
  // Its next 32 tokens' K or V rows, whole chunks (the next item may be longer than this one).
  inline void step(bool value) {
    DecodeChunks& c = value ? v : k;
    c.request<_MM_HINT_T1>(c.requested + 32);
  }
};

// scores[g][0..n) for NG query heads of one chunk. qp: per head g, column block h (32 bf16
// of D), m = 0..3: the query's bf16 pairs 4l + m of that block spread over lane l.
template <int C2, int NG>
PAGEDLLM_BF16_TARGET static inline void decode_chunk_scores(const DecodeChunk& k,
                                                             const float* qp, float* scores,
                                                             int64_t L, float scale) {
  __m512 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int h = 0; h < C2; ++h)
    for (int i = 0; i < 4; ++i) {
      const __m512i r0 = _mm512_loadu_si512(k.row(4 * i) + 32 * h);
      const __m512i r1 = _mm512_loadu_si512(k.row(4 * i + 1) + 32 * h);
      const __m512i r2 = _mm512_loadu_si512(k.row(4 * i + 2) + 32 * h);
      const __m512i r3 = _mm512_loadu_si512(k.row(4 * i + 3) + 32 * h);
      const __m512i t0 = _mm512_unpacklo_epi32(r0, r1), t1 = _mm512_unpackhi_epi32(r0, r1);
      const __m512i t2 = _mm512_unpacklo_epi32(r2, r3), t3 = _mm512_unpackhi_epi32(r2, r3);
      // u[m], lane l: pair column 4 l + m of rows 4 i .. 4 i + 3.
      const __m512i u[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                            _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
      for (int g = 0; g < NG; ++g)
        for (int m = 0; m < 4; ++m)
          acc[g][i] = _mm512_dpbf16_ps(
              acc[g][i], (__m512bh)u[m],
              (__m512bh)_mm512_loadu_si512(qp + ((g * C2 + h) * 4 + m) * 16));
    }
  const __mmask16 keep = static_cast<__mmask16>((1u << k.n) - 1);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < NG; ++g) {
    // acc[g][i] lane (l, j): row 4 i + j, summed over columns 4 l .. 4 l + 3; sum over l.
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[g][0], acc[g][1], 0x44),
                                     _mm512_shuffle_f32x4(acc[g][0], acc[g][1], 0xEE));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[g][2], acc[g][3], 0x44),
                                     _mm512_shuffle_f32x4(acc[g][2], acc[g][3], 0xEE));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                                   _mm512_shuffle_f32x4(z01, z23, 0xDD));
    _mm512_mask_storeu_ps(scores + g * L, keep, _mm512_mul_ps(s, sc));
  }
}

// 32 columns of fp32 accumulators kept in unpack order (lo = unpacklo_epi16 of a 32-bf16 row
// slice, lane l columns 8 l .. 8 l + 3; hi = unpackhi_epi16, 8 l + 4 .. 8 l + 7), times inv,
// stored as bf16 in natural order at dst[0..32).
PAGEDLLM_BF16_TARGET static inline void store_unpacked_bf16(uint16_t* dst, __m512 lo, __m512 hi,
                                                             __m512 inv) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  lo = _mm512_mul_ps(lo, inv);
  hi = _mm512_mul_ps(hi, inv);
  store16(dst, _mm512_permutex2var_ps(lo, first, hi));
  store16(dst + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// out[g] = sum_t p[g][t] v_t * inv[g] for NG query heads (p: the bf16 softmax numerators,
// [g][L]; inv: 1 / their sums). Tokens go in pairs within a chunk; a chunk's odd last token
// pairs with a zero weight (and its own row again).
template <int C2, int NG>
PAGEDLLM_BF16_TARGET static inline void decode_values_bf16(DecodeChunks chunks, const uint16_t* p,
                                                           int64_t L, const float* inv,
                                                           uint16_t* out, DecodeNext& next) {
  constexpr int64_t D = 32 * C2;
  __m512 o[NG][2 * C2];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 2 * C2; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L;) {
    const DecodeChunk v = chunks.next(j);
    next.step(true);
    for (int64_t t = 0; t < v.n; t += 2) {
      const bool pair = t + 1 < v.n;
      __m512bh w[NG];
      for (int g = 0; g < NG; ++g) {
        const uint16_t* pg = p + g * L + j + t;
        uint32_t word = pg[0];
        if (pair) std::memcpy(&word, pg, sizeof(word));
        w[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      }
      const uint16_t* r0 = v.src + t * v.stride;
      const uint16_t* r1 = pair ? r0 + v.stride : r0;
      for (int h = 0; h < C2; ++h) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * h), x1 = _mm512_loadu_si512(r1 + 32 * h);
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        for (int g = 0; g < NG; ++g) {
          o[g][2 * h] = _mm512_dpbf16_ps(o[g][2 * h], lo, w[g]);
          o[g][2 * h + 1] = _mm512_dpbf16_ps(o[g][2 * h + 1], hi, w[g]);
        }
      }
    }
    j += v.n;
  }
  for (int g = 0; g < NG; ++g)
    for (int h = 0; h < C2; ++h)
      store_unpacked_bf16(out + g * D + 32 * h, o[g][2 * h], o[g][2 * h + 1],
                          _mm512_set1_ps(inv[g]));
}

// Softmax numerators of one row's n fp32 scores times `scale`, on 16 lanes, rounded to bf16
// into p[0..n); returns 1 / the sum of the rounded numerators (n > 0). The rows of the decode
// kernel below and of the prefill tile kernels (attention_tiles.h).
PAGEDLLM_BF16_TARGET static inline float softmax_row_bf16(const float* s, int64_t n, float scale,
                                                          uint16_t* p) {
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  __m512 mv = ninf;
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - k)) - 1);
    mv = _mm512_max_ps(mv, _mm512_mask_mul_ps(ninf, in, _mm512_maskz_loadu_ps(in, s + k), sc));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - k)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        in, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + k), sc), m)));
    const __m256bh eb = _mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(p + k, in, (__m256i)eb);
    sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

template <int C2>
PAGEDLLM_BF16_TARGET static void decode_item_bf16(const DecodeAttnArgs<Bf16>& a, int64_t b,
                                                  int64_t kvh, float* scratch,
                                                  DecodeNext& next) {
  constexpr int64_t D = 32 * C2;
  constexpr int kScoreHeads = 4, kValueHeads = C2 >= 8 ? 1 : (C2 >= 3 ? 2 : 4);
  const int64_t L = a.seq_lens[b], G = a.num_heads / a.num_kv_heads;
  float* scores = scratch;       // [G][L]
  float* qp = scores + G * L;    // [G][C2][4][16]
  float* inv = qp + G * D * 2;   // [G]
  uint16_t* p16 = reinterpret_cast<uint16_t*>(inv + G);  // [G][L], the bf16 weights
  const uint16_t* q = a.q + b * a.q_stride + kvh * G * D;
  for (int64_t g = 0; g < G; ++g)
    for (int h = 0; h < C2; ++h) {
      const __m512i qh = _mm512_loadu_si512(q + g * D + 32 * h);
      for (int m = 0; m < 4; ++m) {
        const __m512i idx = _mm512_setr_epi32(m, m, m, m, 4 + m, 4 + m, 4 + m, 4 + m, 8 + m, 8 + m,
                                              8 + m, 8 + m, 12 + m, 12 + m, 12 + m, 12 + m);
        _mm512_storeu_si512(qp + ((g * C2 + h) * 4 + m) * 16, _mm512_permutexvar_epi32(idx, qh));
      }
    }
  for (int64_t g0 = 0; g0 < G; g0 += kScoreHeads) {
    const int64_t ng = std::min<int64_t>(kScoreHeads, G - g0);
    const float* qg = qp + g0 * D * 2;
    float* sg = scores + g0 * L;
    DecodeChunks chunks(a, b, kvh, false);
    for (int64_t j = 0; j < L;) {
      const DecodeChunk k = chunks.next(j);
      if (g0 == 0) next.step(false);
      switch (ng) {
        case 1: decode_chunk_scores<C2, 1>(k, qg, sg + j, L, a.scale); break;
        case 2: decode_chunk_scores<C2, 2>(k, qg, sg + j, L, a.scale); break;
        case 3: decode_chunk_scores<C2, 3>(k, qg, sg + j, L, a.scale); break;
        default: decode_chunk_scores<C2, 4>(k, qg, sg + j, L, a.scale); break;
      }
      j += k.n;
    }
  }
  for (int64_t g = 0; g < G; ++g)  // the scores are scaled already
    inv[g] = softmax_row_bf16(scores + g * L, L, 1.f, p16 + g * L);
  uint16_t* out = a.out + (b * a.num_heads + kvh * G) * D;
  const DecodeChunks values(a, b, kvh, true);
  for (int64_t g0 = 0; g0 < G; g0 += kValueHeads) {
    const uint16_t* p = p16 + g0 * L;
    uint16_t* o = out + g0 * D;
    // (No group is larger than kValueHeads: the cases above it are never taken.)
    switch (std::min<int64_t>(kValueHeads, G - g0)) {
      case 1: decode_values_bf16<C2, 1>(values, p, L, inv + g0, o, next); break;
      case 2: decode_values_bf16<C2, std::min(2, kValueHeads)>(values, p, L, inv + g0, o, next); break;
      case 3: decode_values_bf16<C2, std::min(3, kValueHeads)>(values, p, L, inv + g0, o, next); break;
      default: decode_values_bf16<C2, kValueHeads>(values, p, L, inv + g0, o, next); break;
    }
  }
}

static bool decode_item_bf16_dispatch(const DecodeAttnArgs<Bf16>& a, int64_t b, int64_t kvh,
                                      float* scratch, int64_t next_b, int64_t next_kvh) {
  DecodeNext next(a, next_b, next_kvh);
  switch (a.head_size) {
    case 32: decode_item_bf16<1>(a, b, kvh, scratch, next); return true;
    case 64: decode_item_bf16<2>(a, b, kvh, scratch, next); return true;
    case 96: decode_item_bf16<3>(a, b, kvh, scratch, next); return true;
    case 128: decode_item_bf16<4>(a, b, kvh, scratch, next); return true;
    case 256: decode_item_bf16<8>(a, b, kvh, scratch, next); return true;
    default: return false;
  }
}

}  // namespace pagedllm
