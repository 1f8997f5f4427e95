// pagedllm's CPU operators (torch.ops.pagedllm.*): argument checks, threading over ATen's
// pool (at::parallel_for, so the kernels share PyTorch's threads), and the kernels of the
// headers beside this file. The only translation unit, so a build compiles PyTorch's headers
// once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "attention_amx.h"
#include "elementwise.h"
#include "fp8.h"
#include "gemm.h"
#include "gemm_amx.h"
#include "gemm_f32.h"
#include "gemm_int8.h"
#include "gemm_silu.h"
#include "sampling.h"

namespace pagedllm {
namespace {

const uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}
uint16_t* bf16_mut(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void check_any_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  check_any_rows(t, name);
}

// Scratch a kernel keeps on its thread from one call to the next instead of allocating it
// each time (a batch-1 decode layer made ~40 such temporaries): at least n elements of T,
// 64-byte aligned, not zeroed; Tag keeps apart buffers that are alive at the same time. Past
// kThreadScratchBytes (a long prefill's) the buffer is the object's own, freed with it.
constexpr int64_t kThreadScratchBytes = 1 << 20;
using FreeDeleter = decltype(&std::free);

template <class T>
T* aligned_elements(int64_t n) {
  T* p = static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
  TORCH_CHECK(p, "out of memory for ", n * sizeof(T), " bytes of scratch");
  return p;
}

template <class T, int Tag>
class ThreadScratch {
 public:
  explicit ThreadScratch(int64_t n) {
    if (n * static_cast<int64_t>(sizeof(T)) > kThreadScratchBytes) {
      own_.reset(aligned_elements<T>(n));
      p_ = own_.get();
      return;
    }
    thread_local std::unique_ptr<T, FreeDeleter> buf{nullptr, &std::free};
    thread_local int64_t size = 0;
    if (size < n) {
      size = std::max<int64_t>(n, 2 * size);
      buf.reset(aligned_elements<T>(size));
    }
    p_ = buf.get();
  }
  T* get() const { return p_; }

 private:
  std::unique_ptr<T, FreeDeleter> own_{nullptr, &std::free};
  T* p_ = nullptr;
};

// Tags of ThreadScratch's buffers.
enum ScratchTag { kGemmAccScratch, kInt8XqScratch, kInt8ScaleScratch,
                  kDecodeAttnScratch, kNormScratch, kFp8RowsScratch };

// The panel GEMMs' work on ATen's threads: item(m0, m1, p, c) for every (row block, panel)
// pair of an M x N product, row block major; c: a row block's accumulators (Acc, kPanel a
// row), one buffer per thread. The threads take runs of items from a shared counter instead of
// equal shares fixed up front: on a shared machine a thread that loses its core for a while
// then delays nobody (a static split makes the others wait for its share at the end). Each
// item writes its own outputs, so which thread runs it changes no result. An item that takes
// a fifth argument gets the panel of the thread's next item (-1: none; a thread claims its next
// run as it starts the last item of the current one), to prefetch it.
// done() runs on each thread after its last item.
//
// Split tail (split_panels > 0, a single row block): the first panels - split_panels panels
// are whole items (all M rows), the last split_panels panels go in pieces of piece_rows rows,
// claimed last: the threads end together on small items while every other panel streams from
// memory once.
template <class Acc, class Item, class Done = void (*)()>
void for_gemm_items(int64_t M, int64_t N, Item&& item, Done&& done = [] {}, int64_t row_block = kRowBlock,
                    int64_t split_panels = 0, int64_t piece_rows = 0) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t block = split_panels > 0 ? M : std::min(row_block, M);
  const int64_t whole = panels - split_panels;
  const int64_t pieces = split_panels > 0 ? (M + piece_rows - 1) / piece_rows : 0;
  const int64_t total = split_panels > 0 ? whole + split_panels * pieces : (M + block - 1) / block * panels;
  struct Rows {
    int64_t m0, m1, p;
  };
  auto shape = [&](int64_t i) -> Rows {  // item i's rows and panel
    if (split_panels == 0) return {i / panels * block, std::min(M, i / panels * block + block), i % panels};
    if (i < whole) return {0, M, i};
    const int64_t j = i - whole, m0 = j % pieces * piece_rows;
    return {m0, std::min(M, m0 + piece_rows), whole + j / pieces};
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), total);
  const int64_t run = std::min(std::max<int64_t>(1, total / (threads * 16)),
                               (total + threads - 1) / threads);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Cache-line aligned: the AMX kernels store whole 64-byte tile rows into it (unaligned,
    // each row store splits over two lines: 5-9% of a 448 x 3,072 x 576 product).
    const ThreadScratch<Acc, kGemmAccScratch> c(block * kPanel);
    Acc* cp = c.get();
    for (int64_t i0 = next.fetch_add(run, std::memory_order_relaxed); i0 < total;) {
      const int64_t end = std::min(total, i0 + run);
      int64_t following = total;  // the first item of the thread's next run
      for (int64_t i = i0; i < end; ++i) {
        if (i + 1 == end) following = next.fetch_add(run, std::memory_order_relaxed);
        const Rows r = shape(i);
        if constexpr (std::is_invocable_v<Item&, int64_t, int64_t, int64_t, Acc*, int64_t>) {
          const int64_t after = i + 1 < end ? i + 1 : following;
          item(r.m0, r.m1, r.p, cp, after < total ? shape(after).p : int64_t{-1});
        } else {
          item(r.m0, r.m1, r.p, cp);
        }
      }
      i0 = following;
    }
    done();
  });
}

// A product of one row tile (M <= kRowTile rows; item(0, M, p, c) for every panel p), which
// streams its weights from memory once: each thread owns an equal range of adjacent panels and
// streams it in order, one run of memory; a thread done with its own range takes the next
// panels of the others', one at a time, so the threads still end together when one of them
// lost its core for a while. The hardware prefetchers draw more from long runs: runs of
// 128 KB claimed from one counter (a thread's stream jumping every 128 KB) left the gate / up
// product of an int8 batch-1 step 1.1x slower (Zen 4; the gate and up panels of an item are
// two streams).
template <class Acc, class Item>
void for_stream_items(int64_t M, int64_t N, Item&& item) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), panels);
  struct alignas(64) Range {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::unique_ptr<Range[]> ranges(new Range[threads]);
  for (int64_t t = 0; t < threads; ++t) {
    ranges[t].next.store(panels * t / threads, std::memory_order_relaxed);
    ranges[t].end = panels * (t + 1) / threads;
  }
  // One index a thread; run inline (all indices at once) the loop still takes every range.
  at::parallel_for(0, threads, 1, [&](int64_t t, int64_t) {
    const ThreadScratch<Acc, kGemmAccScratch> c(M * kPanel);
    for (int64_t k = 0; k < threads; ++k) {
      Range& r = ranges[(t + k) % threads];
      for (int64_t p; (p = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) item(0, M, p, c.get());
    }
  });
}

// for_gemm_items over row blocks and panels; a product of one row tile: for_stream_items.
template <class Acc, class Item>
void for_panel_items(int64_t M, int64_t N, Item&& item) {
  if (M <= kRowTile) return for_stream_items<Acc>(M, N, item);
  for_gemm_items<Acc>(M, N, item);
}

// Rows per parallel chunk so that a chunk is worth a thread hand-off (~32k elements).
int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

bool cpu_has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// The [M, n] output of a projection: `into` (rows with a stride, the caller's buffer) when
// given, else a new tensor.
at::Tensor output_rows(at::Tensor* into, int64_t M, int64_t n, const at::TensorOptions& opts) {
  if (!into) return at::empty({M, n}, opts);
  TORCH_CHECK(into->dim() == 2 && into->size(0) == M && into->size(1) == n && into->stride(1) == 1 &&
                  into->scalar_type() == opts.dtype().toScalarType(),
              "output rows: [M, n] of the result's dtype");
  return *into;
}

// Rows of x (row_bytes a row) that an AMX row block keeps within kAmxRowBlockBytes: a multiple
// of 32, at least kRowBlock, at most 1024. A thread walks every panel of the weight per row
// block, so larger blocks stream the weight from L3 / DRAM fewer times.
int64_t amx_block_rows(int64_t row_bytes) {
  return std::max<int64_t>(kRowBlock, std::min<int64_t>(1024, kAmxRowBlockBytes / row_bytes / 32 * 32));
}

// Whether an M-row product runs on AMX tiles.
bool use_amx(int64_t M) { return M >= kAmxMinRows && amx_usable(); }

// for_gemm_items for the AMX kernels (x rows of row_bytes), each thread's tiles released after
// its last item. Row blocks of amx_block_rows, but 8 items a thread at least:
// - a product of one row block (a decode batch of 33 to a few hundred rows) with fewer panels
//   keeps its whole rows per panel and splits only the last `threads` panels into row pieces
//   (for_gemm_items' split tail): every other panel streams from memory once, and the threads
//   still end together on small items (SmolLM2's projections at 128 rows 1.03-1.07x against
//   splitting every panel's rows, alternated in one process; even at 64, 96, 192 and 256);
// - otherwise the row blocks shrink (to kRowBlock rows at least) until there are enough.
template <class Acc, class Item>
void for_amx_items(int64_t M, int64_t N, int64_t row_bytes, Item&& item) {
  const int64_t panels = (N + kPanel - 1) / kPanel, threads = at::get_num_threads();
  const int64_t want = 8 * threads;
  int64_t rows = amx_block_rows(row_bytes);
  if (M <= rows && panels < want && M > 2 * kAmxRows && threads > 1) {
    // A piece per thread, in whole 32-row tiles.
    const int64_t tile = 2 * kAmxRows, piece_rows = ((M + threads - 1) / threads + tile - 1) / tile * tile;
    for_gemm_items<Acc>(M, N, item, [] { amx_release(); }, M, std::min(panels, threads), piece_rows);
    return;
  }
  if ((M + rows - 1) / rows * panels < want) {
    const int64_t blocks = (want + panels - 1) / panels;
    rows = std::min(rows, std::max<int64_t>(kRowBlock, ((M + blocks - 1) / blocks + 31) / 32 * 32));
  }
  for_gemm_items<Acc>(M, N, item, [] { amx_release(); }, rows);
}

// w: bf16 panels (gemm.h) of n outputs over K inputs: [ceil(n / 64), K / 2, 64, 2], exactly
// n / 64 panels when `whole`.
void check_bf16_panels(const at::Tensor& w, int64_t n, int64_t K, bool whole) {
  TORCH_CHECK(K % 2 == 0, "in_features must be even");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 4 &&
                  (whole ? w.size(0) * kPanel == n : w.size(0) * kPanel >= n) &&
                  w.size(1) * 2 == K && w.size(2) == kPanel && w.size(3) == 2,
              "w must be bfloat16 packed [", whole ? "n / 64" : "ceil(N / 64)", ", K / 2, 64, 2]");
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  int64_t n, bool out_fp32, at::Tensor* into = nullptr) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "pagedllm::linear needs AVX512-BF16");
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  check_bf16_panels(w, n, K, false);
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n, "bias: bfloat16 [N]");
  at::Tensor out = output_rows(into, M, n, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  GemmArgs a{bf16_ptr(x), M, K, x.stride(0), bf16_ptr(w), bias ? bf16_ptr(*bias) : nullptr,
             n, out.data_ptr(), out_fp32, out.stride(0)};
  if (use_amx(M)) {
    for_amx_items<float>(M, n, 2 * K, [&](int64_t m0, int64_t m1, int64_t p, float* c, int64_t next_p) {
      gemm_item_amx(a, m0, m1, p, c, next_p);
    });
  } else {
    for_panel_items<float>(M, n, [&](int64_t m0, int64_t m1, int64_t p, float* c) {
      gemm_item(a, m0, m1, p, c);
    });
  }
  return out;
}

