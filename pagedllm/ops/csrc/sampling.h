// The sampler's random draw in one native call over the rows of logits (ops.cpp's
// sample_rows): the same draw as sample/ops.py's two-level inverse CDF (a row's weights
// exp((l - max) / T); a uniform u times their total picks a chunk of kSampleChunk tokens by the
// running sum of the chunk sums, then a token inside it by the running sum of its weights),
// without the five whole-row tensor passes the PyTorch ops make (temperature, max, subtract,
// exp, chunk sums: each reading and most writing the [B, V] fp32 logits, 12.6 MB at 64 rows of
// a 49k vocabulary). Here a row is read twice (its max, then its chunk sums) and never
// written; the picked chunk's 256 weights are computed again. A row's draw depends on its
// logits, temperature and u alone (rows run one per thread, in a fixed order).
//
// Weights whose exponent is below -87.3 (exp16's clamp; -inf logits, i.e. masked tokens,
// among them) are exactly 0, so a masked token is never drawn; anything that small is below
// an fp32 ulp of the row's total, which is at least 1 (the maximum's own weight).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "common.h"

namespace pagedllm {

constexpr int64_t kSampleChunk = 256;  // sample/ops.py's _CHUNK
constexpr float kSampleExpFloor = -87.3f;

// Per ISA (V = 16 lanes AVX-512, 8 lanes AVX2): a greedy row's argmax, a row's maximum, each
// chunk's weight sum, and one chunk's weights.
#define PAGEDLLM_SAMPLE_OPS(NAME, TARGET, VEC, W, SET1, LOAD, MAXF, SUBF, MULF, ADDF, EXPF,       \
                            ZERO_BELOW, TAIL_LOAD, REDUCE_MAX, REDUCE_ADD, STORE, NAN_BITS,      \
                            EQ_BITS, KEEP_ABOVE, KEEP_AT_LEAST)                                  \
  struct NAME {                                                                                  \
    /* Greedy rows: the first index of the row's maximum, a NaN above every number (as        \
       torch.argmax): the maximum and whether a NaN occurs in one pass, then a scan for the    \
       first lane equal to it (or the first NaN). */                                           \
    TARGET static int64_t argmax(const float* x, int64_t n) {                                   \
      VEC m = SET1(-INFINITY);                                                                   \
      int nan = 0;                                                                               \
      int64_t i = 0;                                                                             \
      for (; i + W <= n; i += W) {                                                               \
        const VEC v = LOAD(x + i);                                                               \
        nan |= NAN_BITS(v);                                                                      \
        m = MAXF(m, v);                                                                          \
      }                                                                                          \
      float best = REDUCE_MAX(m);                                                                \
      for (int64_t j = i; j < n; ++j) {                                                          \
        nan |= std::isnan(x[j]);                                                                 \
        best = x[j] > best ? x[j] : best;                                                        \
      }                                                                                          \
      if (nan)                                                                                   \
        for (int64_t j = 0; j < n; ++j)                                                          \
          if (std::isnan(x[j])) return j;                                                        \
      const VEC bv = SET1(best);                                                                 \
      for (i = 0; i + W <= n; i += W)                                                            \
        if (const int k = EQ_BITS(LOAD(x + i), bv)) return i + __builtin_ctz(k);                 \
      for (; i < n; ++i)                                                                         \
        if (x[i] == best) return i;                                                              \
      return 0;                                                                                  \
    }                                                                                            \
    TARGET static float row_max(const float* x, int64_t n) {                                    \
      VEC m = SET1(-INFINITY);                                                                   \
      int64_t i = 0;                                                                             \
      for (; i + W <= n; i += W) m = MAXF(m, LOAD(x + i));                                       \
      float r = REDUCE_MAX(m);                                                                   \
      for (; i < n; ++i) r = std::max(r, x[i]);                                                  \
      return r;                                                                                  \
    }                                                                                            \
    /* exp((x - m) * inv_t) of lanes [i, i + W), 0 past n or below the floor */                  \
    TARGET static inline VEC weights(const float* x, int64_t i, int64_t n, VEC m, VEC inv_t) {   \
      const VEC z = MULF(SUBF(TAIL_LOAD(x, i, n), m), inv_t);                                    \
      return ZERO_BELOW(EXPF(z), z);                                                             \
    }                                                                                            \
    TARGET static void chunk_sums(const float* x, int64_t n, float m, float inv_t, float* sums) { \
      const VEC mv = SET1(m), tv = SET1(inv_t);                                                  \
      for (int64_t c0 = 0, c = 0; c0 < n; c0 += kSampleChunk, ++c) {                             \
        const int64_t end = std::min(n, c0 + kSampleChunk);                                      \
        VEC acc = SET1(0.f);                                                                     \
        for (int64_t i = c0; i < end; i += W) acc = ADDF(acc, weights(x, i, end, mv, tv));      \
        sums[c] = REDUCE_ADD(acc);                                                               \
      }                                                                                          \
    }                                                                                            \
    TARGET static void chunk_weights(const float* x, int64_t c0, int64_t end, float m,           \
                                     float inv_t, float* w) {                                    \
      const VEC mv = SET1(m), tv = SET1(inv_t);                                                  \
      for (int64_t i = c0; i < end; i += W) STORE(w + (i - c0), weights(x, i, end, mv, tv));    \
    }                                                                                            \
    /* Truncated draws: every weight of the row into w (padded to whole vectors with zeros),  \
       0 where the logit is below `floor` (top-k) or the exponent below `log_min_p` (min-p),   \
       each chunk's sum as chunk_sums takes it into sums, and (bound >= 0) each chunk's sum of  \
       the weights above bound into above. */                                                  \
    TARGET static void row_weights(const float* x, int64_t n, float m, float inv_t, float floor, \
                                   float log_min_p, float bound, float* w, float* sums,          \
                                   float* above) {                                               \
      const VEC mv = SET1(m), tv = SET1(inv_t), bv = SET1(bound), fv = SET1(floor),              \
                lv = SET1(log_min_p);                                                            \
      for (int64_t c0 = 0, c = 0; c0 < n; c0 += kSampleChunk, ++c) {                             \
        const int64_t end = std::min(n, c0 + kSampleChunk);                                      \
        VEC acc = SET1(0.f), kept = SET1(0.f);                                                   \
        for (int64_t i = c0; i < end; i += W) {                                                  \
          const VEC xv = TAIL_LOAD(x, i, end), z = MULF(SUBF(xv, mv), tv);                       \
          const VEC v = KEEP_AT_LEAST(KEEP_AT_LEAST(ZERO_BELOW(EXPF(z), z), xv, fv), z, lv);     \
          STORE(w + i, v);                                                                       \
          acc = ADDF(acc, v);                                                                    \
          if (bound >= 0.f) kept = ADDF(kept, KEEP_ABOVE(v, bv));                                \
        }                                                                                        \
        sums[c] = REDUCE_ADD(acc);                                                               \
        if (bound >= 0.f) above[c] = REDUCE_ADD(kept);                                           \
      }                                                                                          \
    }                                                                                            \
    /* The sum of row_weights' w[0..n) above v (whole vectors: its zeros past n). */          \
    TARGET static float mass_above(const float* w, int64_t n, float v) {                        \
      const VEC bv = SET1(v);                                                                    \
      VEC acc = SET1(0.f);                                                                       \
      for (int64_t i = 0; i < n; i += W) acc = ADDF(acc, KEEP_ABOVE(LOAD(w + i), bv));           \
      return REDUCE_ADD(acc);                                                                    \
    }                                                                                            \
  };

