// int8 linear layers: int8 weights, activations quantized per row on the fly to 16 bits
// (W8A16, dynamic per token), exact integer dot products. Kernels on one layout: AVX512-VNNI
// (vpdpbusd on byte rows, below; or vpdpwssd on one row's int16 values, row_i16_vnni) and
// AVX2 (vpmaddwd on int16, for CPUs without AVX512-VNNI); all of them (and gemm_amx.h's tiles)
// compute the same int32 sums.
//
// Weights: q[n, k] int8 with a float32 scale per output channel (layers/quantization.py),
// packed [N_pad / 64][K_pad / 4][64][4]: a "panel" of 64 output channels over all of K, each
// k-quad holding 64 x 4 consecutive values (output n, inputs 4 kq .. 4 kq + 3), i.e. four
// 64-byte vectors that vpdpbusd multiplies by a broadcast quad of x. K is padded with zero
// weights to a multiple of 4. colsum[n] = sum_k q[n, k].
//
// Activations: each row of x (bf16 or fp32) is quantized symmetrically to int16 over its
// largest magnitude a: inv = 32767 / a, x16 = clamp(rint(x * inv), -32767, 32767), scale =
// a / 32767 (x ~= scale * x16). The kernels multiply bytes, so a row travels as two uint8 rows
// of u = x16 + 32768: its high bytes (u >> 8, row 2 m) and its low bytes (u & 255, row
// 2 m + 1). Their int32 sums S_hi, S_lo against q are exact (|S| <= K * 255 * 127 fits for
// K <= 65536), and
//   y[m, n] = float(256 S_hi + S_lo - 32768 colsum[n]) * scale[m] * wscale[n] + bias[n],
// the combination in int64 (exact), so a row's result depends on that row alone, whatever
// the batch or the kernel. 16 bits rather than 8 keep the activations' rounding well below
// the weights' (on SmolLM2-135M-Instruct, uint8 rows kept 92% of bf16's greedy tokens,
// int16 ones 96%: BENCHMARKS.md). `quantize_activations` in layers/quantization.py computes the
// same values in PyTorch (the reference).
//
// Work is split as in gemm.h: (row block) x (panel) items over ATen's threads, on the byte
// rows (2 M of them: every row block even, so a row's two byte rows stay together).
#pragma once

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "gemm.h"

#define PAGEDLLM_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

namespace pagedllm {

constexpr int64_t kQuadChunk = 768;  // k-quads per chunk: a 192 KB int8 panel chunk
constexpr int64_t kMaxInt8K = 65536;  // |sum| <= K * 255 * 127 must fit in int32
constexpr int64_t kInt16Zero = 32768;  // u = x16 + kInt16Zero

struct Int8GemmArgs {
  const uint8_t* xq;      // [M, ldx] byte rows (K_pad used): row 2 m high bytes, 2 m + 1 low
  const float* x_scale;   // [M / 2]: a scale per activation row
  int64_t M, Kq, ldx;     // M: byte rows (2 per activation row); Kq: k-quads (K_pad / 4)
  const int8_t* w;        // packed panels
  const float* w_scale;   // [N]
  const int32_t* colsum;  // [N_pad]
  const void* bias;       // [N] in x's dtype, or nullptr
  int64_t N;
  void* out;              // [M, ldo] fp32 (out_fp32) or x's dtype
  bool out_fp32;
  int64_t ldo;
};

// One row of x (K values) -> its high and low byte rows hi, lo (K_pad bytes each, padding
// zeroed: the padding weights are zero) and its scale.
template <class E>
static inline __attribute__((always_inline)) void quantize_row_i16_t(
    const typename E::T* x, int64_t K, int64_t K_pad, uint8_t* hi, uint8_t* lo, float* scale) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(E::load(x[k])));
  if (!(amax > 0.f)) amax = 1.f;
  const float inv = 32767.f / amax;
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::min(32767.f, std::max(-32767.f, std::nearbyint(E::load(x[k]) * inv)));
    const int32_t u = static_cast<int32_t>(q) + static_cast<int32_t>(kInt16Zero);
    hi[k] = static_cast<uint8_t>(u >> 8);
    lo[k] = static_cast<uint8_t>(u & 255);
  }
  for (int64_t k = K; k < K_pad; ++k) hi[k] = lo[k] = 0;
  *scale = amax / 32767.f;
}

