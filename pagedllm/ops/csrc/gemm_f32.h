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
// Two micro-kernels over a K-chunk of a panel: one row x 64 outputs (8 accumulators; small
// batches, where the weights stream from memory) and 6 rows x 16 outputs (12 accumulators, 4
// per panel; large batches, where FMA throughput counts). In both, each output's sum runs
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

// c[6][64] (+)= x[6 rows, k0 .. k0 + nk) * panel chunk w, 16 outputs at a time.
template <class W>
PAGEDLLM_AVX2_TARGET static inline void rows6(const float* x, int64_t ldx, const W* w,
                                             int64_t nk, float* c, bool load_c) {
  for (int j = 0; j < 4; ++j) {
    __m256 acc[6][2];
    for (int m = 0; m < 6; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < nk; ++k) {
      const W* wk = w + k * kPanel + 16 * j;
      const __m256 w0 = load8(wk), w1 = load8(wk + 8);
#pragma GCC unroll 6
      for (int m = 0; m < 6; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
      }
    }
    for (int m = 0; m < 6; ++m)
      for (int h = 0; h < 2; ++h) {
        float* ch = c + m * kPanel + 16 * j + 8 * h;
        _mm256_storeu_ps(ch, load_c ? _mm256_add_ps(acc[m][h], _mm256_loadu_ps(ch)) : acc[m][h]);
      }
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
    int64_t m = m0;
    if (widen && m1 - m0 >= 12) {
      const W* src = panel + k0 * kPanel;
      for (int64_t i = 0; i < nk * kPanel; i += 8) _mm256_store_ps(wide + i, load8(src + i));
      for (; m + 6 <= m1; m += 6)
        rows6(a.x + m * a.ldx + k0, a.ldx, static_cast<const float*>(wide), nk,
              c + (m - m0) * kPanel, k0 > 0);
    }
    for (; m + 6 <= m1; m += 6)
      rows6(a.x + m * a.ldx + k0, a.ldx, panel + k0 * kPanel, nk, c + (m - m0) * kPanel, k0 > 0);
    for (; m < m1; ++m)
      row64(a.x + m * a.ldx + k0, panel + k0 * kPanel, nk, c + (m - m0) * kPanel, k0 > 0);
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
