// The MLP's gate / up projection with SiLU x mul in its epilogue (ops.cpp's linear_silu_mul):
// for a bf16 panel weight of 2 I rows, the gate rows then the up rows (I a multiple of 64),
// output channels 64 p .. 64 p + 63 come from gate panel p and up panel p + I / 64, both
// computed in the same work item; the epilogue rounds each sum to bf16 (as the projection
// stores it) and applies silu_mul16 (as silu_and_mul's row does), so the result is the same
// bits as silu_and_mul(linear(x, w)) without the [M, 2 I] intermediate. The point is where
// SiLU's exps run: inside the GEMM's items, where on a core whose hyperthreads share one AMX
// unit one thread's vector work overlaps the other's tile products, instead of in a pass of
// its own (~15% of a prefill's MLP time at 1.3 ns a row element).
//
// int8 weights (gemm_int8.h, AVX512-VNNI, bf16 activations) pair their panels the same way:
// the epilogue computes both sums' values as int8_epilogue does (dot products, scales, bias),
// then rounds and applies SiLU x mul as above, so again the bits of the two ops. A decode
// step saves silu_and_mul's pass and its [M, 2 I] intermediate (~2.5 us a layer on SmolLM2).
#pragma once

#include "elementwise.h"
#include "gemm_amx.h"
#include "gemm_int8.h"

namespace pagedllm {

// Rows [r0, r1) of output panel p from the gate and up sums cg, cu (kPanel a row, row r0
// first): bias added, rounded to bf16, SiLU x mul, stored.
PAGEDLLM_BF16_TARGET static void silu_epilogue(const GemmArgs& a, int64_t r0, int64_t r1,
                                               int64_t p, const float* cg, const float* cu) {
  const int64_t n0 = p * kPanel, half = a.N / 2;
  for (int64_t m = r0; m < r1; ++m) {
    const float* gr = cg + (m - r0) * kPanel;
    const float* ur = cu + (m - r0) * kPanel;
    uint16_t* out = static_cast<uint16_t*>(a.out) + m * a.ldo + n0;
    for (int64_t j = 0; j < kPanel; j += 16) {
      __m512 g = _mm512_loadu_ps(gr + j), u = _mm512_loadu_ps(ur + j);
      if (a.bias) {
        g = _mm512_add_ps(g, load16(a.bias + n0 + j));
        u = _mm512_add_ps(u, load16(a.bias + half + n0 + j));
      }
      store16(out + j, silu_mul16(round16(g), round16(u)));
    }
  }
}

// Output panel p for rows [m0, m1) (at most kRowBlock) on gemm.h's AVX512-BF16 kernel.
PAGEDLLM_BF16_TARGET static void gemm_silu_item(const GemmArgs& a, int64_t m0, int64_t m1,
                                                int64_t p, float* c) {
  alignas(64) float cu[kRowBlock * kPanel];
  gemm_sums(a, m0, m1, p, c);
  gemm_sums(a, m0, m1, p + a.N / 2 / kPanel, cu);
  silu_epilogue(a, m0, m1, p, c, cu);
}

// The same on AMX tiles, 32 rows at a time as gemm_item_amx, each tile's epilogue run during
// the next tile's products (AmxDeferred; gate sums in c, up sums in cu, two 32-row buffers
// each); next_p: the output panel of the thread's next item (-1: none), whose gate and up
// panels are prefetched.
PAGEDLLM_AMX_TARGET static void gemm_silu_item_amx(const GemmArgs& a, int64_t m0, int64_t m1,
                                                   int64_t p, float* c, int64_t next_p) {
  alignas(64) float cu[4 * kAmxRows * kPanel];
  const int64_t K32 = a.K / kAmxK * kAmxK, kbytes = K32 * 2, ldx = a.ldx * 2;
  const int64_t panel_elems = a.K * kPanel, up = a.N / 2 / kPanel;
  const uint16_t* gate_panel = a.w + p * panel_elems;
  const uint16_t* up_panel = a.w + (p + up) * panel_elems;
  auto at = [](const uint16_t* w) { return reinterpret_cast<const char*>(w); };
  const uint16_t* next = next_p < 0 ? nullptr : a.w + next_p * panel_elems;
  AmxPrefetch next_gate(next ? at(next) : nullptr, panel_elems * 2, m1 - m0, kbytes);
  AmxPrefetch next_up(next ? at(next + up * panel_elems) : nullptr, panel_elems * 2, m1 - m0, kbytes);
  const char* x = reinterpret_cast<const char*>(a.x);
  auto epi = [&](int64_t r0, int64_t r1, int64_t i) {
    silu_epilogue(a, r0, r1, p, c + i * kPanel, cu + i * kPanel);
  };
  amx_deferred_tiles(m0, m1, 4 * (kbytes / 64), 1, epi,
                     [&](int64_t m, int64_t rows, int64_t b0, auto& pending) {
                       const char* xm = x + m * ldx;
                       float *cg = c + b0 * kPanel, *cv = cu + b0 * kPanel;
                       amx_tile<false>(xm, ldx, at(gate_panel), kbytes, rows, cg, next_gate, pending);
                       amx_tile<false>(xm, ldx, at(up_panel), kbytes, rows, cv, next_up, pending);
                       amx_k_tail(a, m, rows, gate_panel, cg);
                       amx_k_tail(a, m, rows, up_panel, cv);
                     });
}

// int8: one projection value per lane of columns n .. n + 15 of activation row m from its
// byte rows' int32 sums ch, cl, as int8_epilogue_t computes it (the int64 dot product, x
// scale, w scale, bias).
PAGEDLLM_BF16_TARGET static inline __m512i wide8(const int32_t* v) {  // 8 int32 -> int64
  return _mm512_cvtepi32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
}
PAGEDLLM_BF16_TARGET static inline __m512 int8_value16(const Int8GemmArgs& a, int64_t m, int64_t n,
                                                      const int32_t* ch, const int32_t* cl) {
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    const int64_t o = 8 * h;
    const __m512i dot = _mm512_sub_epi64(
        _mm512_add_epi64(_mm512_slli_epi64(wide8(ch + o), 8), wide8(cl + o)),
        _mm512_slli_epi64(wide8(a.colsum + n + o), 15));  // 32768 colsum
    half[h] = _mm512_cvtepi64_ps(dot);
  }
  const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
  __m512 v = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.x_scale[m])),
                           _mm512_loadu_ps(a.w_scale + n));
  if (a.bias) v = _mm512_add_ps(v, load16(static_cast<const uint16_t*>(a.bias) + n));
  return v;
}