// 16 bytes b (vpmovdb's result) to p, the lanes of m. The empty asm keeps b in a register:
// GCC otherwise folds the conversion into vpmovdb's store form, which on Zen 4 took ~2/3 of
// quantize_row_i16_avx512's time (perf annotate, int8 batch-1 decode).
PAGEDLLM_AVX512_TARGET static inline void store_bytes16(uint8_t* p, __mmask16 m, __m128i b) {
  asm("" : "+v"(b));
  if (m == 0xFFFF)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  else
    _mm_mask_storeu_epi8(p, m, b);
}

// quantize_row_i16_t on 16 lanes at a time (AVX-512): the same float steps (an IEEE division
// for inv, x * inv rounded half to even, the clamp), so the same bytes. GCC leaves the scalar
// loop unvectorized (nearbyint and the two byte stores): ~3 us for a 1,536-wide row, where a
// batch-1 decode step of SmolLM2 quantizes 121 rows (~0.25 ms of a ~5 ms int8 step).
template <class V>
PAGEDLLM_AVX512_TARGET static void quantize_row_i16_avx512(const V* x, int64_t K, int64_t K_pad,
                                                           uint8_t* hi, uint8_t* lo, float* scale) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)  // a NaN lane keeps vmax (max_ps returns its second operand)
    vmax = _mm512_max_ps(_mm512_and_ps(load16(x + k, lanes16(k, K)), magnitude), vmax);
  float amax = _mm512_reduce_max_ps(vmax);
  if (!(amax > 0.f)) amax = 1.f;
  const __m512 inv = _mm512_set1_ps(32767.f / amax);
  const __m512 top = _mm512_set1_ps(32767.f), bottom = _mm512_set1_ps(-32767.f);
  const __m512i zero = _mm512_set1_epi32(static_cast<int32_t>(kInt16Zero));
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes16(k, K);
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + k, m), inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // A NaN lane becomes -32767, as std::max(-32767.f, NaN) in the scalar loop.
    const __m512 q = _mm512_min_ps(_mm512_max_ps(r, bottom), top);
    const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), zero);
    store_bytes16(hi + k, m, _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
    store_bytes16(lo + k, m, _mm512_cvtepi32_epi8(u));
  }
  for (int64_t k = K; k < K_pad; ++k) hi[k] = lo[k] = 0;
  *scale = amax / 32767.f;
}

// An activation row's exact dot product from its byte rows' sums (wrapping-free in int64).
static inline __attribute__((always_inline)) int64_t int16_dot(int32_t s_hi, int32_t s_lo,
                                                               int32_t colsum) {
  return 256 * int64_t{s_hi} + s_lo - kInt16Zero * int64_t{colsum};
}

// The epilogue of byte rows [m0, m1) (both even) x panel p from their int32 sums c (kPanel a
// row): the rows' dot products, scales, bias, store; the reference's float steps in its order.
template <class E>
static inline __attribute__((always_inline)) void int8_epilogue_t(
    const Int8GemmArgs& a, int64_t m0, int64_t m1, int64_t p, const int32_t* c) {
  const int64_t n0 = p * kPanel, valid = std::min(a.N - n0, kPanel);
  const auto* bias = static_cast<const typename E::T*>(a.bias) + (a.bias ? n0 : 0);
  const float* ws = a.w_scale + n0;
  const int32_t* colsum = a.colsum + n0;
  for (int64_t b = m0; b < m1; b += 2) {
    const int32_t* ch = c + (b - m0) * kPanel;
    const int32_t* cl = ch + kPanel;
    const int64_t m = b / 2;
    const float xs = a.x_scale[m];
    float v[kPanel];
#pragma omp simd
    for (int64_t j = 0; j < valid; ++j)
      v[j] = static_cast<float>(int16_dot(ch[j], cl[j], colsum[j])) * xs * ws[j];
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < valid; ++j) v[j] = v[j] + E::load(bias[j]);
    }
    if (a.out_fp32) {
      float* o = static_cast<float*>(a.out) + m * a.ldo + n0;
      for (int64_t j = 0; j < valid; ++j) o[j] = v[j];
    } else {
      typename E::T* o = static_cast<typename E::T*>(a.out) + m * a.ldo + n0;
#pragma omp simd
      for (int64_t j = 0; j < valid; ++j) o[j] = E::store(v[j]);
    }
  }
}

