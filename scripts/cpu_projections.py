"""The four projections of 30 SmolLM2-135M-shaped layers (random bf16 weights, each layer its
own, so they stream from memory as in a real step) on pagedllm's panel GEMMs, at several row
counts: milliseconds for all 120 products (median of the rounds), the weights' GB/s and the
products' GFLOP/s. Row counts 1-64 are decode batches, larger ones prefill chunks.

    python scripts/cpu_projections.py [ROWS ...] [--rounds 7] [--threads N ...]

`--threads 1 2` times each row count at each thread count, alternated in the process (one
core's two hyperthreads share one AMX unit: what the second thread adds). Compare two commits'
kernels with `cpu_ops_ab.py` (one process), not by running this on each in turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops

HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 576, 192, 30
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (n, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int, nargs="*", default=[1, 2, 16, 64, 128, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="*", default=[torch.get_num_threads()])
    args = parser.parse_args()
    if cpu_ops() is None:
        sys.exit("needs pagedllm's native kernels")
    linear = torch.ops.pagedllm.linear
    weights = [
        [to_panels((torch.randn(n, k) * 0.05).bfloat16()) for n, k in SHAPES] for _ in range(LAYERS)
    ]
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    params = sum(n * k for n, k in SHAPES) * LAYERS
    inputs = {m: {k: torch.randn(m, k).bfloat16() for _, k in SHAPES} for m in args.rows}

    def run(m: int) -> float:
        start = time.perf_counter()
        for layer in weights:
            for (n, k), w in zip(SHAPES, layer):
                linear(inputs[m][k], w, None, n, False)
        return time.perf_counter() - start

    for m in args.rows:
        run(m)  # warm-up
    seconds: dict[tuple[int, int], list[float]] = {
        (m, t): [] for m in args.rows for t in args.threads
    }
    for r in range(args.rounds):  # row counts interleaved, so a slow phase hits them all
        for m in args.rows:
            for t in args.threads if r % 2 else args.threads[::-1]:
                torch.set_num_threads(t)
                seconds[m, t].append(run(m))
    for m in args.rows:
        for t in args.threads:
            s = statistics.median(seconds[m, t])
            print(
                f"rows {m:5d}, {t} thread(s): {s * 1e3:8.2f} ms  weights "
                f"{weight_bytes / s / 1e9:5.1f} GB/s  {2 * m * params / s / 1e9:7.0f} GFLOP/s"
            )


if __name__ == "__main__":
    main()
