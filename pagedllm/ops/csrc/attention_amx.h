// Prefill attention (attention.h's multi-token queries) on AMX tiles: bf16 caches, head sizes
// 64 and 128, CPUs with AMX. Work items of up to kPrefillAmxRows query rows of a request and
// one KV head (16 rows at a time through the tiles); the same result as the vector kernels
// up to rounding. Per item:
//
// 1. The keys the item's rows see, once for all of its query heads, in 16-key blocks (an even
//    number of them): each block's K rows transposed to 16 x 16 bf16 pairs per 32 head
//    dimensions (a B tile: 16 k-pairs x 16 keys), its V rows interleaved in key pairs (8 key
//    pairs x 16 columns a column tile; the columns come out permuted within 128-bit lanes, as
//    in the decode kernel, and go back in place at the store), a column tile's blocks one
//    after the other, so that two blocks make one B tile of 16 key pairs. Keys past the
//    context are zero rows.
// 2. Per query head, its rows (zero-padded to 16) as A tiles: S = Q K^T on the tiles (fp32
//    sums of exact bf16 products), four 16-key blocks at a time into four accumulators (one
//    accumulator's products wait on each other; four keep the tile unit busy).
// 3. An exact softmax per row over the keys it sees (its position, causal), on AVX-512: the
//    weights rounded to bf16 (P, A tiles of 32 keys), their sum taken over the rounded values
//    so that each output is a convex combination of V rows.
// 4. O = P V on the tiles, 64 columns (4 accumulator tiles) at a time, 32 keys a step, the V
//    tiles loaded into three registers in turn; then divided by the sums into the output rows.
//
// A row's arithmetic depends only on its queries and the keys it sees (tile rows do not mix),
// so a prompt gives the same outputs whole, in chunks, or after a prefix-cache hit. Against
// the AVX-512 kernel the weights are bf16 rather than fp32 (the P V products on the tiles).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

#include <c10/util/Exception.h>

#include "attention.h"
#include "gemm_amx.h"