// Panel p's weight scales and column sums (256 bytes each), fetched while its sums run: they
// are the epilogue's only reads from memory, and a batch-1 product that waited on them at
// every panel drew 9-13 GB/s of weights against 13-16 with them in cache.
static inline void prefetch_int8_epilogue(const Int8GemmArgs& a, int64_t p) {
  for (int64_t b = 0; b < kPanel * 4; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(a.w_scale + p * kPanel) + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.colsum + p * kPanel) + b, _MM_HINT_T0);
  }
}

#define PAGEDLLM_INT8_ROWS(E)                                                                 \
  PAGEDLLM_CLONES static void quantize_row_i16(const E::T* x, int64_t K, int64_t K_pad,        \
                                               uint8_t* hi, uint8_t* lo, float* scale) {      \
    quantize_row_i16_t<E>(x, K, K_pad, hi, lo, scale);                                        \
  }                                                                                           \
  PAGEDLLM_CLONES static void int8_epilogue(const Int8GemmArgs& a, E, int64_t m0, int64_t m1,  \
                                            int64_t p, const int32_t* c) {                    \
    int8_epilogue_t<E>(a, m0, m1, p, c);                                                      \
  }
PAGEDLLM_INT8_ROWS(Bf16)
PAGEDLLM_INT8_ROWS(Fp32)
#undef PAGEDLLM_INT8_ROWS

// acc += u8 quads of x . s8 quads of w (vpdpbusd). Inline assembly rather than the intrinsic:
// with `_mm512_dpbusd_epi32` GCC copies every accumulator through a spare register and the
// stack on each step (its __m512i is a vector of 64-bit lanes, the builtin's of 32-bit ones),
// which made the 6-row tile ~3x slower than the bf16 one.
PAGEDLLM_VNNI_TARGET static inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "vm"(w));
  return acc;
}

// A one-row product's panel stream with a non-temporal prefetch kNtaAhead bytes ahead, on AMD
// Zen 5. There it drew more of the memory's bandwidth (40 gate / up-shaped products in a row:
// 34 GB/s of weights against 23-29 without), and int8 batch-1 decode ran 1.05-1.09x faster
// with it, alternated in one process (1,024 to 8,192 bytes ahead all helped; BENCHMARKS.md).
// It does not keep the rest of the step in cache: a small op after such a stream still takes
// 15-25 us, against ~1 us warm. On Zen 4 (family 25) the same decode ran 0.96x as fast with it
// (15 rounds alternated), so it is on from family 26 only; Intel CPUs are unmeasured. The
// bf16 one-row kernel gained 0-4% on Zen 5 (within the noise), so it has none.
// PAGEDLLM_CPU_INT8_ROW_STREAM=1/0 overrides the choice (build.py's cpu_ops(), through the
// cpu_int8_row_stream op); the tests run both.
constexpr int64_t kNtaAhead = 2048;
static std::atomic<bool>& int8_row_stream() {
  static std::atomic<bool> on{[] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned family = ((eax >> 8) & 0xF) + ((eax >> 20) & 0xFF);
    return family >= 26;
  }()};
  return on;
}

