// Prefill attention on AMX tiles: attention_tiles.h's layout and steps (bf16 caches, head
// sizes 64 and 128) with S = Q K^T and O = P V as tile products, on CPUs with AMX:
// - S: per query head its rows (zero-padded to 16) as A tiles (Q: 16 rows x 32 bf16
//   dimensions) against the K^T B tiles, four 16-key blocks at a time into four accumulators
//   (one accumulator's products wait on each other; four keep the tile unit busy);
// - O: P as A tiles of 32 keys, 64 columns (4 accumulator tiles) at a time, 32 keys a step,
//   the V tiles loaded into three registers in turn.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "attention_tiles.h"
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

// Rows [r0, r0 + kPrefillTileRows) of request b, KV head kvh; head size D = 32 C2 (C2 = 2, 4).
template <int C2>
PAGEDLLM_AMX_TARGET static void prefill_item_amx_t(const DecodeAttnArgs<Bf16>& a,
                                                   const int64_t* qsl, int64_t b, int64_t kvh,
                                                   int64_t r0) {
  static_assert(C2 % 2 == 0, "O goes 64 columns at a time");
  constexpr int64_t D = 32 * C2, KB = 16;
  const PrefillTiles t = prefill_tiles<C2>(a, qsl, b, kvh, r0);
  const int64_t nblk = t.nblk, Lp = t.Lp;
  float *kt = t.kt, *s = t.s, *ob = t.ob;
  const float* vt = t.vt;
  uint16_t *qb = t.qb, *p = t.p;
  amx_configure_attention();
  for (int64_t s0 = r0; s0 < t.r1; s0 += 16) {  // 16 rows at a time, keys up to the last one's
    const int64_t nr = std::min<int64_t>(16, t.r1 - s0), sblk = (t.ctx + s0 + nr + KB - 1) / KB;
    const int64_t spairs = (sblk + 1) / 2;  // 32-key steps of P V
    for (int64_t g = 0; g < t.G; ++g) {
      const int64_t head = kvh * t.G + g;
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
      prefill_tiles_softmax(t, a.scale, s0, nr, spairs);
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
        prefill_tiles_store<C2>(a, qsl, b, head, s0, nr, dg, ob, t.sums);
      }
    }
  }
}

// Whether the AMX kernel takes a prefill of bf16 queries and caches with head size D.
static inline bool prefill_amx_applies(int64_t D) {
  return prefill_tiles_head_size(D) && amx_usable();
}

static inline void prefill_item_amx(const DecodeAttnArgs<Bf16>& a, const int64_t* qsl, int64_t b,
                                    int64_t kvh, int64_t r0) {
  if (a.head_size == 64)
    prefill_item_amx_t<2>(a, qsl, b, kvh, r0);
  else
    prefill_item_amx_t<4>(a, qsl, b, kvh, r0);
}

}  // namespace pagedllm
