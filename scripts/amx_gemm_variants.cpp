// One AMX bf16 product (M x N x K, x rows times pagedllm's panels [N / 64][K / 2][64][2]) in
// the shape of gemm_amx.h's items (a row block x one panel; each 32-row tile sweeps K once per
// panel half on 2 x 2 tiles), with one thing changed a variant, to see what moves the tile loop
// on this CPU. The sums are not checked (constant bytes); only the time is. GFLOP/s, median of
// 15 calls, every variant in turn, twice.
//
//   g++ -O3 -fopenmp -march=native -o /tmp/amx_gemm_variants scripts/amx_gemm_variants.cpp
//   OMP_NUM_THREADS=1 /tmp/amx_gemm_variants [M] [N] [K] [ROW_BLOCK]   (4096 960 576 448)
//
// Variants (products; "+epi" ones also finish each 32-row tile: fp32 sums -> bf16 rows):
//   base        the tile loop as gemm_amx.h runs it
//   pf-next     + each k-step prefetches (T0) the next k-step's A and B lines
//   pipelined   a tile's C stores and the next tile's first products interleaved
//   a-hot       A tiles re-read from 2 k-steps only (in L1): what A's reads from L2 cost
//   b-hot       B tiles likewise
//   halves-out  each panel half sweeps all row tiles of the item (B half kept near)
//   kchunk-4    halves-out with K in chunks of 4 k-steps (C spilled to memory between them)
//   b-compact   B tiles 1 KB contiguous (stride 64; the layout's values are not the panel's)
//   ab-compact  A copied tile-wise too (stride 64)
//   +epi inline the epilogue after each tile (what the kernel did before f2a0864)
//   +epi defer  the epilogue a row at each k-step of the next tile (AmxDeferred), its row
//               at the top of the k-step / after the step's tile loads / after its first product
//   +loads only the epilogue's loads alone / +stores only its stores alone (to the output);
//   +stores 2 lines / hot / NT: the same stores to two cache lines, to a 60 KB window of the
//               output, or non-temporal; +epi inline NT: the whole epilogue with NT stores
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

enum Variant { kBase, kLate, kMid,  // kLate, kMid: kBase with the deferred row placed later
               kPfNext, kPipelined, kAHot, kBHot, kHalvesOut, kKChunk4, kBCompact, kABCompact };
enum Epi { kNone, kInline, kDefer, kLoadsOnly, kStoresOnly, kStoresHot, kStoresL1, kStoresNT, kInlineNT };

static int M = 4096, N = 960, K = 576, RB = 448;
static uint16_t *X, *XP, *W, *WP, *O;

struct alignas(64) Cfg {
  uint8_t palette = 1, start = 0, res[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
TARGET static void configure() {
  Cfg c;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

TARGET static inline void epi_row(const float* c, uint16_t* out) {
  for (int j = 0; j < 64; j += 32)
    _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + j + 16), _mm512_loadu_ps(c + j)));
}

// The epilogue of a tile's 32 rows: inline, or deferred a row per k-step of the next tile.
struct Pending {
  const float* c = nullptr;
  uint16_t* out = nullptr;
  int r = 32;
  TARGET inline void step() {
    if (r < 32) epi_row(c + r * 64, out + (int64_t)r * N), ++r;
  }
  TARGET void finish() {
    while (r < 32) step();
  }
};