// c[MT][64] (+)= sum over nkq k-quads of xq rows x panel chunk w, in int32; `stream`: the
// one-row product's prefetch (above).
template <int MT, bool stream = false>
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
    if constexpr (stream)
      for (int b = 0; b < 4 * kPanel; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kNtaAhead + b, _MM_HINT_NTA);
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

// Whether a single activation row takes row_i16_vnni (below) rather than its two byte rows on
// micro_u8s8: the same bits either way. Off by default: with the engine's kernels the byte
// rows were the faster on both kinds of CPU measured, an AMX Xeon (1.2-1.3x a pass over
// SmolLM2's weights) and AMD Zen 5 (1.15-1.4x a product, BENCHMARKS.md), although on Zen 5 a
// leaner vpdpwssd probe kernel (scripts/int8_kernels_probe.py) once beat them. A software
// prefetch of the panel brought this kernel level with the byte rows on the Xeon, but on Zen 4
// such prefetches cost a one-row product a third of its bandwidth, so it has none.
// PAGEDLLM_CPU_INT8_ROW_WORDS=1 turns it on (build.py's cpu_ops(), through the
// cpu_int8_row_words op); the tests run both.
static std::atomic<bool>& int8_row_words() {
  static std::atomic<bool> on{false};
  return on;
}

// acc += int16 pairs of x . int16 pairs of w (vpdpwssd); inline assembly as dpbusd.
PAGEDLLM_VNNI_TARGET static inline __m512i dpwssd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// One activation row (byte rows b, b + 1) x panel p as its int16 values x16 = u - 32768
// against the weights widened to int16 (vpdpwssd): one multiply a weight instead of the byte
// rows' two, the panel streamed once (which of the two runs: int8_row_words). The exact dot
// products D come out as the byte rows' sums would: with T = D + 32768 colsum =
// sum_k u q, S_hi = T >> 8 and S_lo = T & 255 (256 S_hi + S_lo = T; |S_hi| < 2^31 for K <=
// 65536), so every epilogue takes them unchanged and the bits are the byte rows' bits.
constexpr int64_t kI16Chunk = 128;  // k-quads a chunk: |lane| <= 2 * 128 * 32767 * 127 < 2^30
PAGEDLLM_VNNI_TARGET static void row_i16_vnni(const Int8GemmArgs& a, int64_t b, int64_t p,
                                              int32_t* c) {
  const uint8_t* hi = a.xq + b * a.ldx;
  const uint8_t* lo = hi + a.ldx;
  const int8_t* panel = a.w + p * a.Kq * 4 * kPanel;
  __m512i dot[8];  // int64: vector v holds outputs 8 v .. 8 v + 7
  for (int v = 0; v < 8; ++v) dot[v] = _mm512_setzero_si512();
  alignas(64) int16_t x16[4 * kI16Chunk];
  for (int64_t kq0 = 0; kq0 < a.Kq; kq0 += kI16Chunk) {
    const int64_t nkq = std::min(kI16Chunk, a.Kq - kq0), k0 = 4 * kq0;
    for (int64_t t = 0; t < 4 * nkq; t += 32) {  // x16 = (hi << 8 | lo) ^ 0x8000
      const int64_t left = 4 * nkq - t;  // a masked tail: the byte rows end at K_pad
      const __mmask32 keep = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      const __m512i h = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(keep, hi + k0 + t));
      const __m512i l = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(keep, lo + k0 + t));
      _mm512_store_si512(x16 + t, _mm512_xor_si512(_mm512_or_si512(_mm512_slli_epi16(h, 8), l),
                                                   _mm512_set1_epi16(-32768)));
    }
    __m512i acc[8];
    for (int v = 0; v < 8; ++v) acc[v] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < nkq; ++kq) {
      int64_t quad;
      std::memcpy(&quad, x16 + 4 * kq, 8);
      const __m512i xb = _mm512_set1_epi64(quad);  // lanes: (x0, x1), (x2, x3), ...
      const int8_t* wk = panel + (kq0 + kq) * 4 * kPanel;
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {  // 8 outputs x 4 weights: lanes 2 i (k0, k1), 2 i + 1
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * v)));
        acc[v] = dpwssd(acc[v], xb, wv);
      }
    }
    for (int v = 0; v < 8; ++v)  // each output's two lanes, sign-extended, into its int64
      dot[v] = _mm512_add_epi64(dot[v], _mm512_add_epi64(_mm512_srai_epi64(acc[v], 32),
                                                         _mm512_srai_epi64(_mm512_slli_epi64(acc[v], 32), 32)));
  }
  for (int v = 0; v < 8; ++v) {
    const __m512i t = _mm512_add_epi64(
        dot[v], _mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(a.colsum + p * kPanel + 8 * v))),
                                  15));  // + 32768 colsum
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 8 * v), _mm512_cvtepi64_epi32(_mm512_srai_epi64(t, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + kPanel + 8 * v),
                        _mm512_cvtepi64_epi32(_mm512_and_si512(t, _mm512_set1_epi64(255))));
  }
}

