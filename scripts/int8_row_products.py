"""One activation row's product on each of SmolLM2-135M's projection shapes and its LM head,
bf16 panels against the int8 W8A16 kernel's two one-row ways (int16 words on vpdpwssd, two
byte rows on vpdpbusd: `cpu_int8_row_words`), alternated in one process: 30 weights of each
shape (each its own, so they stream from memory as in a decode step; 3 for the LM head),
random values. Prints per shape and kernel the median microseconds a product and the
weights' GB/s.

    python scripts/int8_row_products.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops

sys.path.insert(0, str(Path(__file__).parent))
from cpu_projections import SHAPES as PROJECTIONS  # noqa: E402

# name: (n, k): cpu_projections.py's four projections (QKV, O, gate / up, down) and the LM head
SHAPES = dict(zip(("qkv", "o", "gate_up", "down"), PROJECTIONS)) | {"head": (49152, 576)}
KINDS = ("bf16", "words", "bytes")


def main() -> None:
    if cpu_ops() is None or not torch.ops.pagedllm.cpu_has_avx512_vnni():
        sys.exit("needs pagedllm's native kernels on an AVX512-VNNI CPU")
    ops = torch.ops.pagedllm
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    weights = {}
    for name, (n, k) in SHAPES.items():
        qs = [
            torch.randint(-127, 128, (n, k), dtype=torch.int8)
            for _ in range(3 if name == "head" else 30)
        ]
        weights[name] = {
            "int8": [(to_panels(q), torch.rand(n) * 1e-3, q.sum(1, dtype=torch.int32)) for q in qs],
            "bf16": [to_panels((q.float() * 1e-3).bfloat16()) for q in qs],
        }
    rows = {k: torch.randn(1, k).bfloat16() for _, k in SHAPES.values()}
    default = ops.cpu_int8_row_words(None)

    def run(name: str, kind: str) -> float:
        (n, k), w = SHAPES[name], weights[name]
        start = time.perf_counter()
        if kind == "bf16":
            for p in w["bf16"]:
                ops.linear(rows[k], p, None, n, False)
        else:
            ops.cpu_int8_row_words(kind == "words")
            for p, scale, colsum in w["int8"]:
                ops.linear_int8(rows[k], p, scale, colsum, None, n, False)
        return (time.perf_counter() - start) / len(w["bf16"])

    seconds = {(name, kind): [] for name in SHAPES for kind in KINDS}
    try:
        for _ in range(rounds + 1):  # the first round warms up
            for name in SHAPES:
                for kind in KINDS:
                    seconds[(name, kind)].append(run(name, kind))
    finally:
        ops.cpu_int8_row_words(default)
    for name, (n, k) in SHAPES.items():
        line = f"{name:8s} {n}x{k}:"
        for kind in KINDS:
            us = statistics.median(seconds[(name, kind)][1:]) * 1e6
            nbytes = n * k * (2 if kind == "bf16" else 1)
            line += f"  {kind} {us:7.1f} us {nbytes / us / 1e3:5.1f} GB/s"
        print(line)


if __name__ == "__main__":
    main()
