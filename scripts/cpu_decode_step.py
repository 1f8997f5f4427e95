"""One batched decode step of a SmolLM2-135M-shaped model on pagedllm's native kernels, without
the engine: 30 layers of random bf16 weights (each layer its own, so they stream from memory as
in a real step), a paged bf16 KV cache holding BATCH sequences of CONTEXT tokens, and the step's
new token per sequence. Times the fused decoder layer (`decoder_layer_decode`, what the engine
runs) and the same work op by op, alternated; prints the medians and each op's mean share.
`--int8`: the projections' weights int8 (W8A16, `quantization="int8"`'s kernels) instead of bf16.

    python scripts/cpu_decode_step.py [BATCH] [CONTEXT] [--rounds 7] [--int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from pagedllm.layers.cpu_gemm import to_panels
from pagedllm.ops import cpu_ops

HIDDEN, INTER, Q, KV, HEAD, BLOCK, LAYERS = 576, 1536, 576, 192, 64, 16, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", type=int, nargs="?", default=64)
    parser.add_argument("context", type=int, nargs="?", default=192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--int8", action="store_true", help="int8 projection weights")
    args = parser.parse_args()
    if cpu_ops() is None:
        sys.exit("needs pagedllm's native kernels")
    ops = torch.ops.pagedllm
    B, L = args.batch, args.context

    kind = 1 if args.int8 else 2  # decoder_layer_decode's projection kinds

    def panels(n: int, k: int) -> tuple:
        """(weight panels, scale, colsum): the projection's arguments after its kind."""
        if not args.int8:
            return to_panels((torch.randn(n, k) * 0.05).bfloat16()), None, None
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return to_panels(q), torch.rand(n) * 1e-3, q.sum(dim=1, dtype=torch.int32)

    def linear(x: torch.Tensor, w: tuple, n: int) -> torch.Tensor:
        if args.int8:
            return ops.linear_int8(x, w[0], w[1], w[2], None, n, False)
        return ops.linear(x, w[0], None, n, False)

    layers = [
        dict(
            qkv=panels(Q + 2 * KV, HIDDEN),
            o=panels(HIDDEN, Q),
            gate_up=panels(2 * INTER, HIDDEN),
            down=panels(HIDDEN, INTER),
            norm1=torch.ones(HIDDEN).bfloat16(),
            norm2=torch.ones(HIDDEN).bfloat16(),
            kv=torch.randn(2, B * (L // BLOCK + 1), BLOCK, KV // HEAD, HEAD).bfloat16(),
        )
        for _ in range(LAYERS)
    ]
    blocks = torch.arange(B * (L // BLOCK + 1), dtype=torch.int32).view(B, -1)
    seq_lens = torch.full((B,), L + 1, dtype=torch.int32)
    slots = blocks[:, L // BLOCK].long() * BLOCK + L % BLOCK
    positions = torch.full((B,), L, dtype=torch.long)
    cos_sin = torch.randn(8192, HEAD)
    x0 = torch.randn(B, HIDDEN).bfloat16()
    op_seconds: dict[str, float] = defaultdict(float)

    def fused() -> None:
        x, res = x0.clone(), x0.clone()
        for w in layers:
            x = ops.decoder_layer_decode(
                x, res, w["norm1"], 1e-5, kind, *w["qkv"], None, Q + 2 * KV, Q, KV,
                positions, cos_sin, HEAD, HEAD, w["kv"], slots, blocks, seq_lens, L + 1,
                HEAD**-0.5, kind, *w["o"], None, HIDDEN, w["norm2"], 1e-5, kind,
                *w["gate_up"], None, 2 * INTER, kind, *w["down"], None, HIDDEN,
            )  # fmt: skip

    def by_op() -> None:
        x, res = x0.clone(), x0.clone()

        def timed(name, fn, *a):
            start = time.perf_counter()
            out = fn(*a)
            op_seconds[name] += time.perf_counter() - start
            return out

        for w in layers:
            h = timed("norms", ops.fused_add_rms_norm, x, res, w["norm1"], 1e-5)
            qkv = timed("qkv", linear, h, w["qkv"], Q + 2 * KV)
            q, k, v = qkv[:, :Q], qkv[:, Q : Q + KV], qkv[:, Q + KV :]
            timed("rope", ops.rotary_embedding, positions, q, k, cos_sin, HEAD, HEAD)
            kv_rows = (k.view(B, -1, HEAD), v.view(B, -1, HEAD), w["kv"], slots)
            timed("cache write", ops.reshape_and_cache, *kv_rows)
            a = timed(
                "attention", ops.paged_decode_attention,
                q.reshape(B, -1, HEAD), w["kv"], blocks, seq_lens, L + 1, HEAD**-0.5,
            )  # fmt: skip
            o = timed("o", linear, a.view(B, Q), w["o"], HIDDEN)
            h = timed("norms", ops.fused_add_rms_norm, o, res, w["norm2"], 1e-5)
            g = timed("gate_up", linear, h, w["gate_up"], 2 * INTER)
            s = timed("silu", ops.silu_and_mul, g)
            x = timed("down", linear, s, w["down"], HIDDEN)

    fused()
    by_op()
    op_seconds.clear()
    times: dict[str, list[float]] = {"fused": [], "by op": []}
    for _ in range(args.rounds):
        for name, fn in (("fused", fused), ("by op", by_op)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    kv_bytes = LAYERS * 2 * B * (L + 1) * KV * 2
    print(
        f"batch {B}, context {L}: fused {statistics.median(times['fused']) * 1e3:.1f} ms, "
        f"op by op {statistics.median(times['by op']) * 1e3:.1f} ms (K/V read: "
        f"{kv_bytes / 1e6:.0f} MB a step)"
    )
    for name, seconds in op_seconds.items():
        print(f"  {name:12s} {seconds / args.rounds * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
