// The AVX-512 peaks one core reaches on its own: vdpbf16ps (16 lanes, two bf16 products each:
// 64 FLOP an instruction) against vfmadd231ps (16 fp32 products: 32 FLOP), each on 24
// independent accumulators (more than latency x throughput), best of 5. Says whether this
// CPU's bf16 dot product is the faster of the two (AMD Zen 4/5: twice the FLOPs of the fp32
// FMA) or the slower (the Intel Xeon of BENCHMARKS.md: half), which decides what pagedllm's
// AVX-512 BF16 GEMMs (gemm.h) can reach here next to oneDNN's.
//
//   gcc -O2 -mavx512f -mavx512bf16 -mfma -o /tmp/vector_dot_peak scripts/vector_dot_peak.c
//   taskset -c 0 /tmp/vector_dot_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

enum { kChains = 24 };
static const long kIters = 4000000;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Seconds for kIters x kChains vdpbf16ps.
static double time_dpbf16(float* sink) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps((float)i);
  __m512bh w = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1)
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  const double t0 = now();
  for (long k = 0; k < kIters; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], w, x);
    __asm__ volatile("" : "+v"(w));  // keeps the loop from being folded
  }
  const double t = now() - t0;
  for (int i = 0; i < kChains; ++i) *sink += acc[i][0];
  return t;
}

// Seconds for kIters x kChains vfmadd231ps.
static double time_fma(float* sink) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps((float)i);
  __m512 a = _mm512_set1_ps(1.0001f);
  const __m512 b = _mm512_set1_ps(0.9999f);
  const double t0 = now();
  for (long k = 0; k < kIters; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  const double t = now() - t0;
  for (int i = 0; i < kChains; ++i) *sink += acc[i][0];
  return t;
}

int main(void) {
  float sink = 0;
  double best_dp = 1e9, best_fma = 1e9;
  for (int rep = 0; rep < 5; ++rep) {  // alternated
    const double dp = time_dpbf16(&sink), fma = time_fma(&sink);
    best_dp = dp < best_dp ? dp : best_dp;
    best_fma = fma < best_fma ? fma : best_fma;
  }
  const double n = (double)kIters * kChains;
  printf("vdpbf16ps   %.3f ns an instruction, %6.1f GFLOP/s\n", best_dp / n * 1e9,
         n * 64 / best_dp / 1e9);
  printf("vfmadd231ps %.3f ns an instruction, %6.1f GFLOP/s\n", best_fma / n * 1e9,
         n * 32 / best_fma / 1e9);
  printf("bf16 dot / fp32 FMA FLOP rate: %.2f\n", (n * 64 / best_dp) / (n * 32 / best_fma));
  return sink == 1.2345f;  // uses the sums
}