// Byte rows [m0, m1) (both even) of output panel p from the gate and up int32 sums cg, cu
// (kPanel a row).
PAGEDLLM_BF16_TARGET static void int8_silu_epilogue(const Int8GemmArgs& a, int64_t m0, int64_t m1,
                                                    int64_t p, const int32_t* cg,
                                                    const int32_t* cu) {
  static_assert(kInt16Zero == 1 << 15, "int8_value16 shifts colsum by 15");
  const int64_t n0 = p * kPanel, half = a.N / 2;
  for (int64_t b = m0; b < m1; b += 2) {
    const int64_t m = b / 2;
    uint16_t* out = static_cast<uint16_t*>(a.out) + m * a.ldo + n0;
    for (int64_t j = 0; j < kPanel; j += 16) {
      const int64_t r = (b - m0) * kPanel + j;
      const __m512 g = int8_value16(a, m, n0 + j, cg + r, cg + r + kPanel);
      const __m512 u = int8_value16(a, m, half + n0 + j, cu + r, cu + r + kPanel);
      store16(out + j, silu_mul16(round16(g), round16(u)));
    }
  }
}

// Output panel p for rows [m0, m1) (at most kRowBlock) on gemm_int8.h's VNNI kernel.
PAGEDLLM_BF16_TARGET static void gemm_int8_silu_item(const Int8GemmArgs& a, int64_t m0, int64_t m1,
                                                     int64_t p, int32_t* c) {
  alignas(64) int32_t cu[kRowBlock * kPanel];
  const int64_t up = p + a.N / 2 / kPanel;
  prefetch_int8_epilogue(a, p);
  prefetch_int8_epilogue(a, up);
  gemm_int8_sums_vnni(a, m0, m1, p, c);
  gemm_int8_sums_vnni(a, m0, m1, up, cu);
  int8_silu_epilogue(a, m0, m1, p, c, cu);
}

}  // namespace pagedllm
