"""The 120 SmolLM2 projections (`cpu_projections.py`'s: 30 layers of random bf16 panels) with
their weights on 4 KB pages (PyTorch's allocation) and in one huge-page arena (the loader's
`place_panels_on_huge_pages`), alternated round by round in one process. Prints per row
count the medians, the weights' GB/s, and the median ratio (4 KB time / arena time).

    python scripts/cpu_weight_pages.py [ROWS ...] [--rounds 31]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.layers.cpu_memory import place_panels_on_huge_pages
from pagedllm.ops import cpu_ops

sys.path.insert(0, str(Path(__file__).parent))
from cpu_projections import INTER, LAYERS, SHAPES  # noqa: E402  (the same 120 products)


class _Panels(nn.Module):
    def __init__(self, panels: torch.Tensor):
        super().__init__()
        self.register_buffer("weight_panels", panels, persistent=False)


def weights() -> nn.ModuleList:
    return nn.ModuleList(
        _Panels(to_panels((torch.randn(n, k) * 0.05).bfloat16()))
        for _ in range(LAYERS)
        for n, k in SHAPES
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    ops = cpu_ops()
    if ops is None or not ops.cpu_has_avx512_bf16():
        sys.exit("needs pagedllm's native AVX512-BF16 kernels")
    plain, arena = weights(), weights()
    place_panels_on_huge_pages(arena)
    gb = sum(n * k * 2 for n, k in SHAPES) * LAYERS / 1e9
    for m in args.rows:
        xs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}

        def run(layers: nn.ModuleList, xs: dict = xs) -> None:
            for i, layer in enumerate(layers):
                n, k = SHAPES[i % len(SHAPES)]
                if n == 2 * INTER:
                    ops.linear_silu_mul(xs[k], layer.weight_panels, None, n)
                else:
                    ops.linear(xs[k], layer.weight_panels, None, n, False)

        times: dict[str, list[float]] = {"4 KB": [], "arena": []}
        for r in range(args.rounds):
            pairs = [("4 KB", plain), ("arena", arena)]
            for name, layers in pairs if r % 2 else pairs[::-1]:
                start = time.perf_counter()
                run(layers)
                times[name].append(time.perf_counter() - start)
        ratios = sorted(a / b for a, b in zip(times["4 KB"], times["arena"]))
        cells = [
            f"{name} {statistics.median(t) * 1e3:.2f} ms ({gb / statistics.median(t):.1f} GB/s)"
            for name, t in times.items()
        ]
        print(f"rows {m:4d}: {'  '.join(cells)}  ratio {statistics.median(ratios):.3f} "
              f"(rounds {ratios[0]:.2f} .. {ratios[-1]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