// ---- AVX-512 ----
PAGEDLLM_AVX512_TARGET static inline __mmask16 sample_tail16(int64_t i, int64_t n) {
  return n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}
PAGEDLLM_AVX512_TARGET static inline __m512 sample_load16(const float* x, int64_t i, int64_t n) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), sample_tail16(i, n), x + i);
}
// exp(z) for z <= 0 to 1.4e-6 relative (z >= -20: 5e-7; every 1e-6 step of [-87.3, 0] checked
// against double exp), in 10 instructions to exp16's 18:
// 2^(z log2 e) as 2^n (vscalefps) times a degree-6 Taylor polynomial of 2^f, |f| <= 1/2, with
// f = z log2 e - n in one rounding (an FMA). Below the floor the caller zeroes the lanes.
PAGEDLLM_AVX512_TARGET static inline __m512 sample_exp16(__m512 z) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, log2e), _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_fmsub_ps(z, log2e, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
PAGEDLLM_AVX512_TARGET static inline __m512 sample_zero_below16(__m512 e, __m512 z) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z, _mm512_set1_ps(kSampleExpFloor), _CMP_GE_OQ), e);
}
PAGEDLLM_AVX512_TARGET static inline int sample_nan_bits16(__m512 v) {
  return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
}
PAGEDLLM_AVX512_TARGET static inline int sample_eq_bits16(__m512 a, __m512 b) {
  return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ);
}
PAGEDLLM_AVX512_TARGET static inline __m512 sample_keep_above16(__m512 w, __m512 v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, v, _CMP_GT_OQ), w);
}
PAGEDLLM_AVX512_TARGET static inline __m512 sample_keep_at_least16(__m512 w, __m512 a, __m512 b) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), w);
}
PAGEDLLM_SAMPLE_OPS(SampleAvx512, PAGEDLLM_AVX512_TARGET, __m512, 16, _mm512_set1_ps,
                    _mm512_loadu_ps, _mm512_max_ps, _mm512_sub_ps, _mm512_mul_ps, _mm512_add_ps,
                    sample_exp16, sample_zero_below16, sample_load16, _mm512_reduce_max_ps,
                    _mm512_reduce_add_ps, _mm512_storeu_ps, sample_nan_bits16, sample_eq_bits16,
                    sample_keep_above16, sample_keep_at_least16)

