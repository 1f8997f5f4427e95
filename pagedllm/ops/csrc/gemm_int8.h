// int8 linear layers with AVX512-VNNI (vpdpbusd): int8 weights, activations quantized per row
// on the fly (W8A8, dynamic per token), exact int32 dot products.
//
// Weights: q[n, k] int8 with a float32 scale per output channel (layers/quantization.py),
// packed [N_pad / 64][K_pad / 4][64][4]: a "panel" of 64 output channels over all of K, each
// k-quad holding 64 x 4 consecutive values (output n, inputs 4 kq .. 4 kq + 3), i.e. four
// 64-byte vectors that vpdpbusd multiplies by a broadcast quad of x. K is padded with zero
// weights to a multiple of 4. colsum[n] = sum_k q[n, k].
//
// Activations: each row of x (bf16) is quantized asymmetrically to uint8 over [min(x, 0),
// max(x, 0)]: inv = 255 / span, zero = rint(-lo * inv), xq = clamp(rint(x * inv) + zero,
// 0, 255), scale = span / 255 (so x ~= scale * (xq - zero)). Then
//   y[m, n] = float(sum_k (xq[m, k] - zero[m]) q[n, k]) * scale[m] * wscale[n] + bias[n],
// the sum exact in int32 (two's complement wraps cancel: the true value fits for K <= 65536),
// so a row's result depends on that row alone, whatever the batch. `quantize_activations` in
// layers/quantization.py computes the same values in PyTorch (the reference).
//
// Work is split as in gemm.h: (row block) x (panel) items over ATen's threads.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "gemm.h"

#define PAGEDLLM_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

namespace pagedllm {

constexpr int64_t kQuadChunk = 768;  // k-quads per chunk: a 192 KB int8 panel chunk
constexpr int64_t kMaxInt8K = 65536;  // |sum| <= K * 255 * 127 must fit in int32

struct Int8GemmArgs {
  const uint8_t* xq;      // [M, ldx] quantized activations (K_pad used)
  const float* x_scale;   // [M]
  const int32_t* x_zero;  // [M]
  int64_t M, Kq, ldx;     // Kq: k-quads (K_pad / 4)
  const int8_t* w;        // packed panels
  const float* w_scale;   // [N]
  const int32_t* colsum;  // [N_pad]
  const uint16_t* bias;   // [N] bf16 or nullptr
  int64_t N;
  void* out;              // [M, ldo] bf16 or fp32
  bool out_fp32;
  int64_t ldo;
};

// One row of x (bf16, K values) -> xq (K_pad bytes, padding zeroed), its scale and zero.
PAGEDLLM_CLONES static void quantize_row_u8(const uint16_t* x, int64_t K, int64_t K_pad,
                                            uint8_t* xq, float* scale, int32_t* zero) {
  float lo = 0.f, hi = 0.f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t k = 0; k < K; ++k) {
    const float v = bf16_to_fp32(x[k]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  float span = hi - lo;
  if (!(span > 0.f)) span = 1.f;
  const float inv = 255.f / span;
  const float z = std::nearbyint(-lo * inv);
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint(bf16_to_fp32(x[k]) * inv) + z;
    xq[k] = static_cast<uint8_t>(std::min(255.f, std::max(0.f, q)));
  }
  for (int64_t k = K; k < K_pad; ++k) xq[k] = 0;
  *scale = span / 255.f;
  *zero = static_cast<int32_t>(z);
}

// acc += u8 quads of x . s8 quads of w (vpdpbusd). Inline assembly rather than the intrinsic:
// with `_mm512_dpbusd_epi32` GCC copies every accumulator through a spare register and the
// stack on each step (its __m512i is a vector of 64-bit lanes, the builtin's of 32-bit ones),
// which made the 6-row tile ~3x slower than the bf16 one.
PAGEDLLM_VNNI_TARGET static inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "vm"(w));
  return acc;
}