// silu_and_mul(linear(x, w, bias, n)) in one pass (gemm_silu.h): w packed as for linear, its
// n = 2 I rows the gate rows then the up rows, I a multiple of 64; the [M, I] result in bf16,
// written into `into`'s rows when given. The same bits as the two ops.
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& w,
                           const c10::optional<at::Tensor>& bias, int64_t n,
                           at::Tensor* into = nullptr) {
  TORCH_CHECK(cpu_has_avx512_bf16(), "pagedllm::linear_silu_mul needs AVX512-BF16");
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(n % (2 * kPanel) == 0, "linear_silu_mul: n = 2 x a multiple of 64, got ", n);
  check_bf16_panels(w, n, K, true);
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n, "bias: bfloat16 [n]");
  at::Tensor out = output_rows(into, M, n / 2, x.options());
  if (M == 0) return out;
  GemmArgs a{bf16_ptr(x), M, K, x.stride(0), bf16_ptr(w), bias ? bf16_ptr(*bias) : nullptr,
             n, out.data_ptr(), false, out.stride(0)};
  if (use_amx(M)) {
    for_amx_items<float>(M, n / 2, 2 * K, [&](int64_t m0, int64_t m1, int64_t p, float* c, int64_t next_p) {
      gemm_silu_item_amx(a, m0, m1, p, c, next_p);
    });
  } else {
    for_panel_items<float>(M, n / 2, [&](int64_t m0, int64_t m1, int64_t p, float* c) {
      gemm_silu_item(a, m0, m1, p, c);
    });
  }
  return out;
}

bool cpu_has_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Element-typed pointer to a bf16 (Bf16) or fp32 (Fp32) tensor's data.
template <class E>
typename E::T* data(const at::Tensor& t) { return reinterpret_cast<typename E::T*>(t.data_ptr()); }

// Calls body.template operator()<E>() with E the element type of t (bf16 or fp32 only).
template <class F>
void by_dtype(const at::Tensor& t, const char* name, F&& body) {
  if (t.scalar_type() == at::kFloat) return body.template operator()<Fp32>();
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16 or float32");
  body.template operator()<Bf16>();
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the input's dtype");
}

// y = x w^T + bias in fp32 arithmetic (gemm_f32.h): x fp32 or bf16 (widened to fp32 first),
// w packed [ceil(N / 64), K, 64, 1] in x's dtype, bias in x's dtype; y in fp32 (out_fp32) or
// x's dtype.
at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       int64_t n, bool out_fp32, at::Tensor* into = nullptr) {
  TORCH_CHECK(cpu_has_avx2_fma(), "pagedllm::linear_avx2 needs AVX2 and FMA");
  check_any_rows(x, "x");
  check_like(w, x, "w");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.dim() == 4 && w.size(0) * kPanel >= n && w.size(1) == K &&
                  w.size(2) == kPanel && w.size(3) == 1,
              "w must be packed [ceil(N / 64), K, 64, 1]");
  if (bias) {
    check_like(*bias, x, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "bias: [N]");
  }
  at::Tensor out = output_rows(into, M, n, out_fp32 ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0) return out;
  by_dtype(x, "x", [&]<class E>() {
    at::Tensor xf = x;
    if constexpr (!std::is_same_v<E, Fp32>) {  // widen the rows once, not per panel
      xf = at::empty({M, K}, x.options().dtype(at::kFloat));
      at::parallel_for(0, M, row_grain(K), [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m)
          widen_row(xf.data_ptr<float>() + m * K, data<E>(x) + m * x.stride(0), K);
      });
    }
    GemmF32Args a{xf.data_ptr<float>(), M, K, xf.stride(0), w.data_ptr(),
                  bias ? bias->data_ptr() : nullptr, n, out.data_ptr(), out_fp32, out.stride(0)};
    for_panel_items<float>(M, n, [&](int64_t m0, int64_t m1, int64_t p, float* c) {
      gemm_f32_item<typename E::T, E>(a, m0, m1, p, c);
    });
  });
  return out;
}

bool cpu_has_avx512_vnni() { return __builtin_cpu_supports("avx512vnni"); }

// An int8 product's inputs: x's rows (bf16 or fp32) quantized to 16 bits, each as its two
// byte rows (gemm_int8.h), on ATen's threads, and the kernel's arguments for n outputs into
// out (checked first).
struct Int8Inputs {
  ThreadScratch<uint8_t, kInt8XqScratch> xq;
  ThreadScratch<float, kInt8ScaleScratch> x_scale;
  Int8GemmArgs a;
};

Int8Inputs int8_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       const at::Tensor& out, bool out_fp32) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && w.dim() == 4 &&
                  w.size(0) * kPanel >= n && w.size(1) * 4 >= K && w.size(1) * 4 < K + 4 &&
                  w.size(2) == kPanel && w.size(3) == 4,
              "w must be int8 packed [ceil(N / 64), ceil(K / 4), 64, 4]");
  TORCH_CHECK(K <= kMaxInt8K, "int8 layers take at most ", kMaxInt8K, " inputs");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() >= n, "w_scale: float32 [N]");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == w.size(0) * kPanel, "colsum: int32 [N_pad]");
  if (bias) {
    check_like(*bias, x, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "bias: [N]");
  }
  const int64_t Kq = w.size(1), K_pad = 4 * Kq;
  Int8Inputs in{ThreadScratch<uint8_t, kInt8XqScratch>(2 * M * K_pad),
                ThreadScratch<float, kInt8ScaleScratch>(M), {}};
  uint8_t* xq = in.xq.get();
  float* x_scale = in.x_scale.get();
  in.a = Int8GemmArgs{xq, x_scale, 2 * M, Kq, K_pad, w.data_ptr<int8_t>(),
                      w_scale.data_ptr<float>(), colsum.data_ptr<int32_t>(),
                      bias ? bias->data_ptr() : nullptr, n, out.data_ptr(), out_fp32, out.stride(0)};
  const bool avx512 = cpu_has_avx512();
  by_dtype(x, "x", [&]<class E>() {
    at::parallel_for(0, M, row_grain(K), [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
        uint8_t* hi = xq + 2 * m * K_pad;
        const typename E::T* row = data<E>(x) + m * x.stride(0);
        if (avx512)
          quantize_row_i16_avx512(row, K, K_pad, hi, hi + K_pad, x_scale + m);
        else
          quantize_row_i16(row, K, K_pad, hi, hi + K_pad, x_scale + m);
      }
    });
  });
  return in;
}

// y = W8A16(x, w): rows of x (bf16 or fp32) quantized to int16 on the fly (gemm_int8.h), on
// AMX tiles, the AVX512-VNNI kernel or else the AVX2 one; the result in fp32 (out_fp32) or
// x's dtype.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, int64_t n,
                       bool out_fp32, at::Tensor* into = nullptr) {
  const bool vnni = cpu_has_avx512_vnni();
  TORCH_CHECK(vnni || cpu_has_avx2_fma(), "pagedllm::linear_int8 needs AVX512-VNNI or AVX2 + FMA");
  check_any_rows(x, "x");
  const int64_t M = x.size(0);
  at::Tensor out = output_rows(into, M, n, out_fp32 ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0) return out;
  const Int8Inputs in = int8_inputs(x, w, w_scale, colsum, bias, n, out, out_fp32);
  const Int8GemmArgs& a = in.a;
  const int64_t K_pad = a.ldx;
  by_dtype(x, "x", [&]<class E>() {
    if (use_amx(M)) {  // by activation rows: one row (two byte rows) stays on VNNI
      for_amx_items<int32_t>(a.M, n, K_pad, [&](int64_t m0, int64_t m1, int64_t p, int32_t* c, int64_t next_p) {
        gemm_int8_sums_amx(a, m0, m1, p, c, next_p, [&](int64_t r0, int64_t r1, const int32_t* cr) {
          int8_epilogue(a, E{}, r0, r1, p, cr);
        });
      });
    } else {
      for_panel_items<int32_t>(a.M, n, [&](int64_t m0, int64_t m1, int64_t p, int32_t* c) {
        prefetch_int8_epilogue(a, p);
        if (vnni)
          gemm_int8_sums_vnni(a, m0, m1, p, c);
        else
          gemm_int8_sums_avx2(a, m0, m1, p, c);
        int8_epilogue(a, E{}, m0, m1, p, c);
      });
    }
  });
  return out;
}

