// The bf16 and int8 panel GEMMs (gemm.h's and gemm_int8.h's layouts) on AMX tiles, for CPUs
// with AMX (Intel Sapphire Rapids and later), when a product has two rows or more.
//
// The panel layout is already AMX's: a B tile is 16 k-pairs x 16 output channels x 2 bf16,
// i.e. 16 rows of 64 bytes, and in a panel k-pair kp's pairs for channels 16 j .. 16 j + 15 are
// the 64 bytes at (kp * 64 + 16 j) * 2 elements: a tile load with a 256-byte stride reads one
// straight out of the packed weight. An A tile is 16 rows of x, 32 inputs (64 bytes) each.
//
// Tiles: C[r][j] (4, fp32 16 x 16) for two row halves r of a 32-row tile and two channel
// quarters j of one half of the panel; A[r] (2); B[j] (2). A 32-row tile sweeps K once per
// panel half. K beyond a multiple of 32 goes to gemm.h's AVX512-BF16 micro-kernel, which adds
// into the same accumulators. The products and sums are fp32, as in gemm.h, in another order
// (a row's result may differ from gemm.h's in the last bits; it does not depend on the other
// rows of its 32-row tile). int8 is the same walk in bytes: 64 uint8 inputs of x meet 16
// k-quads of the panel (tdpbusd), with gemm_int8.h's VNNI kernel taking the K tail; its int32
// sums are exact, so the results are those of the VNNI kernel, bit for bit.
//
// Tile state is per thread: each thread loads a configuration before its first tile op (kept
// while its row counts stay the same) and releases the tiles when its share of the product is
// done, so an idle thread holds no tile state across context switches.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "gemm.h"
#include "gemm_int8.h"

#define PAGEDLLM_AMX_TARGET                                                          \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq," \
                        "avx512bf16,avx512vnni,fma")))