namespace pagedllm {

// The tile configuration of these kernels: all eight tiles 16 rows x 64 bytes. tmm0-3 fp32
// accumulators (S, then O); tmm4 an A tile (Q: 16 rows x 32 bf16 dimensions; P: 16 rows x 32
// keys); tmm5-7 B tiles (K^T: 16 dimension pairs x 16 keys; V: 16 key pairs x 16 columns).
PAGEDLLM_AMX_TARGET static inline void amx_configure_attention() {
  constexpr int kKey = 1 << 20;  // apart from amx_configure's row-count keys
  int& loaded = amx_loaded_config();
  if (loaded == kKey) return;
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  loaded = kKey;
}

// A thread's scratch, grown as needed and kept (no zeroing per call).
static inline float* prefill_amx_scratch(int64_t floats) {
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
PAGEDLLM_AMX_TARGET static inline void transpose16_epi32(__m512i r[16]) {
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

// Query rows per work item of the AMX kernel: its key tiles, built once, serve all of them
// (16 at a time through the tiles), so a long prompt rebuilds them an eighth as often as with
// kPrefillRows-row items (128 rows against 64: 1.03-1.05x on prompts of 32-2,000 tokens).
constexpr int64_t kPrefillAmxRows = 128;

// S tiles j0 .. j0 + N - 1 (16-key blocks) of the Q tiles at qb: C2 A tiles (32 dimensions
// each) against each block's K^T tiles, B tiles loaded into tmm5-7 in turn, N accumulators.
template <int C2, int N>
PAGEDLLM_AMX_TARGET static inline void amx_scores(const uint16_t* qb, const float* kt, int64_t j0,
                                                  float* s, int64_t Lp) {
  constexpr int64_t D = 32 * C2;
  _tile_zero(0);
  if (N > 1) _tile_zero(1);
  if (N > 2) _tile_zero(2);
  if (N > 3) _tile_zero(3);
  for (int c = 0; c < C2; ++c) {
    const float* k = kt + (j0 * C2 + c) * 256;
    _tile_loadd(4, qb + 32 * c, D * 2);
    _tile_loadd(5, k, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (N > 1) {
      _tile_loadd(6, k + C2 * 256, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (N > 2) {
      _tile_loadd(7, k + 2 * C2 * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (N > 3) {
      _tile_loadd(5, k + 3 * C2 * 256, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  float* out = s + j0 * 16;
  _tile_stored(0, out, Lp * 4);
  if (N > 1) _tile_stored(1, out + 16, Lp * 4);
  if (N > 2) _tile_stored(2, out + 32, Lp * 4);
  if (N > 3) _tile_stored(3, out + 48, Lp * 4);
}

// Rows [r0, r0 + kPrefillAmxRows) of request b, KV head kvh; head size D = 32 C2 (C2 = 2, 4).
template <int C2>
PAGEDLLM_AMX_TARGET static void prefill_item_amx_t(const DecodeAttnArgs<Bf16>& a,
                                                   const int64_t* qsl, int64_t b, int64_t kvh,
                                                   int64_t r0) {
  static_assert(C2 % 2 == 0, "O goes 64 columns at a time");
  constexpr int64_t D = 32 * C2, KB = 16;
  const int64_t G = a.num_heads / a.num_kv_heads, qlen = qsl[b + 1] - qsl[b];
  const int64_t ctx = a.seq_lens[b] - qlen, r1 = std::min(qlen, r0 + kPrefillAmxRows);
  const int64_t end = ctx + r1, nblk = (end + 2 * KB - 1) / (2 * KB) * 2, Lp = nblk * KB;
  // Scratch (floats): K^T tiles [nblk][C2][16 x 16 dwords], V tiles [2 C2][nblk][8 x 16
  // dwords], Q [16][D / 2], S [16][Lp], P [16][Lp / 2], O [16][64], row sums [16].
  const int64_t kt_n = nblk * C2 * 256, vt_n = nblk * 2 * C2 * 128;
  float* kt = prefill_amx_scratch(kt_n + vt_n + 16 * D / 2 + 16 * Lp + 8 * Lp + 16 * 64 + 16);
  float* vt = kt + kt_n;
  uint16_t* qb = reinterpret_cast<uint16_t*>(vt + vt_n);
  float* s = vt + vt_n + 16 * D / 2;
  uint16_t* p = reinterpret_cast<uint16_t*>(s + 16 * Lp);
  float* ob = s + 16 * Lp + 8 * Lp;
  float* sums = ob + 16 * 64;
  static const uint16_t zero_row[D] = {};
  const auto key_row = [&](int64_t tok, bool value) {
    return tok < end ? a.row(b, kvh, tok, value) : zero_row;
  };
  for (int64_t j = 0; j < nblk; ++j) {
    for (int c = 0; c < C2; ++c) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(key_row(j * KB + t, false) + 32 * c);
      transpose16_epi32(r);
      float* tile = kt + (j * C2 + c) * 256;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 16 * i, r[i]);
    }
    for (int pr = 0; pr < 8; ++pr) {
      const uint16_t* v0 = key_row(j * KB + 2 * pr, true);
      const uint16_t* v1 = key_row(j * KB + 2 * pr + 1, true);
      for (int h = 0; h < C2; ++h) {
        const __m512i x0 = _mm512_loadu_si512(v0 + 32 * h), x1 = _mm512_loadu_si512(v1 + 32 * h);
        _mm512_store_si512(vt + ((2 * h) * nblk + j) * 128 + 16 * pr, _mm512_unpacklo_epi16(x0, x1));
        _mm512_store_si512(vt + ((2 * h + 1) * nblk + j) * 128 + 16 * pr,
                           _mm512_unpackhi_epi16(x0, x1));
      }
    }
  }
  amx_configure_attention();
  const __m512 scale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t s0 = r0; s0 < r1; s0 += 16) {  // 16 rows at a time, keys up to the last one's
    const int64_t nr = std::min<int64_t>(16, r1 - s0), sblk = (ctx + s0 + nr + KB - 1) / KB;
    const int64_t spairs = (sblk + 1) / 2;  // 32-key steps of P V
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = kvh * G + g;
      for (int64_t i = 0; i < 16; ++i)
        for (int c = 0; c < C2; ++c)
          _mm512_storeu_si512(qb + i * D + 32 * c,
                              i < nr ? _mm512_loadu_si512(a.q + (qsl[b] + s0 + i) * a.q_stride +
                                                          head * D + 32 * c)
                                     : _mm512_setzero_si512());
      int64_t j = 0;  // S = Q K^T, four blocks at a time
      for (; j + 4 <= sblk; j += 4) amx_scores<C2, 4>(qb, kt, j, s, Lp);
      switch (sblk - j) {
        case 3: amx_scores<C2, 3>(qb, kt, j, s, Lp); break;
        case 2: amx_scores<C2, 2>(qb, kt, j, s, Lp); break;
        case 1: amx_scores<C2, 1>(qb, kt, j, s, Lp); break;
        default: break;
      }
      for (int64_t i = 0; i < 16; ++i) {  // P: exact softmax of each row's keys, in bf16
        float* si = s + i * Lp;
        uint16_t* pi = p + i * Lp;
        const int64_t seen = i < nr ? ctx + s0 + i + 1 : 0;
        __m512 mv = ninf;
        for (int64_t t = 0; t < seen; t += KB) {
          const __mmask16 k = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int(seen - t)), iota);
          mv = _mm512_max_ps(mv, _mm512_mask_mul_ps(ninf, k, _mm512_loadu_ps(si + t), scale));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t < seen; t += KB) {
          const __mmask16 k = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int(seen - t)), iota);
          const __m512 e = _mm512_maskz_mov_ps(
              k, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(si + t), scale), m)));
          const __m256bh eb = _mm512_cvtneps_pbh(e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + t), (__m256i)eb);
          sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
        }
        for (; t < 2 * spairs * KB; t += KB)  // keys the row does not see, to the last P tile's end
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + t), _mm256_setzero_si256());
        sums[i] = seen ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
      }
      for (int dg = 0; dg < C2 / 2; ++dg) {  // O = P V, 64 columns at a time
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const float* v = vt + 4 * dg * nblk * 128;  // column tile 4 dg + t at v + t nblk 128
        for (int64_t jp = 0; jp < spairs; ++jp) {
          const float* vj = v + 2 * jp * 128;
          _tile_loadd(4, p + jp * 2 * KB, Lp * 2);
          _tile_loadd(5, vj, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, vj + nblk * 128, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, vj + 2 * nblk * 128, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, vj + 3 * nblk * 128, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, ob, 256);
        _tile_stored(1, ob + 16, 256);
        _tile_stored(2, ob + 32, 256);
        _tile_stored(3, ob + 48, 256);
        for (int64_t i = 0; i < nr; ++i) {
          uint16_t* out = a.out + (qsl[b] + s0 + i) * a.num_heads * D + head * D + 64 * dg;
          for (int h = 0; h < 2; ++h)  // tiles 2 h (lo) and 2 h + 1 (hi): columns 32 h ..
            store_unpacked_bf16(out + 32 * h, _mm512_loadu_ps(ob + i * 64 + 32 * h),
                                _mm512_loadu_ps(ob + i * 64 + 32 * h + 16),
                                _mm512_set1_ps(sums[i]));
        }
      }
    }
  }
}

// Whether the AMX kernel takes a prefill of bf16 queries and caches with head size D.
static inline bool prefill_amx_applies(int64_t D) {
  return (D == 64 || D == 128) && amx_usable();
}

static inline void prefill_item_amx(const DecodeAttnArgs<Bf16>& a, const int64_t* qsl, int64_t b,
                                    int64_t kvh, int64_t r0) {
  if (a.head_size == 64)
    prefill_item_amx_t<2>(a, qsl, b, kvh, r0);
  else
    prefill_item_amx_t<4>(a, qsl, b, kvh, r0);
}

}  // namespace pagedllm