TARGET static void tile_epilogue(Epi e, const float* c, uint16_t* out, Pending& pend) {
  if (e == kInline) {
    for (int r = 0; r < 32; ++r) epi_row(c + r * 64, out + (int64_t)r * N);
  } else if (e == kDefer) {
    pend.finish();
    pend.c = c, pend.out = out, pend.r = 0;
  } else if (e == kLoadsOnly) {
    __m512 a[4] = {};
    for (int r = 0; r < 32; ++r)
      for (int j = 0; j < 4; ++j) a[j] = _mm512_max_ps(a[j], _mm512_loadu_ps(c + r * 64 + 16 * j));
    _mm512_storeu_ps(reinterpret_cast<float*>(O), _mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3])));
  } else if (e == kStoresHot) {
    for (int r = 0; r < 32; ++r)
      for (int j = 0; j < 64; j += 32) _mm512_storeu_si512(O + (out - O) % 64 + (int64_t)r * N + j, _mm512_set1_epi32(r));
  } else if (e == kStoresL1) {
    for (int r = 0; r < 32; ++r)
      for (int j = 0; j < 64; j += 32) _mm512_storeu_si512(O + j, _mm512_set1_epi32(r));
  } else if (e == kStoresNT) {
    for (int r = 0; r < 32; ++r)
      for (int j = 0; j < 64; j += 32) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + (int64_t)r * N + j), _mm512_set1_epi32(r));
  } else if (e == kInlineNT) {
    for (int r = 0; r < 32; ++r)
      for (int j = 0; j < 64; j += 32)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(out + (int64_t)r * N + j), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + r * 64 + j + 16), _mm512_loadu_ps(c + r * 64 + j)));
  } else if (e == kStoresOnly) {
    for (int r = 0; r < 32; ++r)
      for (int j = 0; j < 64; j += 32) _mm512_storeu_si512(out + (int64_t)r * N + j, _mm512_set1_epi32(r));
  }
}

// One 32-row tile x one panel (both halves), sums into c (64 a row).
template <Variant V>
TARGET static void tile32(int64_t m, int p, float* c, Pending& pend) {
  const int64_t ldx = K * 2, kbytes = K * 2;
  const char* x = reinterpret_cast<const char*>(X + m * K);
  const char* x1 = x + 16 * ldx;
  const char* xp = reinterpret_cast<const char*>(XP + m * K);  // [ksteps][32 rows][64 B]
  const char* panel = reinterpret_cast<const char*>(W + (int64_t)p * K * 64);
  const char* pc = reinterpret_cast<const char*>(WP + (int64_t)p * K * 64);  // [half][kstep][2][1 KB]
  for (int half = 0; half < 2; ++half) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const char* w = panel + half * 128;
    for (int64_t k = 0; k < kbytes; k += 64) {
      if (V != kLate && V != kMid) pend.step();
      const int64_t ka = V == kAHot ? (k & 127) : k, kb = V == kBHot ? (k & 127) : k;
      if (V == kPfNext && k + 64 < kbytes) {
        for (int r = 0; r < 16; ++r) {
          _mm_prefetch(x + r * ldx + k + 64, _MM_HINT_T0); _mm_prefetch(x1 + r * ldx + k + 64, _MM_HINT_T0);
          _mm_prefetch(w + (k + 64) * 64 + r * 256, _MM_HINT_T0); _mm_prefetch(w + (k + 64) * 64 + r * 256 + 64, _MM_HINT_T0);
        }
      }
      if (V == kABCompact) _tile_loadd(4, xp + k * 32, 64); else _tile_loadd(4, x + ka, ldx);
      if (V == kBCompact || V == kABCompact) {
        const char* wk = pc + half * kbytes * 32 + k * 32;
        _tile_loadd(6, wk, 64); _tile_loadd(7, wk + 1024, 64);
      } else {
        _tile_loadd(6, w + kb * 64, 256); _tile_loadd(7, w + kb * 64 + 64, 256);
      }
      _tile_dpbf16ps(0, 4, 6);
      if (V == kMid) pend.step();
      _tile_dpbf16ps(1, 4, 7);
      if (V == kABCompact) _tile_loadd(5, xp + k * 32 + 1024, 64); else _tile_loadd(5, x1 + ka, ldx);
      if (V == kLate) pend.step();
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    float* ch = c + half * 32;
    _tile_stored(0, ch, 256); _tile_stored(1, ch + 16, 256);
    _tile_stored(2, ch + 16 * 64, 256); _tile_stored(3, ch + 16 * 64 + 16, 256);
  }
}

