"""fp32 GEMMs on this CPU: MKL (`F.linear`, what transformers runs), oneDNN on a prepacked
weight (what vLLM's CPU backend runs), and pagedllm's fp32 panels (`ops/csrc/gemm_f32.h`).
With `--weight-dtypes`: pagedllm's AVX2 panels by weight dtype instead: fp32, bf16 (widened
on load, fp32 sums; bf16 activations) and int8 (W8A16, `ops/csrc/gemm_int8.h`; fp32
activations), GB/s counted in each one's own weight bytes.

Shapes are the demo model's (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49,152); each
timing cycles through enough copies of the weight (>= 200 MB) that, as in a decode step,
the weights come from memory and not from cache. All threads; the median of 15 passes; the
three kinds alternate per shape. Prints time per GEMM, GB/s of weights and GFLOP/s.

    python scripts/cpu_gemm_f32.py [--weight-dtypes]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pagedllm.benchmarks.timing import call_seconds
from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.layers.quantization import quantize_rows
from pagedllm.ops import cpu_ops

SHAPES = [
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (49152, 576),
]  # qkv, o, gate_up, down, head
ROWS = (1, 4, 16, 64, 512)


def median_seconds(fn, passes: int = 15) -> float:
    return sorted(call_seconds(fn, passes))[passes // 2]


def shapes():
    """(N, K, enough weight copies to exceed the caches) per shape."""
    for n, k in SHAPES:
        yield n, k, [torch.randn(n, k) for _ in range(max(1, (200 << 20) // (n * k * 4)))]


def rows(n: int, k: int):
    """The batch sizes timed for an N x K weight (no prefill sizes for the LM head)."""
    return [m for m in ROWS if m <= 64 or n * k <= 10_000_000]


def timed(kinds: dict, copies: int, n: int, k: int, m: int) -> dict[str, tuple[float, str]]:
    """name -> (seconds per GEMM, table cell) for kinds: name -> (weight bytes per value, fn
    over all copies)."""
    cells = {}
    for name, (nbytes, fn) in kinds.items():
        s = median_seconds(fn) / copies
        gbs, gflops = n * k * nbytes / s / 1e9, 2 * m * n * k / s / 1e9
        cells[name] = (s, f"{s * 1e6:.0f} us ({gbs:.1f} GB/s, {gflops:.0f} GFLOP/s)")
    return cells


def main() -> None:
    ops = cpu_ops()
    panels_ok = ops is not None and ops.cpu_has_avx2_fma()
    print(f"threads {torch.get_num_threads()}, fp32 panels: {panels_ok}")
    print("| N x K | M | MKL (F.linear) | oneDNN prepacked | pagedllm panels | panels vs oneDNN |")
    print("|---|---|---|---|---|---|")
    for n, k, weights in shapes():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        panels = [to_panels(w, 1) for w in weights] if panels_ok else []
        for m in rows(n, k):
            x = torch.randn(m, k)
            kinds = {
                "mkl": (4, lambda x=x, ws=weights: [F.linear(x, w) for w in ws]),
                "onednn": (
                    4,
                    lambda x=x, ps=packed: [
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in ps
                    ],
                ),
            }
            if panels_ok:
                kinds["panels"] = (
                    4,
                    lambda x=x, ps=panels, n=n: [ops.linear_avx2(x, p, None, n, False) for p in ps],
                )
            cells = timed(kinds, len(weights), n, k, m)
            ratio = f"{cells['onednn'][0] / cells['panels'][0]:.2f}x" if panels_ok else "-"
            row = [cells[name][1] for name in ("mkl", "onednn")]
            row.append(cells["panels"][1] if panels_ok else "-")
            print(f"| {n} x {k} | {m} | " + " | ".join(row) + f" | {ratio} |")


def by_weight_dtype() -> None:
    ops = cpu_ops()
    print(f"threads {torch.get_num_threads()}")
    print("| N x K | M | fp32 | bf16 | int8 (W8A16) | fp32 / bf16 | fp32 / int8 |")
    print("|---|---|---|---|---|---|---|")
    for n, k, weights in shapes():
        f32 = [to_panels(w, 1) for w in weights]
        b16 = [to_panels(w.to(torch.bfloat16), 1) for w in weights]
        i8 = []
        for w in weights:
            q, scale = quantize_rows(w)
            panels = to_panels(q)
            colsum = F.pad(q.sum(dim=1, dtype=torch.int32), (0, panels.shape[0] * 64 - n))
            i8.append((panels, scale, colsum))
        for m in rows(n, k):
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            kinds = {
                "fp32": (
                    4,
                    lambda x=x, ps=f32, n=n: [ops.linear_avx2(x, p, None, n, False) for p in ps],
                ),
                "bf16": (
                    2,
                    lambda x=xb, ps=b16, n=n: [ops.linear_avx2(x, p, None, n, False) for p in ps],
                ),
                "int8": (
                    1,
                    lambda x=x, ps=i8, n=n: [
                        ops.linear_int8(x, p, s, c, None, n, False) for p, s, c in ps
                    ],
                ),
            }
            cells = timed(kinds, len(weights), n, k, m)
            ratios = [f"{cells['fp32'][0] / cells[d][0]:.2f}x" for d in ("bf16", "int8")]
            row = [cells[name][1] for name in ("fp32", "bf16", "int8")]
            print(f"| {n} x {k} | {m} | " + " | ".join(row + ratios) + " |")


if __name__ == "__main__":
    by_weight_dtype() if "--weight-dtypes" in sys.argv[1:] else main()
