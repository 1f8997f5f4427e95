"""fp32 GEMMs on this CPU: MKL (`F.linear`, what transformers runs), oneDNN on a prepacked
weight (what vLLM's CPU backend runs), and pagedllm's fp32 panels (`ops/csrc/gemm_f32.h`).

Shapes are the demo model's (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49,152); each
timing cycles through enough copies of the weight (>= 200 MB) that, as in a decode step,
the weights come from memory and not from cache. All threads; the median of 15 passes; the
three kinds alternate per shape. Prints time per GEMM, GB/s of weights and GFLOP/s.

    python scripts/cpu_gemm_f32.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_gemm import to_panels
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
    fn()
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[passes // 2]


def main() -> None:
    ops = cpu_ops()
    panels_ok = ops is not None and ops.cpu_has_avx2_fma()
    print(f"threads {torch.get_num_threads()}, fp32 panels: {panels_ok}")
    print("| N x K | M | MKL (F.linear) | oneDNN prepacked | pagedllm panels | panels vs oneDNN |")
    print("|---|---|---|---|---|---|")
    for n, k in SHAPES:
        copies = max(1, (200 << 20) // (n * k * 4))
        weights = [torch.randn(n, k) for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        panels = [to_panels(w) for w in weights] if panels_ok else []
        for m in ROWS:
            if m > 64 and n * k > 10_000_000:
                continue
            x = torch.randn(m, k)
            kinds = {
                "mkl": lambda x=x, ws=weights: [F.linear(x, w) for w in ws],
                "onednn": lambda x=x, ps=packed: [
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in ps
                ],
            }
            if panels_ok:
                kinds["panels"] = lambda x=x, ps=panels, n=n: [
                    ops.linear_f32(x, p, None, n) for p in ps
                ]
            cells = {}
            for name, fn in kinds.items():
                s = median_seconds(fn) / copies
                gbs, gflops = n * k * 4 / s / 1e9, 2 * m * n * k / s / 1e9
                cells[name] = (s, f"{s * 1e6:.0f} us ({gbs:.1f} GB/s, {gflops:.0f} GFLOP/s)")
            ratio = f"{cells['onednn'][0] / cells['panels'][0]:.2f}x" if panels_ok else "-"
            row = [cells[name][1] for name in ("mkl", "onednn")]
            row.append(cells["panels"][1] if panels_ok else "-")
            print(f"| {n} x {k} | {m} | " + " | ".join(row) + f" | {ratio} |")


if __name__ == "__main__":
    main()