// Rows [m0, m1) x panel p with the tile stores of one block interleaved with the next block's
// first k-step (blocks: a tile's half 0, its half 1, the next tile's half 0, ...).
TARGET static void item_pipelined(int64_t m0, int64_t m1, int p, float* cbuf, Epi e, Pending& pend) {
  const int64_t ldx = K * 2, kbytes = K * 2;
  const char* panel = reinterpret_cast<const char*>(W + (int64_t)p * K * 64);
  const int nblocks = (int)((m1 - m0) / 32 * 2);
  auto xa_of = [&](int b) { return reinterpret_cast<const char*>(X + (m0 + (b / 2) * 32) * K); };
  auto w_of = [&](int b, int64_t k) { return panel + (b % 2) * 128 + k * 64; };
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int b = 0; b < nblocks; ++b) {
    const char* xa = xa_of(b);
    const char* xb = xa + 16 * ldx;
    for (int64_t k = b == 0 ? 0 : 64; k < kbytes; k += 64) {
      pend.step();
      const char* wk = w_of(b, k);
      _tile_loadd(4, xa + k, ldx); _tile_loadd(6, wk, 256); _tile_loadd(7, wk + 64, 256);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, xb + k, ldx);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    float* c = cbuf + ((b / 2) % 2) * 32 * 64;
    float* ch = c + (b % 2) * 32;
    if (b + 1 < nblocks) {
      const char* na = xa_of(b + 1);
      const char* nw = w_of(b + 1, 0);
      _tile_stored(0, ch, 256); _tile_zero(0); _tile_loadd(4, na, ldx); _tile_loadd(6, nw, 256);
      _tile_dpbf16ps(0, 4, 6);
      _tile_stored(1, ch + 16, 256); _tile_zero(1); _tile_loadd(7, nw + 64, 256);
      _tile_dpbf16ps(1, 4, 7);
      _tile_stored(2, ch + 16 * 64, 256); _tile_zero(2); _tile_loadd(5, na + 16 * ldx, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_stored(3, ch + 16 * 64 + 16, 256); _tile_zero(3);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_stored(0, ch, 256); _tile_stored(1, ch + 16, 256);
      _tile_stored(2, ch + 16 * 64, 256); _tile_stored(3, ch + 16 * 64 + 16, 256);
    }
    if (b % 2 == 1) tile_epilogue(e, c, O + (m0 + (b / 2) * 32) * N + p * 64, pend);
  }
}

// Halves outer: each half sweeps every row tile of the item, K in chunks of kc bytes (C kept
// in cs, 64 floats a row, between chunks).
TARGET static void item_halves_out(int64_t m0, int64_t m1, int p, float* cs, int64_t kc) {
  const int64_t ldx = K * 2, kbytes = K * 2;
  const char* panel = reinterpret_cast<const char*>(W + (int64_t)p * K * 64);
  for (int half = 0; half < 2; ++half) {
    const char* w = panel + half * 128;
    for (int64_t k0 = 0; k0 < kbytes; k0 += kc) {
      const int64_t k1 = std::min(kbytes, k0 + kc);
      for (int64_t m = m0; m < m1; m += 32) {
        const char* xa = reinterpret_cast<const char*>(X + m * K);
        const char* xb = xa + 16 * ldx;
        float* ch = cs + (m - m0) * 64 + half * 32;
        if (k0 == 0) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        } else {
          _tile_loadd(0, ch, 256); _tile_loadd(1, ch + 16, 256);
          _tile_loadd(2, ch + 16 * 64, 256); _tile_loadd(3, ch + 16 * 64 + 16, 256);
        }
        for (int64_t k = k0; k < k1; k += 64) {
          const char* wk = w + k * 64;
          _tile_loadd(4, xa + k, ldx); _tile_loadd(6, wk, 256); _tile_loadd(7, wk + 64, 256);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, xb + k, ldx);
          _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, ch, 256); _tile_stored(1, ch + 16, 256);
        _tile_stored(2, ch + 16 * 64, 256); _tile_stored(3, ch + 16 * 64 + 16, 256);
      }
    }
  }
}