// Whether linear_int8_silu_mul takes this gate / up product: bf16 rows on the VNNI kernel
// without AMX tiles (AMX products of many rows keep the two ops), n = 2 x a multiple of 64.
bool int8_silu_fusable(const at::Tensor& x, int64_t n) {
  return x.scalar_type() == at::kBFloat16 && cpu_has_avx512_vnni() && cpu_has_avx512_bf16() &&
         n % (2 * kPanel) == 0 && !use_amx(x.size(0));
}

// silu_and_mul(linear_int8(x, w, ...)) in one pass (gemm_silu.h): the same bits as the two
// ops, the [M, n / 2] result in bf16 (int8_silu_fusable's inputs only).
at::Tensor linear_int8_silu_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                const at::Tensor& colsum, const c10::optional<at::Tensor>& bias,
                                int64_t n) {
  check_any_rows(x, "x");
  TORCH_CHECK(int8_silu_fusable(x, n), "linear_int8_silu_mul: bf16 rows on AVX512-VNNI + BF16, n = 2 x a multiple of 64");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, n / 2}, x.options());
  if (M == 0) return out;
  const Int8Inputs in = int8_inputs(x, w, w_scale, colsum, bias, n, out, false);
  for_panel_items<int32_t>(in.a.M, n / 2, [&](int64_t m0, int64_t m1, int64_t p, int32_t* c) {
    gemm_int8_silu_item(in.a, m0, m1, p, c);
  });
  return out;
}


// rms_norm's row kernel for E: norm(out, x, residual or null, weight, n, eps, tmp: n floats).
// It reads all of x before it writes out, so out may be x.
template <class E>
auto rms_norm_kernel() {
  void (*row)(typename E::T*, const typename E::T*, typename E::T*, const typename E::T*, int64_t,
              float, float*) = rms_norm_row;
  if constexpr (std::is_same_v<E, Bf16>)
    if (cpu_has_avx512_bf16()) row = rms_norm_row_bf16;
  return row;
}

at::Tensor rms_norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                         double eps) {
  check_any_rows(x, "x");
  check_like(weight, x, "weight");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [hidden]");
  if (residual) {
    check_any_rows(*residual, "residual");
    check_like(*residual, x, "residual");
    TORCH_CHECK(x.sizes() == residual->sizes(), "x and residual must have one shape");
  }
  const int64_t T = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({T, n}, x.options());
  by_dtype(x, "x", [&]<class E>() {
    const auto row = rms_norm_kernel<E>();
    at::parallel_for(0, T, row_grain(n), [&](int64_t b, int64_t e) {
      const ThreadScratch<float, kNormScratch> scratch(n);
      float* tmp = scratch.get();
      for (int64_t t = b; t < e; ++t)
        row(data<E>(out) + t * n, data<E>(x) + t * x.stride(0),
            residual ? data<E>(*residual) + t * residual->stride(0) : nullptr, data<E>(weight),
            n, static_cast<float>(eps), tmp);
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, nullptr, weight, eps);
}

at::Tensor fused_add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps) {
  return rms_norm_impl(x, &residual, weight, eps);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_any_rows(x, "x");
  const int64_t T = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({T, d}, x.options());
  by_dtype(x, "x", [&]<class E>() {
    using V = typename E::T;
    void (*row)(V*, const V*, int64_t) = silu_and_mul_row;
    if constexpr (std::is_same_v<E, Bf16>)
      if (cpu_has_avx512_bf16()) row = silu_and_mul_row_bf16;
    at::parallel_for(0, T, row_grain(d), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) row(data<E>(out) + t * d, data<E>(x) + t * x.stride(0), d);
    });
  });
  return out;
}

// positions: int64, each a row of cos_sin_cache (float32 [len, rot]); their values.
const int64_t* checked_positions(const at::Tensor& positions, const at::Tensor& cos_sin_cache, int64_t rot) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions: int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == rot, "cos_sin_cache: float32 [len, rot]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "position ", pos[t], " out of the RoPE table");
  return pos;
}

// RoPE's row kernel for E: rope(x, heads, head_size, rot, cos_sin) rotates `heads` heads of x
// in place, each on its own (so a row's heads in any grouping give the same bits).
template <class E>
auto rope_kernel() {
  void (*rope)(typename E::T*, int64_t, int64_t, int64_t, const float*) = rope_row;
  if constexpr (std::is_same_v<E, Bf16>)
    if (cpu_has_avx512_bf16()) rope = rope_row_bf16;
  return rope;
}

// Most floats a head's norm takes as scratch on the stack (head sizes up to this).
constexpr int64_t kMaxHeadSize = 512;

// A per-head RMSNorm of the query and key heads before RoPE (Qwen3's q_norm and k_norm:
// [head_size] weights in the rows' dtype; none in other models, where `apply` does nothing).
// Each head is normalized in place by rms_norm's row kernel, so a head gets the bits that
// rms_norm gives it as a row of [T * heads, head_size]. Holds the caller's tensors by address.
struct HeadNorms {
  const at::Tensor* q = nullptr;
  const at::Tensor* k = nullptr;
  float eps = 0.f;

  HeadNorms() = default;
  HeadNorms(const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
            double qk_eps, const at::Tensor& like, int64_t head_size) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm go together");
    if (!q_norm) return;
    TORCH_CHECK(head_size <= kMaxHeadSize, "q/k norms: head size ", head_size, " over ",
                kMaxHeadSize);
    for (const at::Tensor* w : {&*q_norm, &*k_norm}) {
      check_like(*w, like, "q_norm / k_norm");
      TORCH_CHECK(w->is_contiguous() && w->numel() == head_size, "q_norm / k_norm: [head_size]");
    }
    q = &*q_norm, k = &*k_norm, eps = static_cast<float>(qk_eps);
  }
  // Normalizes `heads` heads at x (query heads, or key heads when key) in place.
  template <class E>
  void apply(typename E::T* x, int64_t heads, int64_t head_size, bool key) const {
    if (!q) return;
    const auto norm = rms_norm_kernel<E>();
    const typename E::T* w = data<E>(key ? *k : *q);
    float tmp[kMaxHeadSize];
    for (int64_t h = 0; h < heads; ++h)
      norm(x + h * head_size, x + h * head_size, nullptr, w, head_size, eps, tmp);
  }
};

// RoPE on rows of q and k (whole heads each), after the per-head norms when `norms` are on.
void rope_rows(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
               const at::Tensor& cos_sin_cache, int64_t head_size, int64_t rot,
               const HeadNorms& norms) {
  check_any_rows(q, "query");
  check_any_rows(k, "key");
  check_like(k, q, "key");
  const int64_t* pos = checked_positions(positions, cos_sin_cache, rot);
  const int64_t T = q.size(0), hq = q.size(1) / head_size, hk = k.size(1) / head_size;
  const float* cs = cos_sin_cache.data_ptr<float>();
  by_dtype(q, "query", [&]<class E>() {
    const auto rope = rope_kernel<E>();
    at::parallel_for(0, T, row_grain(q.size(1) + k.size(1)), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* row = cs + pos[t] * rot;
        typename E::T* qt = data<E>(q) + t * q.stride(0);
        typename E::T* kt = data<E>(k) + t * k.stride(0);
        norms.apply<E>(qt, hq, head_size, false);
        norms.apply<E>(kt, hk, head_size, true);
        rope(qt, hq, head_size, rot, row);
        rope(kt, hk, head_size, rot, row);
      }
    });
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos_sin_cache, int64_t head_size, int64_t rot) {
  rope_rows(positions, q, k, cos_sin_cache, head_size, rot, HeadNorms());
}

// The sampling ops' logits (float32 [B, V], contiguous rows) and CPU, checked for op `name`;
// whether the AVX-512 kernels run (else AVX2).
bool check_sample_logits(const at::Tensor& logits, const char* name) {
  const bool avx512 = cpu_has_avx512();
  TORCH_CHECK(avx512 || cpu_has_avx2_fma(), "pagedllm::", name, " needs AVX-512 or AVX2 + FMA");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits: float32 [B, V] with contiguous rows");
  return avx512;
}

// One token per row of logits [B, V] (fp32) drawn with temperature [B] and uniform u [B] in
// [0, 1) (sampling.h); rows whose temperature is not above 0 (greedy rows of a mixed batch,
// which the caller takes from its argmax) are not drawn and get token 0.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
  const bool avx512 = check_sample_logits(logits, "sample_rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  for (const at::Tensor* t : {&temperature, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == B,
                "temperature / u: float32 [B]");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const float* uu = u.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    std::vector<float> sums((V + kSampleChunk - 1) / kSampleChunk), w(kSampleChunk);
    for (int64_t r = b; r < e; ++r) {
      const float* row = x + r * logits.stride(0);
      if (!(temp[r] > 0.f))
        tok[r] = 0;
      else if (avx512)
        tok[r] = sample_row<SampleAvx512>(row, V, temp[r], uu[r], sums.data(), w.data());
      else
        tok[r] = sample_row<SampleAvx2>(row, V, temp[r], uu[r], sums.data(), w.data());
    }
  });
  return out;
}