// Rows [m0, m1) x panel p: K-chunks, 6-row tiles; the int32 sums land in c. A single
// activation row (two byte rows) takes row_i16_vnni.
PAGEDLLM_VNNI_TARGET static void gemm_int8_sums_vnni(const Int8GemmArgs& a, int64_t m0,
                                                     int64_t m1, int64_t p, int32_t* c) {
  const bool one_row = m1 - m0 == 2;
  if (one_row && int8_row_words().load(std::memory_order_relaxed)) return row_i16_vnni(a, m0, p, c);
  const bool stream = one_row && int8_row_stream().load(std::memory_order_relaxed);
  for (int64_t kq0 = 0; kq0 < a.Kq; kq0 += kQuadChunk) {
    const int64_t nkq = std::min(kQuadChunk, a.Kq - kq0);
    const int8_t* panel = a.w + (p * a.Kq + kq0) * 4 * kPanel;
    if (stream) {
      micro_u8s8<2, true>(a.xq + m0 * a.ldx + 4 * kq0, a.ldx, panel, nkq, c, kq0 > 0);
      continue;
    }
    for (int64_t m = m0; m < m1; m += kRowTile)
      micro_u8s8_dispatch(std::min(kRowTile, m1 - m), a.xq + m * a.ldx + 4 * kq0, a.ldx, panel,
                          nkq, c + (m - m0) * kPanel, kq0 > 0);
  }
}

// ---- AVX2 -------------------------------------------------------------------------------
// vpmaddwd multiplies int16 pairs exactly into int32: a k-quad's 16 bytes for 4 outputs
// (4 x 4 weights, sign-extended) times the row's quad (zero-extended, repeated 4 times) gives
// each output's two pair sums side by side, folded by hadd. One row (decode): all 64 outputs
// in one pass, so the panel streams in order (see row64_u8s8_avx2). Tiles of 3 rows: 4 passes of 16 outputs (12
// accumulators), each weight vector widened once for the 3 rows; a 64-quad chunk of the panel
// (16 KB) stays in L1 over the passes and the tiles.

constexpr int64_t kQuadChunkAvx2 = 64;
constexpr int64_t kRowTileAvx2 = 3;

