"""Prefill attention on this CPU: pagedllm's native kernel (`paged_prefill_attention`, K/V read
from a paged cache) against PyTorch's SDPA (`is_causal=True`, contiguous K/V), one request of
L tokens with SmolLM2's heads (9 query heads, 3 KV heads, head size 64), bf16, both threads;
minimum of 30 calls each.

    python scripts/cpu_prefill_attention.py [L ...]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pagedllm.benchmarks.timing import call_seconds
from pagedllm.ops import cpu_ops


def best_us(fn, passes: int = 30) -> float:
    return min(call_seconds(fn, passes)) * 1e6


def time_one(ops, n: int, heads: int = 9, kv_heads: int = 3, d: int = 64) -> tuple[float, float]:
    """(native us, SDPA us) for one request of n tokens."""
    block_size = 16
    blocks = -(-n // block_size)
    kv = torch.randn(2, blocks, block_size, kv_heads, d).to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    q = torch.randn(n, heads, d).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens, qsl, reqs = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n]), torch.tensor([0])
    k = kv[0].reshape(-1, kv_heads, d)[:n].transpose(0, 1)[None]
    v = kv[1].reshape(-1, kv_heads, d)[:n].transpose(0, 1)[None]
    qt = q.transpose(0, 1)[None]
    native = best_us(lambda: ops.paged_prefill_attention(q, out, kv, table, lens, qsl, reqs, 0.125))
    sdpa = best_us(
        lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True)
    )
    return native, sdpa


def main() -> None:
    ops = cpu_ops()
    print(f"threads {torch.get_num_threads()}")
    print("| L | native (paged) | SDPA (contiguous) | SDPA / native |")
    print("|---|---|---|---|")
    for n in [int(a) for a in sys.argv[1:]] or [64, 147, 256, 1024]:
        native, sdpa = time_one(ops, n)
        print(f"| {n} | {native:.0f} us | {sdpa:.0f} us | {sdpa / native:.2f}x |")


if __name__ == "__main__":
    main()
