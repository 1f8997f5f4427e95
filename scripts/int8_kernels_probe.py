"""Probe (AVX-512 VNNI CPUs): one-row int8 kernels that keep more of the activations' precision
than W8A8 did, against the engine's int8 kernel and the bf16 panels, on SmolLM2's 120 products (30 layers of
random weights, from memory; `hot` reuses one layer's, to see each kernel's compute ceiling).

    python scripts/int8_kernels_probe.py [ROUNDS] [hot]

- "weight-only quads" / "k-major": fp32 FMAs on int8 weights widened in registers (activations
  in fp32, exact products), on today's [64][4] quad panels or on [K][64] panels;
- "W8A16 vpdpwssd": activations as symmetric int16 per row, weights sign-extended to int16 in
  registers, int32 sums in chunks of 512 inputs flushed to fp32;
- "linear_int8, words" / "linear_int8, byte rows": the engine's W8A16 kernel (gemm_int8.h) on
  one row as int16 words (vpdpwssd) or as its two byte rows (vpdpbusd), the cpu_int8_row_words
  switch (the same bits; which is faster depends on the CPU).
The probe kernels are built here (torch's load_inline), statically split over the threads;
their activations are converted before timing. Accuracy of each scheme: int8_schemes.py.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops

sys.path.insert(0, str(Path(__file__).parent))
from cpu_projections import LAYERS, SHAPES  # noqa: E402

src = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <algorithm>
#define T __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
// quads: w [P][Kq][64][4]; one panel, x fp32 [4 Kq]
T static void panel_quads(const int8_t* w, const float* x, int64_t Kq, float* y) {
  __m512 a[4][2];
  for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  for (int64_t kq = 0; kq < Kq; ++kq) {
    const int8_t* wk = w + kq * 256;
    const __m512 x0 = _mm512_set1_ps(x[4 * kq]), x1 = _mm512_set1_ps(x[4 * kq + 1]);
    const __m512 x2 = _mm512_set1_ps(x[4 * kq + 2]), x3 = _mm512_set1_ps(x[4 * kq + 3]);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(wk + 64 * j);
      const __m512 e0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
      const __m512 e1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
      const __m512 e2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24));
      const __m512 e3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
      a[j][0] = _mm512_fmadd_ps(e0, x0, a[j][0]);
      a[j][1] = _mm512_fmadd_ps(e1, x1, a[j][1]);
      a[j][0] = _mm512_fmadd_ps(e2, x2, a[j][0]);
      a[j][1] = _mm512_fmadd_ps(e3, x3, a[j][1]);
    }
  }
  for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + 16 * j, _mm512_add_ps(a[j][0], a[j][1]));
}
// k-major: w [P][K][64]
T static void panel_kmajor(const int8_t* w, const float* x, int64_t K, float* y) {
  __m512 a[4][2];
  for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const int8_t* wk = w + k * 64;
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    for (int j = 0; j < 4; ++j) {
      const __m512 e0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wk + 16 * j))));
      const __m512 e1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wk + 64 + 16 * j))));
      a[j][0] = _mm512_fmadd_ps(e0, x0, a[j][0]);
      a[j][1] = _mm512_fmadd_ps(e1, x1, a[j][1]);
    }
  }
  for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + 16 * j, _mm512_add_ps(a[j][0], a[j][1]));
}
#define T2 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")))
T2 static inline __m512i dpwssd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}
// W8A16: quads w [P][Kq][64][4] int8, x int16 [4 Kq]; int32 sums in chunks of 128 quads
// (512 k: |sum| <= 512 * 32767 * 127 < 2^31), flushed to fp32.
T2 static void panel_w8a16(const int8_t* w, const int16_t* x, int64_t Kq, float* y) {
  __m512 f[8];
  for (int i = 0; i < 8; ++i) f[i] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < Kq; c0 += 128) {
    __m512i a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_si512();
    const int64_t c1 = std::min<int64_t>(Kq, c0 + 128);
    for (int64_t kq = c0; kq < c1; ++kq) {
      int64_t quad;
      std::memcpy(&quad, x + 4 * kq, 8);
      const __m512i xb = _mm512_set1_epi64(quad);
      const int8_t* wk = w + kq * 256;
      for (int j = 0; j < 4; ++j) {
        const __m512i lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wk + 64 * j)));
        const __m512i hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wk + 64 * j + 32)));
        a[2 * j] = dpwssd(a[2 * j], xb, lo);
        a[2 * j + 1] = dpwssd(a[2 * j + 1], xb, hi);
      }
    }
    for (int i = 0; i < 8; ++i) f[i] = _mm512_add_ps(f[i], _mm512_cvtepi32_ps(a[i]));
  }
  alignas(64) float t[128];
  for (int i = 0; i < 8; ++i) _mm512_store_ps(t + 16 * i, f[i]);
  // vector 2j + h holds outputs 16j + 8h + l / 2, lanes l = 2i (k0, k1) and 2i + 1 (k2, k3)
  for (int o = 0; o < 64; ++o) {
    const int j = o / 16, h = (o % 16) / 8, i = o % 8;
    y[o] = t[16 * (2 * j + h) + 2 * i] + t[16 * (2 * j + h) + 2 * i + 1];
  }
}
// y[n] = panel sums (panel(p, acc) fills 64) x xs x scale[n], the panels split over the threads.
template <class Panel>
torch::Tensor panel_rows(int64_t n, float xs, const torch::Tensor& scale, Panel&& panel) {
  at::Tensor y = at::empty({n}, scale.options());
  float* yp = y.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b, int64_t e) {
    alignas(64) float acc[64];
    for (int64_t p = b; p < e; ++p) {
      panel(p, acc);
      for (int i = 0; i < 64 && p * 64 + i < n; ++i) yp[p * 64 + i] = acc[i] * xs * sp[p * 64 + i];
    }
  });
  return y;
}
torch::Tensor w8a16_row(torch::Tensor xq, double xs, torch::Tensor w, torch::Tensor scale, int64_t n) {
  const int64_t K = xq.size(0);
  const int8_t* wp = w.data_ptr<int8_t>();
  const int16_t* xp = xq.data_ptr<int16_t>();
  return panel_rows(n, xs, scale, [&](int64_t p, float* acc) { panel_w8a16(wp + p * K * 64, xp, K / 4, acc); });
}
torch::Tensor wo_row(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t n, bool kmajor) {
  const int64_t K = x.size(0);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* xp = x.data_ptr<float>();
  return panel_rows(n, 1.f, scale, [&](int64_t p, float* acc) {
    if (kmajor)
      panel_kmajor(wp + p * K * 64, xp, K, acc);
    else
      panel_quads(wp + p * K * 64, xp, K / 4, acc);
  });
}
"""
m = load_inline(
    "wo_probe",
    cpp_sources=src,
    functions=["wo_row", "w8a16_row"],
    extra_cflags=["-O3", "-fopenmp"],
    extra_ldflags=["-fopenmp"],
)
ops = torch.ops.pagedllm
cpu_ops()


