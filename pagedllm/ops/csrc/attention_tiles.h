// Prefill attention (attention.h's multi-token queries) on bf16 key tiles: bf16 caches, head
// sizes 64 and 128. Two kernels read the same layout: AMX tiles (attention_amx.h) and, on
// AVX512-BF16 CPUs without them (AMD Zen 4/5), vdpbf16ps on 16-lane vectors (here). Work
// items of up to kPrefillTileRows query rows of a request and one KV head, 16 rows at a time.
// Per item:
//
// 1. The keys the item's rows see, once for all of its query heads, in 16-key blocks (an even
//    number of them): each block's K rows transposed to 16 x 16 bf16 pairs per 32 head
//    dimensions (16 k-pairs x 16 keys: row i holds dimension pair i of the 16 keys), its V
//    rows interleaved in key pairs (8 key pairs x 16 columns a column tile; the columns come
//    out permuted within 128-bit lanes, as in the decode kernel, and go back in place at the
//    store), a column tile's blocks one after the other, so that two blocks make one AMX B
//    tile of 16 key pairs. Keys past the context are zero rows.
// 2. Per query head, S = Q K^T: fp32 sums of exact bf16 products.
// 3. An exact softmax per row over the keys it sees (its position, causal): the weights
//    rounded to bf16 (P), their sum taken over the rounded values so that each output is a
//    convex combination of V rows.
// 4. O = P V (bf16 pairs of weights times pairs of V rows), then divided by the sums into the
//    output rows.
//
// A row's arithmetic depends only on its queries and the keys it sees, so a prompt gives the
// same outputs whole, in chunks, or after a prefix-cache hit. Against the fp32 AVX-512 kernel
// (attention.h) the products are bf16 x bf16 (the queries as stored, the scale applied to the
// sums) and the weights bf16: half the multiply instructions, each one vdpbf16ps (on Zen 4
// twice the fp32 FMA's FLOPs).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include <c10/util/Exception.h>

#include "attention.h"

namespace pagedllm {

// Query rows per work item: its key tiles, built once, serve all of them (16 at a time), so a
// long prompt rebuilds them an eighth as often as with kPrefillRows-row items (on AMX, 128
// rows against 64: 1.03-1.05x on prompts of 32-2,000 tokens).
constexpr int64_t kPrefillTileRows = 128;

// A thread's scratch, grown as needed and kept (no zeroing per call).
static inline float* prefill_tiles_scratch(int64_t floats) {
  thread_local std::unique_ptr<float, decltype(&std::free)> buf{nullptr, &std::free};
  thread_local int64_t size = 0;
  if (size < floats) {
    size = (std::max(floats, 2 * size) + 15) / 16 * 16;  // whole 64-byte lines
    buf.reset(static_cast<float*>(std::aligned_alloc(64, size * sizeof(float))));
    TORCH_CHECK(buf, "prefill attention: out of memory for ", size, " floats of scratch");
  }
  return buf.get();
}

// r[0..16) (16 rows of 16 dwords) transposed in place: r[c] lane t <- row t's dword c.
PAGEDLLM_BF16_TARGET static inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + m], lane l: dword 4 l + m of rows 4 i .. 4 i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
    const __m512i y0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(x0, x1, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(x0, x1, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(y0, y1, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(y0, y1, 0xDD);
  }
}

// One item's geometry and scratch (floats): K^T tiles kt [nblk][C2][16 x 16 dwords], V tiles
// vt [2 C2][nblk][8 x 16 dwords], Q qb [16][D / 2 dwords], S s [16][Lp], P p [16][Lp / 2
// dwords], O ob [16][64], row sums [16].
struct PrefillTiles {
  int64_t G, ctx, r1, nblk, Lp;
  float *kt, *vt;
  uint16_t* qb;
  float* s;
  uint16_t* p;
  float *ob, *sums;
};

// Rows [r0, r0 + kPrefillTileRows) of request b, KV head kvh (head size D = 32 C2): the
// scratch laid out and the key tiles built (step 1).
template <int C2>
PAGEDLLM_BF16_TARGET static inline PrefillTiles prefill_tiles(const DecodeAttnArgs<Bf16>& a,
                                                              const int64_t* qsl, int64_t b,
                                                              int64_t kvh, int64_t r0) {
  constexpr int64_t D = 32 * C2, KB = 16;
  PrefillTiles t;
  const int64_t qlen = qsl[b + 1] - qsl[b];
  t.G = a.num_heads / a.num_kv_heads;
  t.ctx = a.seq_lens[b] - qlen;
  t.r1 = std::min(qlen, r0 + kPrefillTileRows);
  const int64_t end = t.ctx + t.r1;  // the last row's keys: 0 .. end - 1
  t.nblk = (end + 2 * KB - 1) / (2 * KB) * 2;
  t.Lp = t.nblk * KB;
  const int64_t kt_n = t.nblk * C2 * 256, vt_n = t.nblk * 2 * C2 * 128;
  t.kt = prefill_tiles_scratch(kt_n + vt_n + 16 * D / 2 + 16 * t.Lp + 8 * t.Lp + 16 * 64 + 16);
  t.vt = t.kt + kt_n;
  t.qb = reinterpret_cast<uint16_t*>(t.vt + vt_n);
  t.s = t.vt + vt_n + 16 * D / 2;
  t.p = reinterpret_cast<uint16_t*>(t.s + 16 * t.Lp);
  t.ob = t.s + 16 * t.Lp + 8 * t.Lp;
  t.sums = t.ob + 16 * 64;
  static const uint16_t zero_row[D] = {};
  const auto key_row = [&](int64_t tok, bool value) {
    return tok < end ? a.row(b, kvh, tok, value) : zero_row;
  };
  for (int64_t j = 0; j < t.nblk; ++j) {
    for (int c = 0; c < C2; ++c) {
      __m512i r[16];
      for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(key_row(j * KB + k, false) + 32 * c);
      transpose16_epi32(r);
      float* tile = t.kt + (j * C2 + c) * 256;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 16 * i, r[i]);
    }
    for (int pr = 0; pr < 8; ++pr) {
      const uint16_t* v0 = key_row(j * KB + 2 * pr, true);
      const uint16_t* v1 = key_row(j * KB + 2 * pr + 1, true);
      for (int h = 0; h < C2; ++h) {
        const __m512i x0 = _mm512_loadu_si512(v0 + 32 * h), x1 = _mm512_loadu_si512(v1 + 32 * h);
        _mm512_store_si512(t.vt + ((2 * h) * t.nblk + j) * 128 + 16 * pr,
                           _mm512_unpacklo_epi16(x0, x1));
        _mm512_store_si512(t.vt + ((2 * h + 1) * t.nblk + j) * 128 + 16 * pr,
                           _mm512_unpackhi_epi16(x0, x1));
      }
    }
  }
  return t;
}

