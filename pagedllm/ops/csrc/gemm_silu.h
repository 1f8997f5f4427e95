// The MLP's gate / up projection with SiLU x mul in its epilogue (ops.cpp's linear_silu_mul):
// for a bf16 panel weight of 2 I rows, the gate rows then the up rows (I a multiple of 64),
// output channels 64 p .. 64 p + 63 come from gate panel p and up panel p + I / 64, both
// computed in the same work item; the epilogue rounds each sum to bf16 (as the projection
// stores it) and applies silu_mul16 (as silu_and_mul's row does), so the result is the same
// bits as silu_and_mul(linear(x, w)) without the [M, 2 I] intermediate. The point is where
// SiLU's exps run: inside the GEMM's items, where on a core whose hyperthreads share one AMX
// unit one thread's vector work overlaps the other's tile products, instead of in a pass of
// its own (~15% of a prefill's MLP time at 1.3 ns a row element).
#pragma once

#include "elementwise.h"
#include "gemm_amx.h"

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

// The same on AMX tiles, 32 rows at a time as gemm_item_amx; next_p: the output panel of the
// thread's next item (-1: none), whose gate and up panels are prefetched.
PAGEDLLM_AMX_TARGET static void gemm_silu_item_amx(const GemmArgs& a, int64_t m0, int64_t m1,
                                                   int64_t p, float* c, int64_t next_p) {
  alignas(64) float cu[2 * kAmxRows * kPanel];
  const int64_t K32 = a.K / kAmxK * kAmxK, kbytes = K32 * 2, ldx = a.ldx * 2;
  const int64_t panel_elems = a.K * kPanel, up = a.N / 2 / kPanel;
  const uint16_t* gate_panel = a.w + p * panel_elems;
  const uint16_t* up_panel = a.w + (p + up) * panel_elems;
  auto at = [](const uint16_t* w) { return reinterpret_cast<const char*>(w); };
  const uint16_t* next = next_p < 0 ? nullptr : a.w + next_p * panel_elems;
  AmxPrefetch next_gate(next ? at(next) : nullptr, panel_elems * 2, m1 - m0, kbytes);
  AmxPrefetch next_up(next ? at(next + up * panel_elems) : nullptr, panel_elems * 2, m1 - m0, kbytes);
  const char* x = reinterpret_cast<const char*>(a.x);
  for (int64_t m = m0; m < m1; m += 2 * kAmxRows) {
    const int64_t rows = std::min(2 * kAmxRows, m1 - m);
    amx_tile<false>(x + m * ldx, ldx, at(gate_panel), kbytes, rows, c, next_gate);
    amx_tile<false>(x + m * ldx, ldx, at(up_panel), kbytes, rows, cu, next_up);
    amx_k_tail(a, m, rows, gate_panel, c);
    amx_k_tail(a, m, rows, up_panel, cu);
    silu_epilogue(a, m, m + rows, p, c, cu);
  }
}

}  // namespace pagedllm
