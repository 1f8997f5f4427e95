// Linear layers on bf16 weights packed for AVX512-BF16 (vdpbf16ps); int8 weights have their own
// kernel (gemm_int8.h) on the same panel scheme.
//
// Packed layout: [N_pad / 64][K / 2][64][2]. A "panel" is 64 output channels
// over all of K; inside it, each k-pair holds 64 x 2 consecutive values (output channel n,
// inputs 2 kp and 2 kp + 1), i.e. four 64-byte vectors of bf16 pairs that vdpbf16ps
// multiplies by a broadcast pair of x. Panels are contiguous, so one output tile streams one
// sequential run of memory (what the hardware prefetchers follow at full bandwidth when M is
// small and the weights come from DRAM).
//
// y[m, n] = sum_k x[m, k] w[n, k] + bias[n]: products exact in fp32, fp32 accumulation in an
// order fixed by K alone (so a row's result never depends on the batch).
//
// Work: (row block of <= 96 rows) x (panel) items, split over ATen's threads (ops.cpp's
// for_gemm_items). A thread keeps its row block (x) in L2 while it walks panels; a panel
// K-chunk (<= 96 KB) is reread from L2 by each 6-row tile.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace pagedllm {

constexpr int64_t kPanel = 64;      // output channels per panel
// How far ahead (bytes) the AVX2 one-row kernels prefetch their panel stream (gemm_f32.h,
// gemm_int8.h; the AVX-512 ones leave the stream to the hardware prefetchers, see micro).
constexpr int64_t kStreamPrefetch = 2048;
constexpr int64_t kRowTile = 6;     // rows per micro-kernel call: 6 x 4 accumulators
constexpr int64_t kRowBlock = 96;   // rows per work item
constexpr int64_t kKChunk = 384;    // k-pairs per chunk: a 96 KB bf16 panel chunk

struct GemmArgs {
  const uint16_t* x;      // [M, ldx] bf16, K used
  int64_t M, K, ldx;
  const uint16_t* w;      // packed panels
  const uint16_t* bias;   // [N] bf16 or nullptr
  int64_t N;
  void* out;              // [M, ldo] bf16 or fp32
  bool out_fp32;
  int64_t ldo;
};

// Vector j (16 outputs x 2 inputs) of a k-pair's 64 x 2 panel values, as bf16 pairs.
PAGEDLLM_BF16_TARGET static inline __m512bh load_pairs(const uint16_t* wk, int j) {
  return (__m512bh)_mm512_loadu_si512(wk + 32 * j);
}

// c[MT][64] (+)= x[MT rows, 2 kp0 .. 2 (kp0 + nkp)] * panel chunk w.
template <int MT>
PAGEDLLM_BF16_TARGET static inline void micro(
    const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t nkp, float* c, bool load_c) {
  // Accumulators start at zero and are added to c at the end (not loaded from c): with a
  // conditional start GCC keeps a stack copy of all 24 and stores it every iteration.
  __m512 acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xr[MT];
  for (int m = 0; m < MT; ++m) xr[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  // No software prefetch: on Zen 4 one prefetch a k-pair (4 KB ahead) held a 2-thread one-row
  // product to 16 GB/s of weights against 23-24 GB/s with the hardware prefetchers alone
  // (a 30 GB/s plain read); the int8 kernel likewise.
  for (int64_t kp = 0; kp < nkp; ++kp) {
    const uint16_t* wk = w + kp * 2 * kPanel;
    const __m512bh w0 = load_pairs(wk, 0), w1 = load_pairs(wk, 1);
    const __m512bh w2 = load_pairs(wk, 2), w3 = load_pairs(wk, 3);
#pragma GCC unroll 6
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[m][kp]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xb);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xb);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) {
      float* cj = c + m * kPanel + 16 * j;
      _mm512_storeu_ps(cj, load_c ? _mm512_add_ps(acc[m][j], _mm512_loadu_ps(cj)) : acc[m][j]);
    }
}

PAGEDLLM_BF16_TARGET static inline void micro_dispatch(
    int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t nkp, float* c,
    bool load_c) {
  switch (rows) {
    case 1: micro<1>(x, ldx, w, nkp, c, load_c); break;
    case 2: micro<2>(x, ldx, w, nkp, c, load_c); break;
    case 3: micro<3>(x, ldx, w, nkp, c, load_c); break;
    case 4: micro<4>(x, ldx, w, nkp, c, load_c); break;
    case 5: micro<5>(x, ldx, w, nkp, c, load_c); break;
    default: micro<6>(x, ldx, w, nkp, c, load_c); break;
  }
}

// Rows [m0, m1) of panel p's outputs from their fp32 sums c: bias added, stored.
PAGEDLLM_BF16_TARGET static void gemm_epilogue(
    const GemmArgs& a, int64_t m0, int64_t m1, int64_t p, const float* c) {
  const int64_t n0 = p * kPanel, n1 = std::min(a.N, n0 + kPanel);
  if (n1 - n0 == kPanel) {  // full panel: 16 lanes at a time
    for (int64_t m = m0; m < m1; ++m) {
      const float* cr = c + (m - m0) * kPanel;
      for (int64_t j = 0; j < kPanel; j += 16) {
        __m512 v = _mm512_loadu_ps(cr + j);
        if (a.bias) v = _mm512_add_ps(v, load16(a.bias + n0 + j));
        if (a.out_fp32)
          _mm512_storeu_ps(static_cast<float*>(a.out) + m * a.ldo + n0 + j, v);
        else
          store16(static_cast<uint16_t*>(a.out) + m * a.ldo + n0 + j, v);
      }
    }
    return;
  }
  for (int64_t m = m0; m < m1; ++m) {
    const float* cr = c + (m - m0) * kPanel;
    for (int64_t n = n0; n < n1; ++n) {
      float v = cr[n - n0];
      if (a.bias) v += bf16_to_fp32(a.bias[n]);
      if (a.out_fp32)
        static_cast<float*>(a.out)[m * a.ldo + n] = v;
      else
        static_cast<uint16_t*>(a.out)[m * a.ldo + n] = fp32_to_bf16(v);
    }
  }
}

// Rows [m0, m1) x panel p's fp32 sums into c (kPanel a row): K-chunks, 6-row tiles.
PAGEDLLM_BF16_TARGET static void gemm_sums(
    const GemmArgs& a, int64_t m0, int64_t m1, int64_t p, float* c) {
  const int64_t kp_total = a.K / 2;
  for (int64_t kp0 = 0; kp0 < kp_total; kp0 += kKChunk) {
    const int64_t nkp = std::min(kKChunk, kp_total - kp0);
    const uint16_t* panel = a.w + (p * kp_total + kp0) * 2 * kPanel;
    for (int64_t m = m0; m < m1; m += kRowTile) {
      const int64_t rows = std::min(kRowTile, m1 - m);
      micro_dispatch(rows, a.x + m * a.ldx + 2 * kp0, a.ldx, panel, nkp,
                     c + (m - m0) * kPanel, kp0 > 0);
    }
  }
}

// Rows [m0, m1) x panel p: the sums, then the epilogue (bias, store).
PAGEDLLM_BF16_TARGET static void gemm_item(
    const GemmArgs& a, int64_t m0, int64_t m1, int64_t p, float* c) {
  gemm_sums(a, m0, m1, p, c);
  gemm_epilogue(a, m0, m1, p, c);
}

}  // namespace pagedllm