// ---- AVX2 ----
PAGEDLLM_AVX2_TARGET static inline __m256 sample_load8(const float* x, int64_t i, int64_t n) {
  if (n - i >= 8) return _mm256_loadu_ps(x + i);
  alignas(32) float tmp[8];
  for (int k = 0; k < 8; ++k) tmp[k] = i + k < n ? x[i + k] : -INFINITY;
  return _mm256_load_ps(tmp);
}
PAGEDLLM_AVX2_TARGET static inline __m256 sample_zero_below8(__m256 e, __m256 z) {
  return _mm256_and_ps(e, _mm256_cmp_ps(z, _mm256_set1_ps(kSampleExpFloor), _CMP_GE_OQ));
}
PAGEDLLM_AVX2_TARGET static inline int sample_nan_bits8(__m256 v) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
PAGEDLLM_AVX2_TARGET static inline int sample_eq_bits8(__m256 a, __m256 b) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
}
PAGEDLLM_AVX2_TARGET static inline __m256 sample_keep_above8(__m256 w, __m256 v) {
  return _mm256_and_ps(w, _mm256_cmp_ps(w, v, _CMP_GT_OQ));
}
PAGEDLLM_AVX2_TARGET static inline __m256 sample_keep_at_least8(__m256 w, __m256 a, __m256 b) {
  return _mm256_and_ps(w, _mm256_cmp_ps(a, b, _CMP_GE_OQ));
}
PAGEDLLM_SAMPLE_OPS(SampleAvx2, PAGEDLLM_AVX2_TARGET, __m256, 8, _mm256_set1_ps, _mm256_loadu_ps,
                    _mm256_max_ps, _mm256_sub_ps, _mm256_mul_ps, _mm256_add_ps, exp8,
                    sample_zero_below8, sample_load8, hmax8, hsum8,
                    _mm256_storeu_ps, sample_nan_bits8, sample_eq_bits8, sample_keep_above8,
                    sample_keep_at_least8)
