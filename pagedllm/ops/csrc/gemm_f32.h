// Linear layers in fp32 arithmetic on weights packed in panels, for AVX2 + FMA CPUs: fp32
// weights, or bf16 ones widened to fp32 as they are loaded (half the bytes to stream; the
// products and sums are the fp32 ones of the widened values, as PyTorch's bf16 GEMMs compute).
// Activations are fp32 here (ops.cpp widens bf16 rows first).
//
// Packed layout: [N_pad / 64][K][64] (the panels of gemm.h with one input per group): for each
// input k, a panel holds the 64 output channels' weights in one run (256 bytes in fp32, 128 in
// bf16), so a panel is a single sequential stream when M is small and the weights come from
// DRAM. The one-row kernel also prefetches kStreamPrefetch bytes ahead of its loads: with the
// hardware prefetchers alone a 2-thread decode drew ~20 of the ~31 GB/s a plain sum reads.
//
// Micro-kernels over a K-chunk of a panel: one row x 64 outputs (8 accumulators; small
// batches, where the weights stream from memory) and 6 rows x 16 outputs (12 accumulators, 4
// per panel; large batches, where FMA throughput counts), with 2-5-row tiles for a block's
// last rows. In all of them, each output's sum runs
// over k in order, one FMA at a time, and chunk sums are added in chunk order: a row's result
// depends on K alone, never on the batch it came in or the kernel that computed it. Work:
// (row block) x (panel) items over ATen's threads; a 64-input chunk of a panel (16 KB) stays in
// L1 while every row of the block multiplies it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "gemm.h"

namespace pagedllm {

constexpr int64_t kF32KChunk = 64;  // inputs per chunk: 16 KB of an fp32 panel

struct GemmF32Args {
  const float* x;     // [M, ldx] fp32, K used
  int64_t M, K, ldx;
  const void* w;      // packed panels: fp32, or bf16 (uint16_t)
  const void* bias;   // [N] in the output's element type E (see gemm_f32_item), or nullptr
  int64_t N;
  void* out;          // [M, ldo]: fp32 (out_fp32) or E
  bool out_fp32;
  int64_t ldo;
};

// c[0..64) (+)= x[k0 .. k0 + nk) * panel chunk w (nk rows of 64).
template <class W>
PAGEDLLM_AVX2_TARGET static inline void row64(const float* x, const W* w, int64_t nk, float* c,
                                             bool load_c) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < nk; ++k) {
    const W* wk = w + k * kPanel;
    for (int64_t b = 0; b < kPanel * int64_t(sizeof(W)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kStreamPrefetch + b, _MM_HINT_T0);
    const __m256 xb = _mm256_broadcast_ss(x + k);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(load8(wk + 8 * j), xb, acc[j]);
  }
  for (int j = 0; j < 8; ++j)
    _mm256_storeu_ps(c + 8 * j, load_c ? _mm256_add_ps(acc[j], _mm256_loadu_ps(c + 8 * j)) : acc[j]);
}

// c[MT][64] (+)= x[MT rows, k0 .. k0 + nk) * panel chunk w, 8 * NV outputs at a time
// (MT * NV accumulators). tile<6, 2> is the workhorse; the others take a block's last 2-5 rows
// (a row at a time, as row64, they ran at a third of its FMA rate: 64 = 10 x 6 + 4 rows cost
// 15% of the 6-row tiles' speed).
template <int MT, int NV, class W>
PAGEDLLM_AVX2_TARGET static inline void tile(const float* x, int64_t ldx, const W* w,
                                            int64_t nk, float* c, bool load_c) {
  for (int j = 0; j < 8 / NV; ++j) {
    __m256 acc[MT][NV];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < nk; ++k) {
      const W* wk = w + k * kPanel + 8 * NV * j;
      __m256 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = load8(wk + 8 * v);
#pragma GCC unroll 6
      for (int m = 0; m < MT; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(wv[v], xb, acc[m][v]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) {
        float* cv = c + m * kPanel + 8 * NV * j + 8 * v;
        _mm256_storeu_ps(cv, load_c ? _mm256_add_ps(acc[m][v], _mm256_loadu_ps(cv)) : acc[m][v]);
      }
  }
}

// Rows [m, m1) of a chunk: 6-row tiles, then the 1-5 rows left in one smaller tile.
template <class W>
PAGEDLLM_AVX2_TARGET static inline void rows_chunk(const float* x, int64_t ldx, const W* w,
                                                  int64_t nk, float* c, int64_t rows,
                                                  bool load_c) {
  int64_t m = 0;
  for (; m + 6 <= rows; m += 6) tile<6, 2>(x + m * ldx, ldx, w, nk, c + m * kPanel, load_c);
  x += m * ldx;
  c += m * kPanel;
  switch (rows - m) {
    case 1: row64(x, w, nk, c, load_c); break;
    case 2: tile<2, 4>(x, ldx, w, nk, c, load_c); break;
    case 3: tile<3, 4>(x, ldx, w, nk, c, load_c); break;
    case 4: tile<4, 2>(x, ldx, w, nk, c, load_c); break;
    case 5: tile<5, 2>(x, ldx, w, nk, c, load_c); break;
    default: break;
  }
}

// Rows [m0, m1) x panel p: K-chunks, every row per chunk, then the epilogue (bias, store);
// W: the weights' element type, E: the bias's and (unless out_fp32) the output's.
template <class W, class E>
PAGEDLLM_AVX2_TARGET static void gemm_f32_item(const GemmF32Args& a, int64_t m0, int64_t m1,
                                              int64_t p, float* c) {
  const W* panel = static_cast<const W*>(a.w) + p * a.K * kPanel;
  // bf16 weights for two or more 6-row tiles: widen the chunk once into fp32 (16 KB, L1), so
  // the tiles' inner loop has no conversions (they would compete with the FMAs for ports).
  constexpr bool widen = !std::is_same_v<W, float>;
  alignas(64) float wide[widen ? kF32KChunk * kPanel : 1];
  for (int64_t k0 = 0; k0 < a.K; k0 += kF32KChunk) {
    const int64_t nk = std::min(kF32KChunk, a.K - k0);
    const float* x = a.x + m0 * a.ldx + k0;
    if (widen && m1 - m0 >= 12) {
      const W* src = panel + k0 * kPanel;
      for (int64_t i = 0; i < nk * kPanel; i += 8) _mm256_store_ps(wide + i, load8(src + i));
      rows_chunk(x, a.ldx, static_cast<const float*>(wide), nk, c, m1 - m0, k0 > 0);
    } else {
      rows_chunk(x, a.ldx, panel + k0 * kPanel, nk, c, m1 - m0, k0 > 0);
    }
  }
  const int64_t n0 = p * kPanel, valid = std::min(a.N - n0, kPanel);
  const auto* bias = static_cast<const typename E::T*>(a.bias);
  for (int64_t m = m0; m < m1; ++m) {
    float* cr = c + (m - m0) * kPanel;
    if (bias)
      for (int64_t j = 0; j < valid; ++j) cr[j] += E::load(bias[n0 + j]);
    if (a.out_fp32) {
      std::memcpy(static_cast<float*>(a.out) + m * a.ldo + n0, cr, valid * sizeof(float));
    } else {
      typename E::T* o = static_cast<typename E::T*>(a.out) + m * a.ldo + n0;
      for (int64_t j = 0; j < valid; ++j) o[j] = E::store(cr[j]);
    }
  }
}

}  // namespace pagedllm
