"""bf16 GEMMs on this CPU: oneDNN on its prepacked weight (`mkldnn._linear_pointwise`, what
vLLM's CPU backend and pagedllm's "onednn" layout run) against pagedllm's bf16 panels
(`torch.ops.pagedllm.linear`: AMX tiles from two rows on where the CPU has them, else
AVX512-BF16). SmolLM2-135M's shapes, or with --model those of a checkpoint's config.json;
one weight per shape, reused (so the smaller ones are served from cache, as in a prefill); all
threads; the median of 7 blocks of calls, the two kinds alternating block by block. Prints
microseconds and GFLOP/s.

    python scripts/cpu_gemm_bf16.py [--model DIR] [M ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch

from pagedllm.benchmarks.timing import call_seconds
from pagedllm.benchmarks.vs_vllm import projection_shapes
from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def main() -> None:
    ops = cpu_ops()
    if ops is None or not ops.cpu_has_avx512_bf16():
        sys.exit("needs pagedllm's native kernels and AVX512-BF16")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="take the shapes of this checkpoint")
    p.add_argument("rows", nargs="*", type=int, default=[1, 8, 64, 512])
    args = p.parse_args()
    shapes = projection_shapes(args.model) if args.model else SHAPES
    print(f"threads {torch.get_num_threads()}, AMX tiles: {ops.cpu_has_amx()}")
    print("| shape (N x K) | M | oneDNN | panels | oneDNN / panels |")
    print("|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k) * 0.05).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        panels = to_panels(w)
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            calls = max(3, int(1e8 / (2 * m * n * k)))
            kinds = {
                "onednn": partial(
                    torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""
                ),
                "panels": partial(ops.linear, x, panels, None, n, False),
            }
            blocks: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(7):
                for kind, fn in kinds.items():
                    blocks[kind].append(sum(call_seconds(fn, calls)) / calls)
            us = {kind: statistics.median(t) * 1e6 for kind, t in blocks.items()}
            flop = 2 * m * n * k / 1e3  # per microsecond: MFLOP -> GFLOP/s
            print(
                f"| {name} {n} x {k} | {m} | {us['onednn']:.0f} us ({flop / us['onednn']:.0f} "
                f"GFLOP/s) | {us['panels']:.0f} us ({flop / us['panels']:.0f} GFLOP/s) | "
                f"{us['onednn'] / us['panels']:.2f}x |"
            )


if __name__ == "__main__":
    main()