#undef PAGEDLLM_SAMPLE_OPS

// The chunk whose interval of the running sum of sums[0..chunks) holds u times their total,
// capped at the last chunk with weight (rounding can leave u * total at or past the end; a
// chunk without weight is never picked), or -1 when none has any; *rest: u * total less the
// chunks before it.
static inline int64_t pick_chunk(const float* sums, int64_t chunks, float u, float* rest) {
  float total = 0.f;
  int64_t last = -1;
  for (int64_t c = 0; c < chunks; ++c) {
    total += sums[c];
    if (sums[c] > 0.f) last = c;
  }
  if (last < 0) return -1;
  const float target = u * total;
  float before = 0.f;
  int64_t c = 0;
  for (; c < last && !(before + sums[c] > target); ++c) before += sums[c];
  *rest = target - before;
  return c;
}

// The same inside a chunk: the index of w[0..len) whose interval of the running sum holds rest,
// capped at the last one with weight (0 when none has any).
static inline int64_t pick_in_chunk(const float* w, int64_t len, float rest) {
  int64_t last_w = 0;
  for (int64_t i = 0; i < len; ++i)
    if (w[i] > 0.f) last_w = i;
  float run = 0.f;
  for (int64_t i = 0; i < last_w; ++i) {
    run += w[i];
    if (run > rest) return i;
  }
  return last_w;
}

// One row's draw: the token whose interval of the running weight sum holds u * total (u in
// [0, 1)), by chunk, then inside the chunk (pick_chunk, pick_in_chunk). sums:
// ceil(n / kSampleChunk) floats of scratch, w: kSampleChunk. A row with no weight at all
// (every logit -inf) draws token 0.
template <class Ops>
static int64_t sample_row(const float* x, int64_t n, float temperature, float u, float* sums,
                          float* w) {
  const float m = Ops::row_max(x, n), inv_t = 1.f / temperature;
  Ops::chunk_sums(x, n, m, inv_t, sums);
  float rest;
  const int64_t c = pick_chunk(sums, (n + kSampleChunk - 1) / kSampleChunk, u, &rest);
  if (c < 0) return 0;
  const int64_t c0 = c * kSampleChunk, end = std::min(n, c0 + kSampleChunk);
  Ops::chunk_weights(x, c0, end, m, inv_t, w);
  return c0 + pick_in_chunk(w, end - c0, rest);
}

// One round of the top-p draw of sample/ops.py's random_sample_top_p on one row, its weights
// those of sample_row but 0 below the top-k floor (a logit) and the min-p floor (an exponent,
// log min_p), as the PyTorch ops mask them: the support is the tokens whose weight is above
// `bound` (bound < 0: all of them; a rejected round's drawn weight, for the next round), the
// token drawn from it by u * its total as sample_row draws, and accepted when the mass of the
// row's tokens strictly more probable than it is below p times the row's total of kept weights
// (p >= 1: always, the only round of a draw with top-k or min-p alone). Returns the token;
// *next_bound becomes -1 when it is accepted, else its weight, whose strictly greater weights
// hold the whole nucleus (the next round's support). w: the row's weights,
// ceil(n / kSampleChunk) * kSampleChunk floats of scratch; sums, above: ceil(n / kSampleChunk)
// floats each. A row with no weight at all draws token 0, accepted.
template <class Ops>
static int64_t sample_row_truncated(const float* x, int64_t n, float temperature, float p,
                                    float floor, float log_min_p, float u, float bound, float* w,
                                    float* sums, float* above, float* next_bound) {
  const float m = Ops::row_max(x, n), inv_t = 1.f / temperature;
  const int64_t chunks = (n + kSampleChunk - 1) / kSampleChunk;
  const bool restricted = bound >= 0.f;
  Ops::row_weights(x, n, m, inv_t, floor, log_min_p, bound, w, sums, above);
  *next_bound = -1.f;
  float rest;
  const int64_t c = pick_chunk(restricted ? above : sums, chunks, u, &rest);
  if (c < 0) return 0;
  const int64_t c0 = c * kSampleChunk, end = std::min(n, c0 + kSampleChunk);
  const float* cw = w + c0;
  float kept[kSampleChunk];  // the chunk's weights in the support
  if (restricted) {
    for (int64_t i = 0; i < end - c0; ++i) kept[i] = cw[i] > bound ? cw[i] : 0.f;
    cw = kept;
  }
  const int64_t t = c0 + pick_in_chunk(cw, end - c0, rest);
  if (p < 1.f) {
    float total = 0.f;  // the whole row's, summed as pick_chunk sums it
    for (int64_t k = 0; k < chunks; ++k) total += sums[k];
    if (!(Ops::mass_above(w, n, w[t]) < p * total)) *next_bound = w[t];
  }
  return t;
}