// One round of the truncated draw (sampling.h's sample_row_truncated) on each row of logits
// [B, V] (fp32) with temperature, top_p, floor (top-k's logit floor, -inf: none), log_min_p
// (-inf: none), uniform u and bound [B] (bound < 0: the whole row; else the weight a rejected
// round drew): (tokens [B] int64, next bound [B], -1 where the row's token is accepted). Rows
// whose temperature is not above 0 are not drawn: token 0, accepted.
std::tuple<at::Tensor, at::Tensor> sample_rows_truncated(const at::Tensor& logits, const at::Tensor& temperature,
                                                         const at::Tensor& top_p, const at::Tensor& floor,
                                                         const at::Tensor& log_min_p, const at::Tensor& u,
                                                         const at::Tensor& bound) {
  const bool avx512 = check_sample_logits(logits, "sample_rows_truncated");
  const int64_t B = logits.size(0), V = logits.size(1);
  for (const at::Tensor* t : {&temperature, &top_p, &floor, &log_min_p, &u, &bound})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == B,
                "temperature / top_p / floor / log_min_p / u / bound: float32 [B]");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor next = at::empty({B}, logits.options());
  const float *x = logits.data_ptr<float>(), *temp = temperature.data_ptr<float>();
  const float *pp = top_p.data_ptr<float>(), *fl = floor.data_ptr<float>(), *lm = log_min_p.data_ptr<float>();
  const float *uu = u.data_ptr<float>(), *bb = bound.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  float* nb = next.data_ptr<float>();
  const int64_t chunks = (V + kSampleChunk - 1) / kSampleChunk;
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    std::vector<float> w(chunks * kSampleChunk), sums(chunks), above(chunks);
    for (int64_t r = b; r < e; ++r) {
      const float* row = x + r * logits.stride(0);
      if (!(temp[r] > 0.f)) {
        tok[r] = 0;
        nb[r] = -1.f;
      } else if (avx512) {
        tok[r] = sample_row_truncated<SampleAvx512>(row, V, temp[r], pp[r], fl[r], lm[r], uu[r], bb[r], w.data(),
                                                    sums.data(), above.data(), nb + r);
      } else {
        tok[r] = sample_row_truncated<SampleAvx2>(row, V, temp[r], pp[r], fl[r], lm[r], uu[r], bb[r], w.data(),
                                                  sums.data(), above.data(), nb + r);
      }
    }
  });
  return {out, next};
}

// Each row's k-th largest logit of logits [B, V] (fp32, contiguous rows) for its top_k [B]
// (int64): apply_top_k's threshold, -inf where k is not below V (top-k off) or the row has
// fewer than k logits above -inf (sampling.h's kth_largest, one filtering pass a row).
at::Tensor top_k_floors(const at::Tensor& logits, const at::Tensor& top_k) {
  const bool avx512 = check_sample_logits(logits, "top_k_floors");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == B, "top_k: int64 [B]");
  at::Tensor out = at::empty({B}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* kk = top_k.data_ptr<int64_t>();
  float* fl = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf;
    for (int64_t r = b; r < e; ++r) {
      const float* row = x + r * logits.stride(0);
      const int64_t k = kk[r] < V ? kk[r] : 0;
      fl[r] = avx512 ? kth_largest<true>(row, V, k, buf) : kth_largest<false>(row, V, k, buf);
    }
  });
  return out;
}

// Logprobs of the rows of raw logits [B, V] (fp32, contiguous rows) for tokens [B] (int64):
// (ids [B, k + 1] int64, logprobs [B, k + 1] fp32, ranks [B] int64), column 0 each row's token,
// 1..k its top k (sampling.h's row_logprobs): log_softmax, gather and topk in one call.
std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs(const at::Tensor& logits,
                                                              const at::Tensor& tokens, int64_t k) {
  const bool avx512 = check_sample_logits(logits, "token_logprobs");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == B,
              "tokens: int64 [B]");
  TORCH_CHECK(k >= 0 && k <= V, "k: 0 to the vocabulary size, got ", k);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) TORCH_CHECK(tok[r] >= 0 && tok[r] < V, "token ", tok[r], " outside the vocabulary");
  at::Tensor ids = at::empty({B, k + 1}, logits.options().dtype(at::kLong));
  at::Tensor lps = at::empty({B, k + 1}, logits.options());
  at::Tensor ranks = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t *ip = ids.data_ptr<int64_t>(), *rp = ranks.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    std::vector<float> sums, buf;
    std::vector<int64_t> idx;
    for (int64_t r = b; r < e; ++r) {
      const float* row = x + r * logits.stride(0);
      int64_t* ir = ip + r * (k + 1);
      float* lr = lp + r * (k + 1);
      rp[r] = avx512 ? row_logprobs<SampleAvx512, true>(row, V, tok[r], k, ir, lr, sums, buf, idx)
                     : row_logprobs<SampleAvx2, false>(row, V, tok[r], k, ir, lr, sums, buf, idx);
    }
  });
  return {ids, lps, ranks};
}

// Grammar bitmasks on logits [R, V] (fp32, contiguous rows) in place: row rows[i] gets
// bitmask row i (packed [m, W] int32: bit j % 32 of word j / 32 allows token j) over its
// first `vocab` tokens; a forbidden token's logit becomes -inf. xgrammar's CPU kernel does
// the same on one thread: 7.8 ms of a step at 64 rows of a 49k vocabulary.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& packed, const at::Tensor& rows,
                         int64_t vocab) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits: float32 [R, V] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 2 && packed.is_contiguous(),
              "bitmask: contiguous int32 [m, W]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == packed.size(0),
              "rows: int64, one a bitmask row");
  TORCH_CHECK(vocab >= 0 && vocab <= logits.size(1) && vocab <= 32 * packed.size(1),
              "vocab: at most the logits' and the bitmask's width");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "row ", r[i], " outside the logits");
  const int32_t* bits = packed.data_ptr<int32_t>();
  float* x = logits.data_ptr<float>();
  const int64_t W = packed.size(1), ld = logits.stride(0);
  at::parallel_for(0, rows.numel(), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) mask_row(x + r[i] * ld, bits + i * W, vocab);
  });
}

// The first index of each row's maximum of logits [B, V] (fp32, contiguous rows), a NaN above
// every number: torch.argmax(logits, -1) in one pass a row (sampling.h), for greedy rows.
at::Tensor argmax_rows(const at::Tensor& logits) {
  const bool avx512 = check_sample_logits(logits, "argmax_rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "logits: an empty row has no argmax");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  at::parallel_for(0, B, row_grain(V), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = x + r * logits.stride(0);
      tok[r] = avx512 ? SampleAvx512::argmax(row, V) : SampleAvx2::argmax(row, V);
    }
  });
  return out;
}

// The fp8 format of an fp8 KV cache; none for a cache in the model's dtype.
std::optional<Fp8Kind> fp8_kind(const at::Tensor& kv_cache) {
  if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) return Fp8Kind::kE4M3;
  if (kv_cache.scalar_type() == at::kFloat8_e5m2) return Fp8Kind::kE5M2;
  return std::nullopt;
}