namespace pagedllm {

constexpr int64_t kAmxRows = 16;  // rows of a tile
constexpr int64_t kAmxK = 32;     // bf16 inputs per A-tile row (64 bytes)
// Fewest rows for which `linear` takes the tiles: a single row (batch-1 decode) streams the
// weights as fast on gemm.h's kernel, which prefetches its panel; from two rows on the tiles
// win (SmolLM2's projections at 2 rows: 1.1-1.8x).
constexpr int64_t kAmxMinRows = 2;
// Bytes of x a work item's row block may take (ops.cpp's amx_block_rows): a quarter of the
// 2 MB L2 of these CPUs.
constexpr int64_t kAmxRowBlockBytes = 512 * 1024;

// Whether the tiles may be used at all: build.py's cpu_ops() sets it from PAGEDLLM_CPU_AMX
// (config.env_flag, default on) when it loads the library, through the cpu_allow_amx op;
// PAGEDLLM_CPU_AMX=0 runs the AVX-512 kernels an AMX-less CPU (AMD Zen 4/5) runs.
static std::atomic<bool>& amx_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// Whether this process may use AMX tiles (bf16 and int8 products): the CPU has them (and the
// AVX-512 kernels that take the K tails), Linux granted the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM; once per process, as oneDNN does it), and amx_allowed.
static bool amx_usable() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("avx512bf16") ||
        !__builtin_cpu_supports("avx512vnni"))
      return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok && amx_allowed().load(std::memory_order_relaxed);
}

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The configuration this thread has loaded (a key of amx_configure's rows; -1: none).
static inline int& amx_loaded_config() {
  thread_local int key = -1;
  return key;
}

// The configuration of a 32-row tile whose halves have rows0 and rows1 rows (rows1 may be 0):
// tmm0-3 = C[r][j] (tmm 2 r + j), tmm4-5 = A[r], tmm6-7 = B[j].
PAGEDLLM_AMX_TARGET static inline void amx_configure(int rows0, int rows1) {
  int& loaded = amx_loaded_config();
  const int key = rows0 * 32 + rows1;
  if (loaded == key) return;
  AmxTileConfig cfg;
  const int rows[2] = {rows0, rows1};
  for (int r = 0; r < 2; ++r) {
    if (rows[r] == 0) continue;
    for (int j = 0; j < 2; ++j) {
      cfg.rows[2 * r + j] = rows[r];
      cfg.colsb[2 * r + j] = 16 * sizeof(float);
    }
    cfg.rows[4 + r] = rows[r];
    cfg.colsb[4 + r] = kAmxK * 2;
  }
  for (int j = 0; j < 2; ++j) {
    cfg.rows[6 + j] = kAmxK / 2;
    cfg.colsb[6 + j] = 16 * 2 * 2;
  }
  _tile_loadconfig(&cfg);
  loaded = key;
}

// A thread's end of tile work (see the header comment); a no-op on a thread that used none.
PAGEDLLM_AMX_TARGET static inline void amx_release() {
  if (amx_loaded_config() < 0) return;
  _tile_release();
  amx_loaded_config() = -1;
}

// Tile c += tile a . tile b: uint8 x int8 quads (int32 sums) when INT8, else bf16 pairs (fp32
// sums). A macro: the intrinsics paste the tile numbers into their assembly.
#define PAGEDLLM_AMX_DOT(c, a, b) \
  do {                            \
    if constexpr (INT8)           \
      _tile_dpbusd(c, a, b);      \
    else                          \
      _tile_dpbf16ps(c, a, b);    \
  } while (0)

// The panel of a thread's next work item, brought into L2 a little at each k-step of the
// current one. An AMX tile load cannot run ahead of the tile products that wait for it (the
// tile registers are few and not renamed), so a panel read from memory on demand costs its
// full memory time on top of the products: at 64 rows the item's products and its panel's
// streaming took about as long each, one after the other. Spread over the item's steps, the
// next panel's lines arrive while this one's products run (a cold 64-row panel 1.2-1.6x
// faster in a one-thread microbenchmark; spread over half the steps, or into L1, slower).
struct AmxPrefetch {
  const char* at = nullptr;   // next line to request
  const char* end = nullptr;  // end of the panel
  int64_t step_bytes = 0;     // bytes requested per k-step

  // Spreads bytes at next (null: nothing to fetch) over the k-steps of `rows` rows on tiles
  // over kbytes bytes of K: per 32-row tile, two panel halves of kbytes / 64 steps.
  AmxPrefetch(const char* next, int64_t bytes, int64_t rows, int64_t kbytes) {
    const int64_t steps = (rows + 2 * kAmxRows - 1) / (2 * kAmxRows) * 2 * (kbytes / 64);
    if (!next || steps <= 0) return;
    at = next;
    end = next + bytes;
    step_bytes = ((bytes + steps - 1) / steps + 63) / 64 * 64;
  }
  PAGEDLLM_AMX_TARGET void step() {
    if (at >= end) return;
    for (int64_t b = 0; b < step_bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T1);
    at += step_bytes;
  }
};

// A 32-row tile's epilogue run a few rows at each k-step of the next tile's products rather
// than after them. Within one thread the tile unit and the vector units work side by side
// only on work the core has in flight together: an epilogue after its tile (bias, rounding,
// SiLU, the stores) left the tile unit idle, 30-45% of a 4,096-row product with K = 576
// (the products ran at ~3 TFLOP/s without their epilogues, ~2 with them); spread over the
// next tile's k-steps it runs while the tile products do (the 120 SmolLM2 products, same bits:
// 1.11x at 64 and 512 rows, 1.15x at 2,048; scripts/cpu_ops_ab.py). The sums are double-
// buffered: a tile's go to rows [32 b, 32 b + 32) of the scratch, b alternating, so the
// scratch holds 64 rows (or the product's rows, when fewer). epi(m0, m1, i) finishes rows
// [m0, m1), whose sums start at scratch row i; `unit` rows at a time (2: int8's byte rows go
// in pairs).
template <class Epi>
struct AmxDeferred {
  Epi& epi;
  int64_t unit = 1;
  int64_t m = 0, base = 0, r = 0, end = 0, per_step = 0;

  // The tile of rows [m0, m0 + rows), sums at scratch row b0, to finish over `steps` k-steps.
  void set(int64_t m0, int64_t rows, int64_t b0, int64_t steps) {
    m = m0, base = b0, r = 0, end = rows;
    const int64_t units = (rows + unit - 1) / unit;
    per_step = steps > 0 ? (units + steps - 1) / steps * unit : rows;
  }
  inline void step() {
    if (r >= end) return;
    const int64_t e = std::min(end, r + per_step);
    epi(m + r, m + e, base + r);
    r = e;
  }
  void finish() {
    if (r < end) epi(m + r, m + end, base + r);
    r = end;
  }
};

// Rows [m0, m1) 32 at a time with AmxDeferred's pipeline: products(m, rows, b0, pending) puts
// tile [m, m + rows)'s whole sums (K tail included) in the scratch buffers at row b0, running
// pending.step() at its k-steps (`steps` of them a tile); epi, `unit` rows at a time, finishes
// each tile's rows during the next tile's products, the last tile's at the end.
template <class Epi, class Products>
static inline void amx_deferred_tiles(int64_t m0, int64_t m1, int64_t steps, int64_t unit,
                                      Epi& epi, Products&& products) {
  AmxDeferred<Epi> pending{epi, unit};
  int64_t b0 = 0;  // the scratch row of this tile's sums: 0 or 32 in turn
  for (int64_t m = m0; m < m1; m += 2 * kAmxRows) {
    const int64_t rows = std::min(2 * kAmxRows, m1 - m);
    products(m, rows, b0, pending);
    pending.finish();
    pending.set(m, rows, b0, steps);
    b0 = 2 * kAmxRows - b0;
  }
  pending.finish();
}

// c[rows][64] = x[rows, 0 .. kbytes) * panel over the same inputs, rows <= 32 in two halves
// (TWO: the second half has rows). In bytes, both kinds are alike: 64 bytes of a row of x
// (32 bf16 / 64 uint8 inputs) meet 16 k-groups of the panel (16 pairs / quads), 16 rows of
// 256 bytes of which a B tile takes 64 (16 channels x 4 bytes); c holds 4-byte sums (fp32 /
// int32), kPanel a row.
template <bool TWO, bool INT8, class Hook>
PAGEDLLM_AMX_TARGET static inline void amx_tile_rows(const char* x, int64_t ldx,
                                                     const char* panel, int64_t kbytes,
                                                     void* c, AmxPrefetch& next, Hook& hook) {
  constexpr int64_t wstride = kPanel * 4, cstride = kPanel * 4;
  const char* x1 = x + kAmxRows * ldx;
  char* cb = static_cast<char*>(c);
  for (int half = 0; half < 2; ++half) {
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const char* w = panel + half * 32 * 4;
    for (int64_t k = 0; k < kbytes; k += 64) {
      const char* wk = w + k * kPanel;
      next.step();
      _tile_loadd(4, x + k, ldx);
      _tile_loadd(6, wk, wstride);
      _tile_loadd(7, wk + 16 * 4, wstride);
      PAGEDLLM_AMX_DOT(0, 4, 6);
      PAGEDLLM_AMX_DOT(1, 4, 7);
      if (TWO) {
        _tile_loadd(5, x1 + k, ldx);
        PAGEDLLM_AMX_DOT(2, 5, 6);
        PAGEDLLM_AMX_DOT(3, 5, 7);
      }
      hook.step();
    }
    char* ch = cb + half * 32 * 4;
    _tile_stored(0, ch, cstride);
    _tile_stored(1, ch + 16 * 4, cstride);
    if (TWO) {
      _tile_stored(2, ch + kAmxRows * cstride, cstride);
      _tile_stored(3, ch + kAmxRows * cstride + 16 * 4, cstride);
    }
  }
}

#undef PAGEDLLM_AMX_DOT

// c = rows (<= 32) of x x a panel over the first kbytes bytes of each row (a multiple of 64);
// hook.step() after each of its 2 kbytes / 64 k-steps.
template <bool INT8, class Hook>
PAGEDLLM_AMX_TARGET static inline void amx_tile(const char* x, int64_t ldx, const char* panel,
                                                int64_t kbytes, int64_t rows, void* c,
                                                AmxPrefetch& next, Hook& hook) {
  if (kbytes == 0) return;
  const int rows0 = static_cast<int>(std::min(kAmxRows, rows));
  const int rows1 = static_cast<int>(rows - rows0);
  amx_configure(rows0, rows1);
  if (rows1 > 0)
    amx_tile_rows<true, INT8>(x, ldx, panel, kbytes, c, next, hook);
  else
    amx_tile_rows<false, INT8>(x, ldx, panel, kbytes, c, next, hook);
}

// Rows [m0, m1) x one panel on tiles, 32 rows at a time, over the first kbytes bytes of each
// row of x (a multiple of 64). Each 32-row tile's sums land in c (kPanel a row; two 32-row
// buffers in turn, see AmxDeferred) and tail(m, rows, cm) adds the rest of K to them (cm: the
// tile's buffer); epi(r0, r1, i) then finishes rows [r0, r1) (sums at row i of c) during the
// next tile's k-steps, `unit` rows at a time. Finishing a tile's rows soon after its products
// finds them in L1: finishing a whole item's rows at its end read them back from L2 (448 rows:
// 112 KB), 3-9% of a prefill's products. The panel_bytes at next_panel (the thread's next
// item's; null: none) are prefetched meanwhile.
template <bool INT8, class Tail, class Epi>
PAGEDLLM_AMX_TARGET static inline void amx_rows(const char* x, int64_t ldx, const char* panel,
                                                int64_t kbytes, int64_t m0, int64_t m1, void* c,
                                                const char* next_panel, int64_t panel_bytes,
                                                Tail&& tail, Epi&& epi, int64_t unit) {
  AmxPrefetch next(next_panel, panel_bytes, m1 - m0, kbytes);
  char* cb = static_cast<char*>(c);
  amx_deferred_tiles(m0, m1, 2 * (kbytes / 64), unit, epi,
                     [&](int64_t m, int64_t rows, int64_t b0, auto& pending) {
                       void* cm = cb + b0 * kPanel * 4;
                       amx_tile<INT8>(x + m * ldx, ldx, panel, kbytes, rows, cm, next, pending);
                       tail(m, rows, cm);
                     });
}

// Rows [m, m + rows)'s sums c over a bf16 panel: the last K % 32 inputs, on gemm.h's
// AVX512-BF16 kernel (nothing when K is a multiple of 32).
PAGEDLLM_AMX_TARGET static inline void amx_k_tail(const GemmArgs& a, int64_t m, int64_t rows,
                                                  const uint16_t* panel, float* c) {
  const int64_t K32 = a.K / kAmxK * kAmxK;
  if (K32 == a.K) return;
  for (int64_t r = 0; r < rows; r += kRowTile)
    micro_dispatch(std::min(kRowTile, rows - r), a.x + (m + r) * a.ldx + K32, a.ldx,
                   panel + K32 * kPanel, (a.K - K32) / 2, c + r * kPanel, K32 > 0);
}

// gemm.h's gemm_item on AMX tiles: rows [m0, m1) x panel p, with the same epilogue. The
// last K % 32 inputs are added on gemm.h's AVX512-BF16 kernel. next_p: the panel of the
// thread's next item (-1: none), prefetched.
PAGEDLLM_AMX_TARGET static void gemm_item_amx(const GemmArgs& a, int64_t m0, int64_t m1,
                                              int64_t p, float* c, int64_t next_p) {
  const int64_t kp_total = a.K / 2, K32 = a.K / kAmxK * kAmxK, panel_elems = kp_total * 2 * kPanel;
  const uint16_t* panel = a.w + p * panel_elems;
  amx_rows<false>(reinterpret_cast<const char*>(a.x), a.ldx * 2,
                  reinterpret_cast<const char*>(panel), K32 * 2, m0, m1, c,
                  next_p < 0 ? nullptr : reinterpret_cast<const char*>(a.w + next_p * panel_elems),
                  panel_elems * 2,
                  [&](int64_t m, int64_t rows, void* cm) {
                    amx_k_tail(a, m, rows, panel, static_cast<float*>(cm));
                  },
                  [&](int64_t r0, int64_t r1, int64_t i) { gemm_epilogue(a, r0, r1, p, c + i * kPanel); },
                  1);
}

// gemm_int8.h's int32 sums on AMX tiles (vpdpbusd's products and sums, so the same numbers):
// the last K_pad % 64 inputs are added on the AVX512-VNNI kernel; epilogue(r0, r1, c) then
// takes rows [r0, r1)'s sums (c: row r0's), a few byte-row pairs at a time during the next
// tile's products (amx_rows).
// next_p: the panel of the thread's next item (-1: none), prefetched.
template <class Epilogue>
PAGEDLLM_AMX_TARGET static void gemm_int8_sums_amx(const Int8GemmArgs& a, int64_t m0,
                                                   int64_t m1, int64_t p, int32_t* c,
                                                   int64_t next_p, Epilogue&& epilogue) {
  const int64_t kbytes = a.Kq * 4, K64 = kbytes / 64 * 64, panel_bytes = kbytes * kPanel;
  const int8_t* panel = a.w + p * panel_bytes;
  amx_rows<true>(reinterpret_cast<const char*>(a.xq), a.ldx,
                 reinterpret_cast<const char*>(panel), K64, m0, m1, c,
                 next_p < 0 ? nullptr : reinterpret_cast<const char*>(a.w + next_p * panel_bytes),
                 panel_bytes,
                 [&](int64_t m, int64_t rows, void* cm) {
                   int32_t* ci = static_cast<int32_t*>(cm);
                   if (K64 != kbytes)
                     for (int64_t r = 0; r < rows; r += kRowTile)
                       micro_u8s8_dispatch(std::min(kRowTile, rows - r),
                                           a.xq + (m + r) * a.ldx + K64, a.ldx,
                                           panel + K64 * kPanel, (kbytes - K64) / 4,
                                           ci + r * kPanel, K64 > 0);
                 },
                 [&](int64_t r0, int64_t r1, int64_t i) { epilogue(r0, r1, c + i * kPanel); }, 2);
}

}  // namespace pagedllm