// ---- top-k: each row's k-th largest logit (apply_top_k's threshold) ------------------------
// x[i0..i1)'s values above thr appended at out (room for i1 - i0 + 16 floats); returns how
// many. AVX-512 compresses in a register (vcompressps to memory is microcoded on Zen 4).
PAGEDLLM_AVX512_TARGET static int64_t values_above16(const float* x, int64_t i0, int64_t i1,
                                                     float thr, float* out) {
  const __m512 t = _mm512_set1_ps(thr);
  int64_t m = 0, i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if (const __mmask16 k = _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ)) {
      _mm512_storeu_ps(out + m, _mm512_maskz_compress_ps(k, v));
      m += __builtin_popcount(k);
    }
  }
  for (; i < i1; ++i)
    if (x[i] > thr) out[m++] = x[i];
  return m;
}
// (AVX2: the entries above thr, or at least thr when kAtLeast, appended at out: their values
// for T = float, their indices for T = int64_t; returns how many.)
template <bool kAtLeast, class T>
PAGEDLLM_AVX2_TARGET static int64_t passing8(const float* x, int64_t i0, int64_t i1, float thr, T* out) {
  const __m256 t = _mm256_set1_ps(thr);
  auto keep = [x](int64_t i) -> T {
    if constexpr (std::is_same_v<T, float>) return x[i];
    else return i;
  };
  int64_t m = 0, i = i0;
  for (; i + 8 <= i1; i += 8)
    for (int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, kAtLeast ? _CMP_GE_OQ : _CMP_GT_OQ));
         k; k &= k - 1)
      out[m++] = keep(i + __builtin_ctz(k));
  for (; i < i1; ++i)
    if (kAtLeast ? x[i] >= thr : x[i] > thr) out[m++] = keep(i);
  return m;
}

// Indices i in [i0, i1) with x[i] >= thr, appended to out; their count (AVX2: passing8).
PAGEDLLM_AVX512_TARGET static int64_t indices_at_least16(const float* x, int64_t i0, int64_t i1,
                                                         float thr, int64_t* out) {
  const __m512 t = _mm512_set1_ps(thr);
  int64_t m = 0, i = i0;
  for (; i + 16 <= i1; i += 16)
    for (uint32_t k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), t, _CMP_GE_OQ); k; k &= k - 1)
      out[m++] = i + __builtin_ctz(k);
  for (; i < i1; ++i)
    if (x[i] >= thr) out[m++] = i;
  return m;
}
// x[j] = -inf for each j < n whose bit (bit j % 32 of word j / 32) is 0: a grammar's mask.
PAGEDLLM_CLONES static void mask_row(float* x, const int32_t* words, int64_t n) {
  for (int64_t w0 = 0; w0 < n; w0 += 32) {
    const uint32_t word = static_cast<uint32_t>(words[w0 / 32]);
    if (word == 0xFFFFFFFFu) continue;
    const int64_t end = std::min<int64_t>(32, n - w0);
    for (int64_t j = 0; j < end; ++j)
      x[w0 + j] = (word >> j) & 1u ? x[w0 + j] : -INFINITY;
  }
}