// kv_cache: contiguous [2, num_blocks, block_size, Hkv, D] in dtype `like`'s, or fp8 (fp8.h).
void check_kv_cache(const at::Tensor& kv_cache, const at::Tensor& like) {
  if (!fp8_kind(kv_cache)) check_like(kv_cache, like, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [2, num_blocks, block_size, Hkv, D]");
}

// An fp8 cache's K and V scales (fp8.h): the ops' k_scale / v_scale arguments, which a cache
// in the model's dtype leaves at 1.
struct KvScales {
  float k = 1.f, v = 1.f;
  KvScales(const at::Tensor& kv_cache, double k_scale, double v_scale)
      : k(static_cast<float>(k_scale)), v(static_cast<float>(v_scale)) {
    TORCH_CHECK(k > 0.f && v > 0.f && std::isfinite(k) && std::isfinite(v),
                "k_scale / v_scale: positive and finite, got ", k_scale, " / ", v_scale);
    TORCH_CHECK(fp8_kind(kv_cache) || (k == 1.f && v == 1.f),
                "k_scale / v_scale apply to an fp8 KV cache only");
  }
};

// Writes rows of K and V heads (bf16 / fp32, E's) into their cache slots: copied into a cache
// of their own dtype, stored as fp8 (fp8.h: times 1 / the scale) into an fp8 one.
struct KvRowWriter {
  char* k_plane;
  int64_t v_offset, row, elem;  // V plane - K plane (bytes); a slot's row (elements); bytes an element
  std::optional<Fp8Kind> fp8;
  float k_inv, v_inv;  // 1 / the scales, rounded to fp32 once

  KvRowWriter(at::Tensor& kv_cache, const KvScales& scales)
      : k_plane(static_cast<char*>(kv_cache.data_ptr())),
        row(kv_cache.size(3) * kv_cache.size(4)), elem(kv_cache.element_size()),
        fp8(fp8_kind(kv_cache)), k_inv(1.f / scales.k), v_inv(1.f / scales.v) {
    v_offset = kv_cache.size(1) * kv_cache.size(2) * row * elem;
  }
  // n elements of k and of v at element `offset` of slot `slot`'s row.
  template <class T>
  void put(int64_t slot, int64_t offset, const T* k, const T* v, int64_t n) const {
    char* dst = k_plane + (slot * row + offset) * elem;
    if (fp8) {
      fp8_store_row(reinterpret_cast<uint8_t*>(dst), k, n, *fp8, k_inv);
      fp8_store_row(reinterpret_cast<uint8_t*>(dst + v_offset), v, n, *fp8, v_inv);
    } else {
      std::memcpy(dst, k, n * sizeof(T));
      std::memcpy(dst + v_offset, v, n * sizeof(T));
    }
  }
};

// An fp8 cache's rows of one (request, KV head), widened (times their scales) into a
// contiguous scratch of the query's type, from where the bf16 / fp32 attention kernels read
// them: keys at rows [0, Lp), values at [Lp, 2 Lp), D elements a row. `args` has the paged
// cache's shape, block table and seq_lens (its kv pointer unused); `local` reads the scratch
// (block table: the identity).
template <class E>
struct Fp8Rows {
  using T = typename E::T;
  const uint8_t* cache;
  int64_t slots, Lp;
  Fp8Kind kind;
  KvScales scales;
  Fp8Bf16Lut luts[2];  // K's and V's codes read as bf16 (fp8.h)
  std::vector<int32_t> identity;  // block i of the scratch is block i

  Fp8Rows(const at::Tensor& kv_cache, int64_t max_len, Fp8Kind kind, const KvScales& scales)
      : cache(static_cast<const uint8_t*>(kv_cache.data_ptr())),
        slots(kv_cache.size(1) * kv_cache.size(2)), kind(kind), scales(scales),
        luts{Fp8Bf16Lut(kind, scales.k), Fp8Bf16Lut(kind, scales.v)} {
    const int64_t bs = kv_cache.size(2), blocks = (max_len + bs - 1) / bs;
    Lp = blocks * bs;
    identity.resize(blocks);
    std::iota(identity.begin(), identity.end(), 0);
  }
  // Widens tokens [from, to) of request b, KV head kvh into rows, the local args' kv: a
  // cache block's rows at a time, requesting those kLookahead tokens ahead into L2 meanwhile
  // (the blocks lie anywhere; the bf16 kernel's DecodeChunks does the same).
  void widen(const DecodeAttnArgs<E>& args, int64_t b, int64_t kvh, int64_t from, int64_t to,
             T* rows) const {
    constexpr int64_t kLookahead = 64;
    const int64_t D = args.head_size, stride = args.num_kv_heads * D, bs = args.block_size;
    const int32_t* table = args.block_table + b * args.bt_stride;
    for (int64_t plane = 0; plane < 2; ++plane) {
      const uint8_t* base = cache + plane * slots * stride + kvh * D;
      const auto at = [&](int64_t t) { return base + (int64_t(table[t / bs]) * bs + t % bs) * stride; };
      for (int64_t t = from; t < to;) {
        const int64_t n = std::min(to - t, bs - t % bs), ahead = t + kLookahead;
        const int64_t ahead_n = ahead < to ? std::min({n, to - ahead, bs - ahead % bs}) : 0;
        fp8_widen_rows<E>(rows + (plane * Lp + t) * D, at(t), n, stride, D, kind,
                          plane ? scales.v : scales.k, luts[plane], ahead_n ? at(ahead) : nullptr,
                          ahead_n);
        t += n;
      }
    }
  }
  DecodeAttnArgs<E> local(const DecodeAttnArgs<E>& args, const T* rows) const {
    DecodeAttnArgs<E> l = args;
    l.kv = rows;
    l.num_blocks = Lp / args.block_size;
    l.block_table = identity.data();
    l.bt_stride = 0;
    l.kv_stride = args.head_size;
    l.kv_head_stride = 0;
    return l;
  }
};

// slot_mapping: int64, each a slot of a cache of `slots`; their values.
const int64_t* checked_slots(const at::Tensor& slot_mapping, int64_t slots) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: int64");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " out of the KV cache");
  return slot;
}

// kv_cache[0][slot_mapping[t]] = key[t], kv_cache[1][slot_mapping[t]] = value[t] for the
// first n = slot_mapping.numel() rows: the step's K/V rows put into their cache slots, one
// memcpy per row into a cache of their dtype (what two index_copy_ calls do at ~10 ns an
// element), stored as fp8 into an fp8 one (KvRowWriter). Rows may be strided (the K and V
// columns of the fused QKV output); each row's heads must be contiguous.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  check_like(value, key, "value");
  check_kv_cache(kv_cache, key);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) * t->size(2) == row && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "key / value: [T, Hkv, D] rows with contiguous heads, as the cache's");
  const int64_t n = slot_mapping.numel();
  TORCH_CHECK(n <= key.size(0) && n <= value.size(0), "slot_mapping has more rows than key / value");
  const int64_t* slot = checked_slots(slot_mapping, slots);
  const KvRowWriter cache(kv_cache, KvScales(kv_cache, k_scale, v_scale));
  by_dtype(key, "key", [&]<class E>() {
    at::parallel_for(0, n, row_grain(2 * row), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        cache.put(slot[t], 0, data<E>(key) + t * key.stride(0), data<E>(value) + t * value.stride(0), row);
    });
  });
}

// paged_decode_attention's work, with before(E{}, b, kvh) run on an item's thread right before
// the item (request b, KV head kvh) attends.
template <class Before>
at::Tensor decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                                 int64_t max_seq_len, double scale, const KvScales& scales,
                                 Before&& before) {
  check_kv_cache(kv_cache, q);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "query: [B, H, D] rows");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(H % Hkv == 0 && kv_cache.size(4) == D, "head counts / sizes disagree");
  at::Tensor out = at::empty({B, H, D}, q.options());
  const int64_t G = H / Hkv;
  // Per item: the scores, the spread queries, 1 / sums and (bf16 kernel) the bf16 weights, or
  // (AVX2 kernel) a block of widened rows.
  const int64_t scratch =
      G * (max_seq_len + 2 * D + 1) + std::max(G * (max_seq_len + 1) / 2, (kv_cache.size(2) + 1) * D);
  const std::optional<Fp8Kind> fp8 = fp8_kind(kv_cache);
  by_dtype(q, "query", [&]<class E>() {
    DecodeAttnArgs<E> a{data<E>(out), data<E>(q), q.stride(0), data<E>(kv_cache),
                        kv_cache.size(1), kv_cache.size(2), H, Hkv, D,
                        block_table.data_ptr<int32_t>(), block_table.stride(0),
                        seq_lens.data_ptr<int32_t>(), static_cast<float>(scale), Hkv * D, D};
    // An fp8 cache: each item's rows widened first, then the same kernels on them.
    std::optional<Fp8Rows<E>> widened;
    if (fp8) widened.emplace(kv_cache, max_seq_len, *fp8, scales);
    at::parallel_for(0, B * Hkv, 1, [&](int64_t b, int64_t e) {
      const ThreadScratch<float, kDecodeAttnScratch> own(scratch);
      const ThreadScratch<typename E::T, kFp8RowsScratch> rows(widened ? 2 * widened->Lp * D : 0);
      float* buf = own.get();
      for (int64_t i = b; i < e; ++i) {
        const int64_t r = i / Hkv, h = i % Hkv;
        before(E{}, r, h);
        if (widened) {
          widened->widen(a, r, h, 0, a.seq_lens[r], rows.get());
          decode_item(widened->local(a, rows.get()), r, h, buf);
        } else {
          decode_item(a, r, h, buf, i + 1 < e ? (i + 1) / Hkv : -1, (i + 1) % Hkv);
        }
      }
    });
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                                  int64_t max_seq_len, double scale, double k_scale,
                                  double v_scale) {
  return decode_attention_impl(q, kv_cache, block_table, seq_lens, max_seq_len, scale,
                               KvScales(kv_cache, k_scale, v_scale), [](auto, int64_t, int64_t) {});
}

// A decode step's rotary_embedding, reshape_and_cache and paged_decode_attention on its qkv
// rows [T, q_size + 2 kv_size] (one request a row, one slot a row) in one pass: each attention
// item (request b, KV head h) first normalizes (Qwen3's q/k norms, if any) and rotates row
// b's query heads of group h and its key head h in place and writes key and value head h into
// the cache, on the thread that then attends with them. The same kernels on the same values
// as the separate ops, so the same bits; what it saves is two serial steps a layer on one
// thread (RoPE and the K/V write took 3.5 and 5-6 us a layer of an int8 batch-1 step, mostly
// waiting on memory, while the other thread idled).
at::Tensor decode_rope_cache_attention(const at::Tensor& qkv, int64_t q_size, int64_t kv_size,
                                       const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                       int64_t head_size, int64_t rot, at::Tensor& kv_cache,
                                       const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                       const at::Tensor& seq_lens, int64_t max_seq_len, double scale,
                                       const HeadNorms& norms, const KvScales& scales) {
  check_any_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), hkv = kv_size / head_size;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size && kv_size % head_size == 0 && q_size % kv_size == 0,
              "qkv: [T, q_size + 2 kv_size] rows of whole heads");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "a position and a slot a row");
  check_kv_cache(kv_cache, qkv);
  TORCH_CHECK(kv_cache.size(3) == hkv && kv_cache.size(4) == head_size, "kv_cache: [2, blocks, block_size, Hkv, D]");
  const int64_t* pos = checked_positions(positions, cos_sin_cache, rot);
  const int64_t* slot = checked_slots(slot_mapping, kv_cache.size(1) * kv_cache.size(2));
  const float* cs = cos_sin_cache.data_ptr<float>();
  const int64_t group = q_size / kv_size, ld = qkv.stride(0);
  const KvRowWriter cache(kv_cache, scales);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, q_size / head_size, head_size});
  return decode_attention_impl(
      q, kv_cache, block_table, seq_lens, max_seq_len, scale, scales,
      [&]<class E>(E, int64_t b, int64_t h) {
        using V = typename E::T;
        const auto rope = rope_kernel<E>();
        V* r = data<E>(qkv) + b * ld;
        V* k = r + q_size + h * head_size;
        const float* c = cs + pos[b] * rot;
        norms.apply<E>(r + h * group * head_size, group, head_size, false);
        norms.apply<E>(k, 1, head_size, true);
        rope(r + h * group * head_size, group, head_size, rot, c);
        rope(k, 1, head_size, rot, c);
        cache.put(slot[b], h * head_size, k, k + kv_size, head_size);
      });
}

