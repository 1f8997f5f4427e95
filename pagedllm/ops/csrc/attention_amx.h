// Prefill attention (attention.h's multi-token queries) on AMX tiles: bf16 caches, head sizes
// 64 and 128, CPUs with AMX. Work items of up to kPrefillAmxRows query rows of a request and
// one KV head (16 rows at a time through the tiles); the same result as the vector kernels
// up to rounding. Per item:
//
// 1. The keys the item's rows see, once for all of its query heads: each 16-key block's K
//    rows transposed to 16 x 16 bf16 pairs per 32 head dimensions (a B tile: 16 k-pairs x 16
//    keys), its V rows interleaved in key pairs (a B tile: 8 key pairs x 16 columns; the
//    columns come out permuted within 128-bit lanes, as in the decode kernel, and go back in
//    place at the store). Keys past the context are zero rows.
// 2. Per query head, its rows (zero-padded to 16) as an A tile: S = Q K^T on the tiles (fp32
//    sums of exact bf16 products), 16 keys a tile.
// 3. An exact softmax per row over the keys it sees (its position, causal), on AVX-512: the
//    weights rounded to bf16 (P, an A tile of 16 keys), their sum taken over the rounded
//    values so that each output is a convex combination of V rows.
// 4. O = P V on the tiles, 64 columns (4 accumulator tiles) at a time, over every key block;
//    then divided by the sums into the output rows.
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

// The tile configuration of these kernels: tmm0-3 fp32 16 x 16 (S in tmm0, then O), tmm4 Q
// (16 rows x 32 bf16), tmm5 K^T (16 pairs x 16 keys), tmm6 P (16 rows x 16 keys), tmm7 V
// (8 key pairs x 16 columns).
PAGEDLLM_AMX_TARGET static inline void amx_configure_attention() {
  constexpr int kKey = 1 << 20;  // apart from amx_configure's row-count keys
  int& loaded = amx_loaded_config();
  if (loaded == kKey) return;
  AmxTileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  cfg.rows[6] = 16, cfg.colsb[6] = 32;
  cfg.rows[7] = 8, cfg.colsb[7] = 64;
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
// (16 at a time through the tiles), so a long prompt rebuilds them a quarter as often as with
// kPrefillRows-row items.
constexpr int64_t kPrefillAmxRows = 64;

// Rows [r0, r0 + kPrefillAmxRows) of request b, KV head kvh; head size D = 32 C2 (C2 = 2, 4).
template <int C2>
PAGEDLLM_AMX_TARGET static void prefill_item_amx_t(const DecodeAttnArgs<Bf16>& a,
                                                   const int64_t* qsl, int64_t b, int64_t kvh,
                                                   int64_t r0) {
  static_assert(C2 % 2 == 0, "O goes 64 columns at a time");
  constexpr int64_t D = 32 * C2, KB = 16;
  const int64_t G = a.num_heads / a.num_kv_heads, qlen = qsl[b + 1] - qsl[b];
  const int64_t ctx = a.seq_lens[b] - qlen, r1 = std::min(qlen, r0 + kPrefillAmxRows);
  const int64_t end = ctx + r1, nblk = (end + KB - 1) / KB, Lp = nblk * KB;
  // Scratch (floats): K^T tiles [nblk][C2][16 x 16 dwords], V tiles [nblk][2 C2][8 x 16
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
        float* tiles = vt + (j * 2 * C2 + 2 * h) * 128;
        _mm512_store_si512(tiles + 16 * pr, _mm512_unpacklo_epi16(x0, x1));
        _mm512_store_si512(tiles + 128 + 16 * pr, _mm512_unpackhi_epi16(x0, x1));
      }
    }
  }
  amx_configure_attention();
  const __m512 scale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t s0 = r0; s0 < r1; s0 += 16) {  // 16 rows at a time, keys up to the last one's
    const int64_t nr = std::min<int64_t>(16, r1 - s0), sblk = (ctx + s0 + nr + KB - 1) / KB;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = kvh * G + g;
      for (int64_t i = 0; i < 16; ++i)
        for (int c = 0; c < C2; ++c)
          _mm512_storeu_si512(qb + i * D + 32 * c,
                              i < nr ? _mm512_loadu_si512(a.q + (qsl[b] + s0 + i) * a.q_stride +
                                                          head * D + 32 * c)
                                     : _mm512_setzero_si512());
      for (int64_t j = 0; j < sblk; ++j) {  // S = Q K^T
        _tile_zero(0);
        for (int c = 0; c < C2; ++c) {
          _tile_loadd(4, qb + 32 * c, D * 2);
          _tile_loadd(5, kt + (j * C2 + c) * 256, 64);
          _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, s + j * KB, Lp * 4);
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
        for (int64_t t = 0; t < sblk * KB; t += KB) {
          const __mmask16 k = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int(seen - t)), iota);
          const __m512 e = _mm512_maskz_mov_ps(
              k, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(si + t), scale), m)));
          const __m256bh eb = _mm512_cvtneps_pbh(e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + t), (__m256i)eb);
          sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
        }
        sums[i] = seen ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
      }
      for (int dg = 0; dg < C2 / 2; ++dg) {  // O = P V, 64 columns at a time
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < sblk; ++j) {
          const float* vj = vt + (j * 2 * C2 + 4 * dg) * 128;
          _tile_loadd(6, p + j * KB, Lp * 2);
          _tile_loadd(7, vj, 64);
          _tile_dpbf16ps(0, 6, 7);
          _tile_loadd(7, vj + 128, 64);
          _tile_dpbf16ps(1, 6, 7);
          _tile_loadd(7, vj + 256, 64);
          _tile_dpbf16ps(2, 6, 7);
          _tile_loadd(7, vj + 384, 64);
          _tile_dpbf16ps(3, 6, 7);
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