// c[MT][64] (+)= sum over nkq k-quads of xq rows x panel chunk w, in int32.
template <int MT>
PAGEDLLM_VNNI_TARGET static inline void micro_u8s8(const uint8_t* x, int64_t ldx,
                                                   const int8_t* w, int64_t nkq, int32_t* c,
                                                   bool load_c) {
  __m512i acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_si512();
  const int32_t* xr[MT];
  for (int m = 0; m < MT; ++m) xr[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  for (int64_t kq = 0; kq < nkq; ++kq) {
    const int8_t* wk = w + kq * 4 * kPanel;
    if (MT <= 4) _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * 4 * kPanel), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64);
    const __m512i w2 = _mm512_loadu_si512(wk + 128), w3 = _mm512_loadu_si512(wk + 192);
#pragma GCC unroll 6
    for (int m = 0; m < MT; ++m) {
      const __m512i xb = _mm512_set1_epi32(xr[m][kq]);
      acc[m][0] = dpbusd(acc[m][0], xb, w0);
      acc[m][1] = dpbusd(acc[m][1], xb, w1);
      acc[m][2] = dpbusd(acc[m][2], xb, w2);
      acc[m][3] = dpbusd(acc[m][3], xb, w3);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) {
      int32_t* cj = c + m * kPanel + 16 * j;
      const __m512i v = load_c ? _mm512_add_epi32(acc[m][j], _mm512_loadu_si512(cj)) : acc[m][j];
      _mm512_storeu_si512(cj, v);
    }
}

PAGEDLLM_VNNI_TARGET static inline void micro_u8s8_dispatch(int64_t rows, const uint8_t* x,
                                                            int64_t ldx, const int8_t* w,
                                                            int64_t nkq, int32_t* c, bool load_c) {
  switch (rows) {
    case 1: micro_u8s8<1>(x, ldx, w, nkq, c, load_c); break;
    case 2: micro_u8s8<2>(x, ldx, w, nkq, c, load_c); break;
    case 3: micro_u8s8<3>(x, ldx, w, nkq, c, load_c); break;
    case 4: micro_u8s8<4>(x, ldx, w, nkq, c, load_c); break;
    case 5: micro_u8s8<5>(x, ldx, w, nkq, c, load_c); break;
    default: micro_u8s8<6>(x, ldx, w, nkq, c, load_c); break;
  }
}

// Rows [m0, m1) x panel p: K-chunks, 6-row tiles, then the epilogue (zero point, scales,
// bias, store).
PAGEDLLM_VNNI_TARGET static void gemm_int8_item(const Int8GemmArgs& a, int64_t m0, int64_t m1,
                                                int64_t p, int32_t* c) {
  for (int64_t kq0 = 0; kq0 < a.Kq; kq0 += kQuadChunk) {
    const int64_t nkq = std::min(kQuadChunk, a.Kq - kq0);
    const int8_t* panel = a.w + (p * a.Kq + kq0) * 4 * kPanel;
    for (int64_t m = m0; m < m1; m += kRowTile)
      micro_u8s8_dispatch(std::min(kRowTile, m1 - m), a.xq + m * a.ldx + 4 * kq0, a.ldx, panel,
                          nkq, c + (m - m0) * kPanel, kq0 > 0);
  }
  const int64_t n0 = p * kPanel, valid = std::min(a.N - n0, kPanel);
  const __mmask16 all = 0xffff;
  for (int64_t m = m0; m < m1; ++m) {
    const int32_t* cr = c + (m - m0) * kPanel;
    const __m512i zero = _mm512_set1_epi32(a.x_zero[m]);
    const __m512 xs = _mm512_set1_ps(a.x_scale[m]);
    for (int64_t j = 0; j < valid; j += 16) {
      const __mmask16 mask = valid - j >= 16 ? all : static_cast<__mmask16>((1u << (valid - j)) - 1);
      const __m512i colsum = _mm512_loadu_si512(a.colsum + n0 + j);  // padded to whole panels
      const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(cr + j),
                                           _mm512_mullo_epi32(zero, colsum));
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), xs);
      v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, a.w_scale + n0 + j));
      if (a.bias) {
        const __m256i b = _mm256_maskz_loadu_epi16(mask, a.bias + n0 + j);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      if (a.out_fp32) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.out) + m * a.ldo + n0 + j, mask, v);
      } else {
        uint16_t* o = static_cast<uint16_t*>(a.out) + m * a.ldo + n0 + j;
        const __m512i u = _mm512_castps_si512(v);  // round to nearest even, as PyTorch does
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
        _mm256_mask_storeu_epi16(o, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
      }
    }
  }
}

}  // namespace pagedllm