// out[rows of request r] = causal attention of those query rows over the request's keys in the
// paged cache (its K/V rows written already), for each r in reqs (multi-token queries: a
// prefill, a chunk of one, or the rest after a prefix-cache hit); attention.h's prefill items,
// taken from a shared counter by ATen's threads.
void paged_prefill_attention(const at::Tensor& q, at::Tensor& out, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, const at::Tensor& reqs,
                             double scale, double k_scale, double v_scale) {
  TORCH_CHECK(cpu_has_avx2_fma(), "pagedllm::paged_prefill_attention needs AVX2 and FMA");
  check_kv_cache(kv_cache, q);
  check_like(out, q, "out");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "query: [T, H, D] rows");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, query's shape");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "query_start_loc: int64 [num_reqs + 1]");
  TORCH_CHECK(reqs.scalar_type() == at::kLong && reqs.is_contiguous(), "reqs: int64");
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(H % Hkv == 0 && kv_cache.size(4) == D, "head counts / sizes disagree");
  TORCH_CHECK(prefill_head_size_ok(D), "paged_prefill_attention: head size ", D, " not supported");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rp = reqs.data_ptr<int64_t>();
  // bf16 on the tile layout (attention_tiles.h: AMX tiles, else AVX512-BF16 vectors), or
  // the fp32 vector kernels; and their rows per item.
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const bool amx = bf16 && prefill_amx_applies(D);
  const bool tiles = bf16 && !amx && prefill_tiles_head_size(D) && cpu_has_avx512_bf16();
  const int64_t item_rows = amx || tiles ? kPrefillTileRows : kPrefillRows;
  const std::optional<Fp8Kind> fp8 = fp8_kind(kv_cache);
  const KvScales scales(kv_cache, k_scale, v_scale);
  std::vector<int64_t> items;  // request, row block, KV head
  int64_t max_len = 0;
  for (int64_t i = 0; i < reqs.numel(); ++i) {
    const int64_t r = rp[i];
    TORCH_CHECK(r >= 0 && r < seq_lens.numel(), "request ", r, " out of range");
    const int64_t qlen = qsl[r + 1] - qsl[r];
    TORCH_CHECK(qsl[r] >= 0 && qsl[r + 1] <= q.size(0) && qlen >= 0 && qlen <= lens[r] &&
                    (lens[r] + kv_cache.size(2) - 1) / kv_cache.size(2) <= block_table.size(1),
                "request ", r, ": query rows / seq_len / block table disagree");
    max_len = std::max<int64_t>(max_len, lens[r]);
    // An fp8 cache's items go row block innermost: a thread that takes the next row block of
    // the same request and head widens only the keys that block adds.
    if (fp8)
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t r0 = 0; r0 < qlen; r0 += item_rows) items.insert(items.end(), {r, r0, h});
    else
      for (int64_t r0 = 0; r0 < qlen; r0 += item_rows)
        for (int64_t h = 0; h < Hkv; ++h) items.insert(items.end(), {r, r0, h});
  }
  const int64_t total = static_cast<int64_t>(items.size()) / 3;
  if (total == 0) return;
  by_dtype(q, "query", [&]<class E>() {
    DecodeAttnArgs<E> a{data<E>(out), data<E>(q), q.stride(0), data<E>(kv_cache),
                        kv_cache.size(1), kv_cache.size(2), H, Hkv, D,
                        block_table.data_ptr<int32_t>(), block_table.stride(0), lens,
                        static_cast<float>(scale), Hkv * D, D};
    std::optional<Fp8Rows<E>> widened;
    if (fp8) widened.emplace(kv_cache, max_len, *fp8, scales);
    std::atomic<int64_t> next{0};
    // kernel(args, request, KV head, first row) for each item this thread claims; with an fp8
    // cache, args read the item's keys widened into the thread's scratch (those it widened
    // for its previous item stay, when that was of the same request and head).
    auto claim = [&](auto&& kernel) {
      if (!widened) {
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;)
          kernel(a, items[3 * i], items[3 * i + 2], items[3 * i + 1]);
        return;
      }
      const ThreadScratch<typename E::T, kFp8RowsScratch> rows(2 * widened->Lp * D);
      const DecodeAttnArgs<E> local = widened->local(a, rows.get());
      int64_t cur_r = -1, cur_h = -1, done = 0;  // tokens [0, done) of (cur_r, cur_h) widened
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
        const int64_t r = items[3 * i], r0 = items[3 * i + 1], h = items[3 * i + 2];
        const int64_t qlen = qsl[r + 1] - qsl[r];
        const int64_t end = lens[r] - qlen + std::min(qlen, r0 + item_rows);
        if (r != cur_r || h != cur_h) cur_r = r, cur_h = h, done = 0;
        if (end > done) widened->widen(a, r, h, done, end, rows.get()), done = end;
        kernel(local, r, h, r0);
      }
    };
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) {
      if constexpr (std::is_same_v<E, Bf16>) {
        if (amx) {
          claim([&](const DecodeAttnArgs<E>& args, int64_t r, int64_t h, int64_t r0) {
            prefill_item_amx(args, qsl, r, h, r0);
          });
          amx_release();
          return;
        }
        if (tiles) {
          claim([&](const DecodeAttnArgs<E>& args, int64_t r, int64_t h, int64_t r0) {
            prefill_item_tiles_bf16(args, qsl, r, h, r0);
          });
          return;
        }
      }
      std::vector<float> buf(prefill_scratch(H / Hkv, D));
      claim([&](const DecodeAttnArgs<E>& args, int64_t r, int64_t h, int64_t r0) {
        prefill_item(args, qsl, r, h, r0, buf.data());
      });
    });
  });
}

// The fused decoder-layer ops (layers/cpu_fused.py): a layer's projections, norms, RoPE and
// SiLU x mul in two calls around its attention, by the same kernels and in the same order as
// the separate ops (so bit for bit the same outputs), without the Python module and
// dispatcher hops between them (~200 us a layer on a small model's decode step).

// One projection: kind 0 = linear_avx2, 1 = linear_int8, 2 = linear (AVX512-BF16); the
// output in x's dtype, written into `into`'s rows when given.
at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& w,
                   const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& colsum,
                   const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor* into = nullptr) {
  switch (kind) {
    case 0: return linear_avx2(x, w, bias, n, false, into);
    case 1:
      TORCH_CHECK(scale && colsum, "an int8 projection needs its scales and column sums");
      return linear_int8(x, w, *scale, *colsum, bias, n, false, into);
    case 2: return linear(x, w, bias, n, false, into);
  }
  TORCH_CHECK(false, "unknown projection kind ", kind);
}

// Rows per chunk of a prefill's MLP (attention_out_mlp). Every kernel computes a row on its
// own, so chunking changes no bits.
int64_t prefill_chunk_rows() { return std::max<int64_t>(512, 2 * kRowBlock * at::get_num_threads()); }

// f(first row, rows) over [0, T) in prefill_chunk_rows() chunks; a last chunk of a single row
// joins the one before (a one-row product takes the one-row GEMM kernel, another rounding
// than the same row among others).
template <class F>
void for_row_chunks(int64_t T, F&& f) {
  const int64_t chunk = prefill_chunk_rows();
  for (int64_t t = 0; t < T;) {
    int64_t rows = std::min(chunk, T - t);
    if (T - t - rows == 1) ++rows;
    f(t, rows);
    t += rows;
  }
}

// qkv = qkv_proj(rms_norm(x + residual)) with RoPE (after the per-head q/k norms, when
// given) applied to its q and k columns in place;
// residual (when given) becomes x + residual, as fused_add_rms_norm leaves it. A prefill in
// row chunks, as attention_out_mlp's MLP: the normed rows and each chunk's q / k stay in
// cache between the three steps (an 8,192-token prefill 1.04-1.13x faster end to end,
// alternated).
at::Tensor attention_in(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                        const at::Tensor& norm_weight, double eps, int64_t qkv_kind,
                        const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_scale,
                        const c10::optional<at::Tensor>& qkv_colsum,
                        const c10::optional<at::Tensor>& qkv_bias, int64_t qkv_n, int64_t q_size,
                        int64_t kv_size, const at::Tensor& positions,
                        const at::Tensor& cos_sin_cache, int64_t head_size, int64_t rot,
                        const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double qk_eps) {
  TORCH_CHECK(q_size + 2 * kv_size == qkv_n, "q_size + 2 * kv_size must be the qkv width");
  const HeadNorms norms(q_norm, k_norm, qk_eps, x, head_size);
  const int64_t T = x.size(0);
  at::Tensor qkv = at::empty({T, qkv_n}, x.options());
  // Rows xr (their residual rows rr, positions pos) -> their rows out of qkv.
  auto rows_qkv = [&](const at::Tensor& xr, at::Tensor* rr, const at::Tensor& pos, at::Tensor& out) {
    at::Tensor h = rms_norm_impl(xr, rr, norm_weight, eps);
    project(h, qkv_kind, qkv_w, qkv_scale, qkv_colsum, qkv_bias, qkv_n, &out);
    at::Tensor q = out.narrow(1, 0, q_size), k = out.narrow(1, q_size, kv_size);
    rope_rows(pos, q, k, cos_sin_cache, head_size, rot, norms);
  };
  at::Tensor res = residual ? *residual : at::Tensor();
  if (T <= prefill_chunk_rows()) {
    rows_qkv(x, residual ? &res : nullptr, positions, qkv);
    return qkv;
  }
  for_row_chunks(T, [&](int64_t t, int64_t rows) {
    at::Tensor r = residual ? res.narrow(0, t, rows) : at::Tensor();
    at::Tensor part = qkv.narrow(0, t, rows);
    rows_qkv(x.narrow(0, t, rows), residual ? &r : nullptr, positions.narrow(0, t, rows), part);
  });
  return qkv;
}