// c[MT][64] (+)= sums over nkq k-quads of xq rows x panel chunk w; the pair sums are folded
// at the end.
template <int MT>
PAGEDLLM_AVX2_TARGET static inline void micro_u8s8_avx2(const uint8_t* x, int64_t ldx,
                                                        const int8_t* w, int64_t nkq, int32_t* c,
                                                        bool load_c) {
  constexpr int NG = 4;
  for (int pass = 0; pass < 16 / NG; ++pass) {
    __m256i acc[MT][NG];
    for (int m = 0; m < MT; ++m)
      for (int g = 0; g < NG; ++g) acc[m][g] = _mm256_setzero_si256();
    const int8_t* wp = w + pass * NG * 16;
    for (int64_t kq = 0; kq < nkq; ++kq) {
      const int8_t* wk = wp + kq * 4 * kPanel;
      __m256i xb[MT];
      for (int m = 0; m < MT; ++m) {
        int32_t quad;
        std::memcpy(&quad, x + m * ldx + 4 * kq, 4);
        xb[m] = _mm256_cvtepu8_epi16(_mm_set1_epi32(quad));
      }
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) {
        const __m256i wv =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16 * g)));
        for (int m = 0; m < MT; ++m)
          acc[m][g] = _mm256_add_epi32(acc[m][g], _mm256_madd_epi16(wv, xb[m]));
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int g = 0; g < NG; g += 2) {
        // Lanes [n0 n0 n1 n1 | n2 n2 n3 n3] and [n4 ..]: hadd -> [n0 n1 n4 n5 | n2 n3 n6 n7].
        const __m256i s = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[m][g], acc[m][g + 1]),
                                                   0xD8);
        __m256i* cg = reinterpret_cast<__m256i*>(c + m * kPanel + 4 * (pass * NG + g));
        _mm256_storeu_si256(cg, load_c ? _mm256_add_epi32(s, _mm256_loadu_si256(cg)) : s);
      }
  }
}

// One row x all 64 outputs in one pass, the panel streamed in order (prefetched ahead). A
// 32-byte load holds 8 outputs x 4 weights; shifts split it into the sign-extended even bytes
// (weights k0, k2 of each output) and odd bytes (k1, k3) as int16, and vpmaddwd against
// (x0, x2) and (x1, x3) pairs leaves each output's whole k-quad sum in its own int32 lane:
// no widening shuffles, no folding.
PAGEDLLM_AVX2_TARGET static inline void row64_u8s8_avx2(const uint8_t* x, const int8_t* w,
                                                        int64_t nkq, int32_t* c, bool load_c) {
  __m256i acc[8];
  for (int g = 0; g < 8; ++g) acc[g] = _mm256_setzero_si256();
  for (int64_t kq = 0; kq < nkq; ++kq) {
    const int8_t* wk = w + kq * 4 * kPanel;
    for (int64_t b = 0; b < 4 * kPanel; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kStreamPrefetch + b, _MM_HINT_T0);
    const uint8_t* xk = x + 4 * kq;
    const __m256i x02 = _mm256_set1_epi32(xk[0] | (xk[2] << 16));
    const __m256i x13 = _mm256_set1_epi32(xk[1] | (xk[3] << 16));
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * g));
      const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
      const __m256i odd = _mm256_srai_epi16(v, 8);
      acc[g] = _mm256_add_epi32(acc[g], _mm256_add_epi32(_mm256_madd_epi16(even, x02),
                                                         _mm256_madd_epi16(odd, x13)));
    }
  }
  for (int g = 0; g < 8; ++g) {
    __m256i* cg = reinterpret_cast<__m256i*>(c + 8 * g);
    _mm256_storeu_si256(cg, load_c ? _mm256_add_epi32(acc[g], _mm256_loadu_si256(cg)) : acc[g]);
  }
}

PAGEDLLM_AVX2_TARGET static void gemm_int8_sums_avx2(const Int8GemmArgs& a, int64_t m0,
                                                     int64_t m1, int64_t p, int32_t* c) {
  for (int64_t kq0 = 0; kq0 < a.Kq; kq0 += kQuadChunkAvx2) {
    const int64_t nkq = std::min(kQuadChunkAvx2, a.Kq - kq0);
    const int8_t* panel = a.w + (p * a.Kq + kq0) * 4 * kPanel;
    int64_t m = m0;
    for (; m + kRowTileAvx2 <= m1; m += kRowTileAvx2)
      micro_u8s8_avx2<kRowTileAvx2>(a.xq + m * a.ldx + 4 * kq0, a.ldx, panel, nkq,
                                    c + (m - m0) * kPanel, kq0 > 0);
    for (; m < m1; ++m)
      row64_u8s8_avx2(a.xq + m * a.ldx + 4 * kq0, panel, nkq, c + (m - m0) * kPanel, kq0 > 0);
  }
}

}  // namespace pagedllm