def kmajor(q):  # [n, k] -> [P][K][64]
    n, k = q.shape
    return q.view(n // 64, 64, k).transpose(1, 2).contiguous()


HOT = len(sys.argv) > 2  # one layer's weights for all 30: served from cache


def make_layer() -> list[dict]:
    layer = []
    for n, k in SHAPES:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        layer.append(
            dict(
                n=n,
                k=k,
                quads=to_panels(q),
                km=kmajor(q),
                scale=torch.rand(n) * 1e-3,
                colsum=q.sum(dim=1, dtype=torch.int32),
                bf=to_panels((q.float() * 1e-3).bfloat16()),
            )
        )
    return layer


layers = [make_layer()] * LAYERS if HOT else [make_layer() for _ in range(LAYERS)]
xs = {k: torch.randn(1, k).bfloat16() for _, k in SHAPES}
xf = {k: v[0].float() for k, v in xs.items()}
xq16 = {}
for k, v in xf.items():
    s16 = v.abs().max().item() / 32767
    xq16[k] = ((v / s16).round().to(torch.int16), s16)

# The probe kernels against fp32 products on one gate / up weight.
d = layers[0][2]
want = (xf[d["k"]] @ d["km"].transpose(1, 2).reshape(d["n"], d["k"]).float().T) * d["scale"]
probes = {
    "quads": m.wo_row(xf[d["k"]], d["quads"], d["scale"], d["n"], False),
    "kmajor": m.wo_row(xf[d["k"]], d["km"], d["scale"], d["n"], True),
    "w8a16": m.w8a16_row(*xq16[d["k"]], d["quads"], d["scale"], d["n"]),
}
for name, got in probes.items():
    print(f"probe {name} max rel err {((got - want).abs().max() / want.abs().max()).item():.2e}")


def engine_int8(d):
    """The engine's kernel; the row's way (words or bytes) is set per case below."""
    return ops.linear_int8(xs[d["k"]], d["quads"], d["scale"], d["colsum"], None, d["n"], False)


cases = {
    "bf16 panels": lambda d: ops.linear(xs[d["k"]], d["bf"], None, d["n"], False),
    "linear_int8, words": engine_int8,
    "weight-only quads": lambda d: m.wo_row(xf[d["k"]], d["quads"], d["scale"], d["n"], False),
    "weight-only k-major": lambda d: m.wo_row(xf[d["k"]], d["km"], d["scale"], d["n"], True),
    "W8A16 vpdpwssd": lambda d: m.w8a16_row(*xq16[d["k"]], d["quads"], d["scale"], d["n"]),
    "linear_int8, byte rows": engine_int8,
}
words = {"linear_int8, words": True, "linear_int8, byte rows": False}
default_words = ops.cpu_int8_row_words(None)
times = {c: [] for c in cases}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
    for c, f in cases.items() if r % 2 else reversed(cases.items()):
        ops.cpu_int8_row_words(words.get(c, default_words))
        t = time.perf_counter()
        for layer in layers:
            for d in layer:
                f(d)
        times[c].append(time.perf_counter() - t)
medians = {c: statistics.median(t[1:]) for c, t in times.items()}  # round 0: warm-up
base = medians["bf16 panels"]
for c, s in medians.items():
    print(f"{c:22s} {s * 1e3:6.2f} ms   vs bf16 {base / s:4.2f}x")