// mlp(rms_norm(o_proj(attn) + residual)): residual becomes o_proj(attn) + residual.
at::Tensor attention_out_mlp(
    const at::Tensor& attn, at::Tensor& residual, int64_t o_kind, const at::Tensor& o_w,
    const c10::optional<at::Tensor>& o_scale, const c10::optional<at::Tensor>& o_colsum,
    const c10::optional<at::Tensor>& o_bias, int64_t o_n, const at::Tensor& norm_weight,
    double eps, int64_t gu_kind, const at::Tensor& gu_w, const c10::optional<at::Tensor>& gu_scale,
    const c10::optional<at::Tensor>& gu_colsum, const c10::optional<at::Tensor>& gu_bias,
    int64_t gu_n, int64_t down_kind, const at::Tensor& down_w,
    const c10::optional<at::Tensor>& down_scale, const c10::optional<at::Tensor>& down_colsum,
    const c10::optional<at::Tensor>& down_bias, int64_t down_n) {
  at::Tensor o = project(attn.contiguous(), o_kind, o_w, o_scale, o_colsum, o_bias, o_n);
  at::Tensor h = rms_norm_impl(o, &residual, norm_weight, eps);
  // bf16 panels (I a multiple of 64): SiLU x mul inside the gate / up product.
  // int8 panels with bf16 rows: the same inside the int8 product (int8_silu_fusable).
  const bool fused_silu = gu_kind == 2 && gu_n % (2 * kPanel) == 0;
  auto mlp = [&](const at::Tensor& rows, at::Tensor* into) {
    at::Tensor act;
    if (fused_silu)
      act = linear_silu_mul(rows, gu_w, gu_bias, gu_n);
    else if (gu_kind == 1 && gu_scale && gu_colsum && int8_silu_fusable(rows, gu_n))
      act = linear_int8_silu_mul(rows, gu_w, *gu_scale, *gu_colsum, gu_bias, gu_n);
    else
      act = silu_and_mul(project(rows, gu_kind, gu_w, gu_scale, gu_colsum, gu_bias, gu_n));
    return project(act, down_kind, down_w, down_scale, down_colsum, down_bias, down_n, into);
  };
  // A prefill's MLP in row chunks: its [T, 2 * I] intermediate and the widened activations
  // stay a few MB (in cache, reused by the allocator) instead of tens of MB mapped and
  // faulted in afresh each layer. (The whole tail in chunks, o_proj and the norm included,
  // was not faster: 4 alternated runs of a 128-prompt prefill.)
  const int64_t T = h.size(0);
  if (T <= prefill_chunk_rows()) return mlp(h, nullptr);
  at::Tensor out = at::empty({T, down_n}, h.options());
  for_row_chunks(T, [&](int64_t t, int64_t rows) {
    at::Tensor part = out.narrow(0, t, rows);
    mlp(h.narrow(0, t, rows), &part);  // the down projection writes out's rows
  });
  return out;
}

// A whole layer for a decode-only step (one request, one position and one slot a row):
// attention_in's norm and QKV projection, then decode_rope_cache_attention (q/k norms, RoPE,
// the K/V rows into the cache, decode attention over every row), attention_out_mlp. Without a
// residual (the first layer) x is the residual stream, updated in place.
at::Tensor decoder_layer_decode(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& norm_weight,
    double eps, int64_t qkv_kind, const at::Tensor& qkv_w,
    const c10::optional<at::Tensor>& qkv_scale, const c10::optional<at::Tensor>& qkv_colsum,
    const c10::optional<at::Tensor>& qkv_bias, int64_t qkv_n, int64_t q_size, int64_t kv_size,
    const at::Tensor& positions, const at::Tensor& cos_sin_cache, int64_t head_size, int64_t rot,
    at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& seq_lens, int64_t max_seq_len, double scale, int64_t o_kind,
    const at::Tensor& o_w, const c10::optional<at::Tensor>& o_scale,
    const c10::optional<at::Tensor>& o_colsum, const c10::optional<at::Tensor>& o_bias,
    int64_t o_n, const at::Tensor& norm2_weight, double eps2, int64_t gu_kind,
    const at::Tensor& gu_w, const c10::optional<at::Tensor>& gu_scale,
    const c10::optional<at::Tensor>& gu_colsum, const c10::optional<at::Tensor>& gu_bias,
    int64_t gu_n, int64_t down_kind, const at::Tensor& down_w,
    const c10::optional<at::Tensor>& down_scale, const c10::optional<at::Tensor>& down_colsum,
    const c10::optional<at::Tensor>& down_bias, int64_t down_n,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
    double qk_eps, double k_scale, double v_scale) {
  const int64_t T = x.size(0);
  TORCH_CHECK(block_table.size(0) == T && seq_lens.numel() == T,
              "decoder_layer_decode: one decode request a row");
  const HeadNorms norms(q_norm, k_norm, qk_eps, x, head_size);
  at::Tensor res = residual ? *residual : x;
  const at::Tensor h = rms_norm_impl(x, residual ? &res : nullptr, norm_weight, eps);
  const at::Tensor qkv = project(h, qkv_kind, qkv_w, qkv_scale, qkv_colsum, qkv_bias, qkv_n);
  const at::Tensor attn = decode_rope_cache_attention(
      qkv, q_size, kv_size, positions, cos_sin_cache, head_size, rot, kv_cache, slot_mapping,
      block_table, seq_lens, max_seq_len, scale, norms, KvScales(kv_cache, k_scale, v_scale));
  return attention_out_mlp(attn.view({T, q_size}), res, o_kind, o_w, o_scale, o_colsum, o_bias,
                           o_n, norm2_weight, eps2, gu_kind, gu_w, gu_scale, gu_colsum, gu_bias,
                           gu_n, down_kind, down_w, down_scale, down_colsum, down_bias, down_n);
}

}  // namespace

// A pipeline stage's decoder layers for decode-only steps in one call (layers/cpu_fused.py's
// FusedStack): each layer's decoder_layer_decode arguments but the step's are bound once, and
// `decode` runs the layers in order, as the per-layer calls would (the same kernels, so the
// same bits). What it saves is a dispatcher entry a layer, each parsing ~40 arguments from
// Python: ~50 us a layer on SmolLM2's batch-1 step, ~1.5 ms of a 9-13 ms step.
struct DecodeStack : torch::CustomClassHolder {
  struct Projection {
    int64_t kind, n;
    at::Tensor w;
    c10::optional<at::Tensor> scale, colsum, bias;
  };
  struct Layer {
    at::Tensor norm_w, norm2_w, cos_sin_cache;
    c10::optional<at::Tensor> q_norm, k_norm;
    at::Tensor kv_scales;  // the layer's [k_scale, v_scale] (fp32), read at each step
    double eps, eps2, scale, qk_eps;
    int64_t q_size, kv_size, head_size, rot;
    Projection qkv, o, gate_up, down;
  };
  std::vector<Layer> layers;