template <Variant V>
TARGET static void run(Epi e) {
  const int panels = N / 64, rblocks = (M + RB - 1) / RB, items = rblocks * panels;
#pragma omp parallel
  {
    configure();
    std::vector<float> cv(1024 * 64 + 16);
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cv.data()) + 63) & ~uintptr_t{63});
    Pending pend;
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int64_t m0 = (int64_t)(it / panels) * RB, m1 = std::min<int64_t>(M, m0 + RB);
      const int p = it % panels;
      if (V == kPipelined) {
        item_pipelined(m0, m1, p, c, e, pend);
      } else if (V == kHalvesOut || V == kKChunk4) {
        item_halves_out(m0, m1, p, c, V == kKChunk4 ? 4 * 64 : K * 2);
        if (e != kNone)
          for (int64_t m = m0; m < m1; m += 32) tile_epilogue(kInline, c + (m - m0) * 64, O + m * N + p * 64, pend);
      } else {
        for (int64_t m = m0; m < m1; m += 32) {
          float* cb = c + ((m - m0) / 32 % 2) * 32 * 64;
          tile32<V>(m, p, cb, pend);
          tile_epilogue(e, cb, O + m * N + p * 64, pend);
        }
      }
    }
    pend.finish();
    _tile_release();
  }
}

template <Variant V>
static double gflops(Epi e) {
  run<V>(e);
  std::vector<double> ts;
  for (int i = 0; i < 15; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run<V>(e);
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return 2.0 * M * N * K / ts[ts.size() / 2] / 1e9;
}

int main(int argc, char** argv) {
  if (argc > 1) M = atoi(argv[1]);
  if (argc > 2) N = atoi(argv[2]);
  if (argc > 3) K = atoi(argv[3]);
  if (argc > 4) RB = atoi(argv[4]);
  if (M % 32 || N % 64 || K % 32 || RB % 32) return fprintf(stderr, "M, ROW_BLOCK: multiples of 32; N of 64; K of 32\n"), 1;
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return fprintf(stderr, "no AMX tile permission\n"), 1;
  auto alloc = [](size_t n) { return static_cast<uint16_t*>(aligned_alloc(4096, (n * 2 + 4095) / 4096 * 4096)); };
  X = alloc((size_t)M * K), XP = alloc((size_t)M * K), W = alloc((size_t)N * K), WP = alloc((size_t)N * K), O = alloc((size_t)M * N);
  for (size_t i = 0; i < (size_t)M * K; ++i) X[i] = XP[i] = 0x3f80;
  for (size_t i = 0; i < (size_t)N * K; ++i) W[i] = WP[i] = 0x3c00;
  printf("M %d N %d K %d row block %d, %d threads: GFLOP/s\n", M, N, K, RB, omp_get_max_threads());
  for (int rep = 0; rep < 2; ++rep) {
    printf("base %.0f | pf-next %.0f | pipelined %.0f | a-hot %.0f | b-hot %.0f | halves-out %.0f | kchunk-4 %.0f | b-compact %.0f | ab-compact %.0f\n",
           gflops<kBase>(kNone), gflops<kPfNext>(kNone), gflops<kPipelined>(kNone), gflops<kAHot>(kNone),
           gflops<kBHot>(kNone), gflops<kHalvesOut>(kNone), gflops<kKChunk4>(kNone), gflops<kBCompact>(kNone),
           gflops<kABCompact>(kNone));
    printf("defer at top %.0f | defer after loads %.0f | defer after first dot %.0f\n", gflops<kBase>(kDefer), gflops<kLate>(kDefer), gflops<kMid>(kDefer));
    printf("+stores 2 lines %.0f | +stores hot %.0f | +stores NT %.0f | +epi inline NT %.0f\n", gflops<kBase>(kStoresL1), gflops<kBase>(kStoresHot), gflops<kBase>(kStoresNT), gflops<kBase>(kInlineNT));
    printf("base+epi inline %.0f | +epi defer %.0f | +loads only %.0f | +stores only %.0f | pipelined+epi defer %.0f\n",
           gflops<kBase>(kInline), gflops<kBase>(kDefer), gflops<kBase>(kLoadsOnly), gflops<kBase>(kStoresOnly),
           gflops<kPipelined>(kDefer));
  }
}