// Step 3 for rows s0 .. s0 + nr of the item (S in t.s, unscaled): P in bf16 into t.p, zeros
// past each row's keys up to 2 spairs blocks, 1 / the sums of the rounded weights in t.sums
// (0 for the rows past nr).
PAGEDLLM_BF16_TARGET static inline void prefill_tiles_softmax(const PrefillTiles& t, float scale,
                                                              int64_t s0, int64_t nr,
                                                              int64_t spairs) {
  constexpr int64_t KB = 16;
  for (int64_t i = 0; i < 16; ++i) {
    uint16_t* pi = t.p + i * t.Lp;
    const int64_t seen = i < nr ? t.ctx + s0 + i + 1 : 0;
    t.sums[i] = seen ? softmax_row_bf16(t.s + i * t.Lp, seen, scale, pi) : 0.f;
    // keys the row does not see, to the last pair's end
    std::fill(pi + seen, pi + 2 * spairs * KB, uint16_t{0});
  }
}

// Query head `head`'s rows s0 .. s0 + nr of request b from their fp32 accumulators o[16
// rows][64 columns, tile order] for columns 64 dg .. 64 dg + 63, times the rows' 1 / sums.
template <int C2>
PAGEDLLM_BF16_TARGET static inline void prefill_tiles_store(const DecodeAttnArgs<Bf16>& a,
                                                            const int64_t* qsl, int64_t b,
                                                            int64_t head, int64_t s0, int64_t nr,
                                                            int64_t dg, const float* o,
                                                            const float* sums) {
  constexpr int64_t D = 32 * C2;
  for (int64_t i = 0; i < nr; ++i) {
    uint16_t* out = a.out + (qsl[b] + s0 + i) * a.num_heads * D + head * D + 64 * dg;
    for (int h = 0; h < 2; ++h)  // tiles 2 h (lo) and 2 h + 1 (hi): columns 32 h ..
      store_unpacked_bf16(out + 32 * h, _mm512_loadu_ps(o + i * 64 + 32 * h),
                          _mm512_loadu_ps(o + i * 64 + 32 * h + 16), _mm512_set1_ps(sums[i]));
  }
}

// ---- the products on AVX512-BF16 vectors ------------------------------------------------