  // What a layer's ops read besides the weights' panels and the step's rows, requested into
  // the cache before the layer runs: its tensors' metadata (TensorImpl, StorageImpl), then the
  // norms' weights and the projections' scales, column sums and biases. A step streams every
  // weight through the caches, so each of these is a miss from memory by the next step, and
  // the ops take them one after another (a projection's checks walk its tensors' metadata
  // before any panel streams): each layer of an int8 batch-1 step waited on tens of them
  // (both norms ~1.2 us faster a call, the int8 inputs' checks ~1 us, with this).
  static void prefetch_layer(const Layer& l, const at::Tensor& cache) {
    // Small tensors (read whole) first, then the large ones (their metadata only).
    const at::Tensor* ts[24] = {&l.norm_w, &l.norm2_w};
    int small = 2;
    for (const c10::optional<at::Tensor>* t : {&l.q_norm, &l.k_norm})
      if (*t) ts[small++] = &**t;
    const Projection* ps[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (const Projection* p : ps)
      for (const c10::optional<at::Tensor>* t : {&p->scale, &p->colsum, &p->bias})
        if (*t) ts[small++] = &**t;
    int n = small;
    for (const Projection* p : ps) ts[n++] = &p->w;
    ts[n++] = &l.cos_sin_cache;
    ts[n++] = &cache;
    auto lines = [](const void* p, int64_t bytes) {
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
    };
    for (int i = 0; i < n; ++i) lines(ts[i]->unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
    for (int i = 0; i < n; ++i)
      lines(ts[i]->unsafeGetTensorImpl()->storage().unsafeGetStorageImpl(), sizeof(c10::StorageImpl));
    for (int i = 0; i < small; ++i) lines(ts[i]->data_ptr(), ts[i]->nbytes());
  }

  // tensors: per projection (qkv, o, gate_up, down) its weight, scale, colsum and bias, then
  // the two norms' weights, the RoPE table, the per-head q and k norms' weights (None
  // without) and the layer's K/V scales (a [2] fp32 tensor the attention layer owns: read at
  // each step, so scales set after the stack was built reach it); ints: the projections'
  // kinds and widths (kind, n each), then q_size, kv_size, head_size, rot; floats: eps, eps2,
  // scale, the q/k norms' eps.
  void add_layer(const c10::List<c10::optional<at::Tensor>>& tensors, const c10::List<int64_t>& ints,
                 const c10::List<double>& floats) {
    TORCH_CHECK(tensors.size() == 22 && ints.size() == 12 && floats.size() == 4,
                "DecodeStack.add_layer: 22 tensors, 12 ints, 4 floats");
    auto need = [&](size_t i) {
      const c10::optional<at::Tensor> t = tensors.get(i);
      TORCH_CHECK(t.has_value(), "DecodeStack.add_layer: tensor ", i, " is required");
      return *t;
    };
    Layer l;
    Projection* ps[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int j = 0; j < 4; ++j)
      *ps[j] = Projection{ints.get(2 * j), ints.get(2 * j + 1), need(4 * j), tensors.get(4 * j + 1),
                          tensors.get(4 * j + 2), tensors.get(4 * j + 3)};
    l.norm_w = need(16);
    l.norm2_w = need(17);
    l.cos_sin_cache = need(18);
    l.q_norm = tensors.get(19), l.k_norm = tensors.get(20);
    l.kv_scales = need(21);
    TORCH_CHECK(l.kv_scales.scalar_type() == at::kFloat && l.kv_scales.numel() == 2 &&
                    l.kv_scales.is_contiguous(),
                "DecodeStack.add_layer: the K/V scales, a [2] float32 tensor");
    l.q_size = ints.get(8), l.kv_size = ints.get(9), l.head_size = ints.get(10), l.rot = ints.get(11);
    l.eps = floats.get(0), l.eps2 = floats.get(1), l.scale = floats.get(2), l.qk_eps = floats.get(3);
    layers.push_back(std::move(l));
  }

  // (hidden, residual) after every layer, from the stage's input hidden rows x (updated in
  // place as the residual stream when residual is None, as the first layer's call does).
  std::tuple<at::Tensor, at::Tensor> decode(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& positions, const at::TensorList kv_caches,
                                            const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                            const at::Tensor& seq_lens, int64_t max_seq_len) {
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack.decode: a KV cache a layer");
    at::Tensor h = x;
    c10::optional<at::Tensor> r = residual;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      prefetch_layer(l, kv_caches[i]);
      at::Tensor cache = kv_caches[i];
      at::Tensor out = decoder_layer_decode(
          h, r, l.norm_w, l.eps, l.qkv.kind, l.qkv.w, l.qkv.scale, l.qkv.colsum, l.qkv.bias, l.qkv.n,
          l.q_size, l.kv_size, positions, l.cos_sin_cache, l.head_size, l.rot, cache, slot_mapping,
          block_table, seq_lens, max_seq_len, l.scale, l.o.kind, l.o.w, l.o.scale, l.o.colsum,
          l.o.bias, l.o.n, l.norm2_w, l.eps2, l.gate_up.kind, l.gate_up.w, l.gate_up.scale,
          l.gate_up.colsum, l.gate_up.bias, l.gate_up.n, l.down.kind, l.down.w, l.down.scale,
          l.down.colsum, l.down.bias, l.down.n, l.q_norm, l.k_norm, l.qk_eps,
          l.kv_scales.data_ptr<float>()[0], l.kv_scales.data_ptr<float>()[1]);
      if (!r) r = h;
      h = out;
    }
    return {h, r ? *r : h};
  }
};

}  // namespace pagedllm

TORCH_LIBRARY(pagedllm, m) {
  m.class_<pagedllm::DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &pagedllm::DecodeStack::add_layer)
      .def("decode", &pagedllm::DecodeStack::decode);
  m.def("cpu_has_avx512_bf16() -> bool", &pagedllm::cpu_has_avx512_bf16);
  m.def("cpu_has_avx512_vnni() -> bool", &pagedllm::cpu_has_avx512_vnni);
  m.def("cpu_has_avx2_fma() -> bool", &pagedllm::cpu_has_avx2_fma);
  m.def("cpu_has_amx() -> bool", &pagedllm::amx_usable);
  // A kernel switch's op: sets it when given a value; returns it.
  auto switch_op = [](std::atomic<bool>& (*flag)()) {
    return [flag](c10::optional<bool> use) {
      if (use) flag().store(*use, std::memory_order_relaxed);
      return flag().load(std::memory_order_relaxed);
    };
  };
  m.def("cpu_int8_row_words(bool? use) -> bool", switch_op(&pagedllm::int8_row_words));
  m.def("cpu_int8_row_stream(bool? use) -> bool", switch_op(&pagedllm::int8_row_stream));
  m.def("cpu_fp8_vbmi(bool? use) -> bool", switch_op(&pagedllm::fp8_vbmi));
  m.def("cpu_allow_amx(bool allowed) -> ()",
        [](bool allowed) { pagedllm::amx_allowed().store(allowed, std::memory_order_relaxed); });
  // GEMMs: CPU kernels (not catch-alls) so that build.py can give them fakes for torch.compile.
  m.def("linear_silu_mul(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
           int64_t n) { return pagedllm::linear_silu_mul(x, w, bias, n); });
  m.def("linear_avx2(Tensor x, Tensor w, Tensor? bias, int n, bool out_fp32) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int n, bool out_fp32) -> Tensor",
        [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
           int64_t n, bool out_fp32) { return pagedllm::linear(x, w, bias, n, out_fp32); });
  m.def("linear_int8(Tensor x, Tensor w, Tensor w_scale, Tensor colsum, Tensor? bias, int n, "
        "bool out_fp32) -> Tensor");
  m.def("linear_int8_silu_mul(Tensor x, Tensor w, Tensor w_scale, Tensor colsum, Tensor? bias, "
        "int n) -> Tensor", &pagedllm::linear_int8_silu_mul);
  m.def("int8_silu_fusable(Tensor x, int n) -> bool", &pagedllm::int8_silu_fusable);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &pagedllm::rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &pagedllm::fused_add_rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &pagedllm::silu_and_mul);
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor", &pagedllm::sample_rows);
  m.def("sample_rows_truncated(Tensor logits, Tensor temperature, Tensor top_p, Tensor floor, Tensor log_min_p, "
        "Tensor u, Tensor bound) -> (Tensor, Tensor)",
        &pagedllm::sample_rows_truncated);
  m.def("top_k_floors(Tensor logits, Tensor top_k) -> Tensor", &pagedllm::top_k_floors);
  m.def("argmax_rows(Tensor logits) -> Tensor", &pagedllm::argmax_rows);
  m.def("token_logprobs(Tensor logits, Tensor tokens, int k) -> (Tensor, Tensor, Tensor)",
        &pagedllm::token_logprobs);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows, int vocab) -> ()",
        &pagedllm::apply_token_bitmask);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, "
        "int head_size, int rot) -> ()", &pagedllm::rotary_embedding);
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "float k_scale=1., float v_scale=1.) -> ()",
        &pagedllm::reshape_and_cache);
  m.def("paged_prefill_attention(Tensor q, Tensor(a!) out, Tensor kv_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor reqs, float scale, float k_scale=1., "
        "float v_scale=1.) -> ()",
        &pagedllm::paged_prefill_attention);
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "int max_seq_len, float scale, float k_scale=1., float v_scale=1.) -> Tensor",
        &pagedllm::paged_decode_attention);
  m.def("attention_in(Tensor x, Tensor(a!)? residual, Tensor norm_weight, float eps, "
        "int qkv_kind, Tensor qkv_w, Tensor? qkv_scale, Tensor? qkv_colsum, Tensor? qkv_bias, "
        "int qkv_n, int q_size, int kv_size, Tensor positions, Tensor cos_sin_cache, "
        "int head_size, int rot, Tensor? q_norm=None, Tensor? k_norm=None, float qk_eps=0.) "
        "-> Tensor", &pagedllm::attention_in);
  m.def("attention_out_mlp(Tensor attn, Tensor(a!) residual, int o_kind, Tensor o_w, "
        "Tensor? o_scale, Tensor? o_colsum, Tensor? o_bias, int o_n, Tensor norm_weight, "
        "float eps, int gu_kind, Tensor gu_w, Tensor? gu_scale, Tensor? gu_colsum, "
        "Tensor? gu_bias, int gu_n, int down_kind, Tensor down_w, Tensor? down_scale, "
        "Tensor? down_colsum, Tensor? down_bias, int down_n) -> Tensor",
        &pagedllm::attention_out_mlp);
  m.def("decoder_layer_decode(Tensor(a!) x, Tensor(b!)? residual, Tensor norm_weight, float eps, "
        "int qkv_kind, Tensor qkv_w, Tensor? qkv_scale, Tensor? qkv_colsum, Tensor? qkv_bias, "
        "int qkv_n, int q_size, int kv_size, Tensor positions, Tensor cos_sin_cache, "
        "int head_size, int rot, Tensor(c!) kv_cache, Tensor slot_mapping, Tensor block_table, "
        "Tensor seq_lens, int max_seq_len, float scale, int o_kind, Tensor o_w, Tensor? o_scale, "
        "Tensor? o_colsum, Tensor? o_bias, int o_n, Tensor norm2_weight, float eps2, "
        "int gu_kind, Tensor gu_w, Tensor? gu_scale, Tensor? gu_colsum, Tensor? gu_bias, "
        "int gu_n, int down_kind, Tensor down_w, Tensor? down_scale, Tensor? down_colsum, "
        "Tensor? down_bias, int down_n, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float qk_eps=0., float k_scale=1., float v_scale=1.) -> Tensor",
        &pagedllm::decoder_layer_decode);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("linear_avx2", [](const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias, int64_t n, bool out_fp32) {
    return pagedllm::linear_avx2(x, w, bias, n, out_fp32);
  });
  m.impl("linear_int8", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                          const at::Tensor& colsum, const c10::optional<at::Tensor>& bias,
                          int64_t n, bool out_fp32) {
    return pagedllm::linear_int8(x, w, w_scale, colsum, bias, n, out_fp32);
  });
}