// How many of x[0..n) are above v (a NaN is not).
PAGEDLLM_CLONES static int64_t count_above(const float* x, int64_t n, float v) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += x[i] > v;
  return c;
}

// The k-th largest of x[0..n) counting repeats (torch.topk(k).values[k - 1]), or -inf when
// the row has fewer than k values above -inf (or k < 1). One pass through a filter: buf holds
// the top k of the prefix read so far plus the values since above the k-th of them (thr, -inf
// at first); once it holds max(4 k, 512) values it is cut back to its top k (nth_element),
// which raises thr (at 64 rows of 49,152 logits and k = 20, 0.54 ms against 0.84 with cuts at
// 2,048 and torch.topk's 2-3 ms). A value equal to thr cannot change the answer once k values
// at least thr are held, so the filter is strict. NaNs never pass (a row with them has no meaningful top k).
template <bool avx512>
static float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& buf) {
  if (k < 1 || k > n) return -INFINITY;
  constexpr int64_t kSegment = 512;
  const int64_t cut = std::max<int64_t>(4 * k, kSegment);
  buf.resize(cut + kSegment + 16);
  float thr = -INFINITY;
  int64_t held = 0;
  auto trim = [&] {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.begin() + held, std::greater<float>());
    thr = buf[k - 1];
    held = k;
  };
  for (int64_t i0 = 0; i0 < n; i0 += kSegment) {
    const int64_t i1 = std::min(n, i0 + kSegment);
    held += avx512 ? values_above16(x, i0, i1, thr, buf.data() + held)
                   : passing8<false>(x, i0, i1, thr, buf.data() + held);
    if (held >= cut) trim();
  }
  if (held < k) return -INFINITY;
  trim();
  return thr;
}

// A row's logprobs from its raw logits x[0..n) (log_softmax's, then gather and topk, in a few
// passes over the row and nothing written to it): the log of the softmax's normalizer (the
// row's max plus the log of chunk_sums' total, whose exp is within 1.4e-6 of expf), the
// chosen token's logprob and rank (1 + how many logits are above its own), and the top k
// tokens, largest first (ties by index), with their logprobs. lps[0] / ids[0] is the chosen
// token, 1..k the top k (-inf logits, masked tokens, rank after every other; only a row with
// NaNs, which match no comparison, can come up short: token 0 at -inf fills the rest).
template <class Ops, bool avx512>
static int64_t row_logprobs(const float* x, int64_t n, int64_t token, int64_t k, int64_t* ids,
                            float* lps, std::vector<float>& sums, std::vector<float>& buf,
                            std::vector<int64_t>& idx) {
  const float m = Ops::row_max(x, n);
  sums.resize((n + kSampleChunk - 1) / kSampleChunk);
  Ops::chunk_sums(x, n, m, 1.f, sums.data());
  double total = 0;
  for (float c : sums) total += c;
  const float lse = m + static_cast<float>(std::log(total));
  ids[0] = token;
  lps[0] = x[token] - lse;
  const int64_t rank = 1 + count_above(x, n, x[token]);
  if (k <= 0) return rank;
  const float floor = kth_largest<avx512>(x, n, std::min(k, n), buf);
  idx.resize(n);
  const int64_t found = avx512 ? indices_at_least16(x, 0, n, floor, idx.data())
                               : passing8<true>(x, 0, n, floor, idx.data());
  const int64_t take = std::min(k, found);
  auto before = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + take, idx.begin() + found, before);
  for (int64_t j = 0; j < take; ++j) {
    ids[1 + j] = idx[j];
    lps[1 + j] = x[idx[j]] - lse;
  }
  for (int64_t j = take; j < k; ++j) ids[1 + j] = 0, lps[1 + j] = -INFINITY;
  return rank;
}

}  // namespace pagedllm