// S rows i0 .. i0 + R of query head `head` (rows s0 + i of request b) against key blocks
// j0 .. j0 + N: sum over the D / 2 dimension pairs of vdpbf16ps(K^T row, the query's pair).
template <int C2, int R, int N>
PAGEDLLM_BF16_TARGET static inline void bf16_scores(const DecodeAttnArgs<Bf16>& a,
                                                    const PrefillTiles& t, const int64_t* qsl,
                                                    int64_t b, int64_t head, int64_t s0,
                                                    int64_t i0, int64_t j0) {
  constexpr int64_t D = 32 * C2;
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  const int32_t* q[R];
  for (int r = 0; r < R; ++r)
    q[r] = reinterpret_cast<const int32_t*>(a.q + (qsl[b] + s0 + i0 + r) * a.q_stride + head * D);
  for (int c = 0; c < C2; ++c)
    for (int i = 0; i < 16; ++i) {
      __m512bh k[N];
      for (int n = 0; n < N; ++n)
        k[n] = (__m512bh)_mm512_load_si512(t.kt + ((j0 + n) * C2 + c) * 256 + 16 * i);
      for (int r = 0; r < R; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(q[r][16 * c + i]);
        for (int n = 0; n < N; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], k[n], qp);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(t.s + (i0 + r) * t.Lp + (j0 + n) * 16, acc[r][n]);
}

// S rows i0 .. i0 + R against key blocks 0 .. sblk, four blocks at a time.
template <int C2, int R>
PAGEDLLM_BF16_TARGET static inline void bf16_score_rows(const DecodeAttnArgs<Bf16>& a,
                                                        const PrefillTiles& t, const int64_t* qsl,
                                                        int64_t b, int64_t head, int64_t s0,
                                                        int64_t i0, int64_t sblk) {
  int64_t j = 0;
  for (; j + 4 <= sblk; j += 4) bf16_scores<C2, R, 4>(a, t, qsl, b, head, s0, i0, j);
  for (; j < sblk; ++j) bf16_scores<C2, R, 1>(a, t, qsl, b, head, s0, i0, j);
}

// O rows i0 .. i0 + R, columns 64 dg .. 64 dg + 63 (four column tiles) into t.ob: the rows'
// bf16 weight pairs times V's key-pair rows, over spairs 32-key steps.
template <int R>
PAGEDLLM_BF16_TARGET static inline void bf16_values(const PrefillTiles& t, int64_t i0,
                                                    int64_t dg, int64_t spairs) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int32_t* p[R];
  for (int r = 0; r < R; ++r) p[r] = reinterpret_cast<const int32_t*>(t.p + (i0 + r) * t.Lp);
  const float* v = t.vt + 4 * dg * t.nblk * 128;  // column tile 4 dg + c at v + c nblk 128
  for (int64_t kp = 0; kp < 16 * spairs; ++kp) {  // key pairs
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c)
      vv[c] = (__m512bh)_mm512_load_si512(v + c * t.nblk * 128 + 16 * kp);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(p[r][kp]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(t.ob + (i0 + r) * 64 + 16 * c, acc[r][c]);
}

// Rows [r0, r0 + kPrefillTileRows) of request b, KV head kvh; head size D = 32 C2 (C2 = 2, 4).
template <int C2>
PAGEDLLM_BF16_TARGET static void prefill_item_tiles_bf16_t(const DecodeAttnArgs<Bf16>& a,
                                                           const int64_t* qsl, int64_t b,
                                                           int64_t kvh, int64_t r0) {
  static_assert(C2 % 2 == 0, "O goes 64 columns at a time");
  constexpr int64_t KB = 16, R = 4;
  const PrefillTiles t = prefill_tiles<C2>(a, qsl, b, kvh, r0);
  for (int64_t s0 = r0; s0 < t.r1; s0 += 16) {  // 16 rows at a time, keys up to the last one's
    const int64_t nr = std::min<int64_t>(16, t.r1 - s0), sblk = (t.ctx + s0 + nr + KB - 1) / KB;
    const int64_t spairs = (sblk + 1) / 2;  // 32-key steps of P V
    const int64_t nr4 = (nr + R - 1) / R * R;  // rows in groups of R (past nr: weights 0)
    for (int64_t g = 0; g < t.G; ++g) {
      const int64_t head = kvh * t.G + g;
      int64_t i = 0;  // S: R rows at a time, then the rest one by one
      for (; i + R <= nr; i += R) bf16_score_rows<C2, R>(a, t, qsl, b, head, s0, i, sblk);
      for (; i < nr; ++i) bf16_score_rows<C2, 1>(a, t, qsl, b, head, s0, i, sblk);
      prefill_tiles_softmax(t, a.scale, s0, nr, spairs);
      for (int64_t dg = 0; dg < C2 / 2; ++dg) {  // O = P V, 64 columns at a time
        for (int64_t i = 0; i < nr4; i += R) bf16_values<R>(t, i, dg, spairs);
        prefill_tiles_store<C2>(a, qsl, b, head, s0, nr, dg, t.ob, t.sums);
      }
    }
  }
}

// Whether the tile layout's kernels take head size D.
static inline bool prefill_tiles_head_size(int64_t D) { return D == 64 || D == 128; }

static inline void prefill_item_tiles_bf16(const DecodeAttnArgs<Bf16>& a, const int64_t* qsl,
                                           int64_t b, int64_t kvh, int64_t r0) {
  if (a.head_size == 64)
    prefill_item_tiles_bf16_t<2>(a, qsl, b, kvh, r0);
  else
    prefill_item_tiles_bf16_t<4>(a, qsl, b, kvh, r0);
}

}  // namespace pagedllm
