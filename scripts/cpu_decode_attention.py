"""Decode attention on this CPU: pagedllm's native kernel (`paged_decode_attention`, K/V read
from a paged cache through a random block table), bf16, both threads. Each case cycles over
several caches so that a call's K/V come from memory as in a real step (one layer's cache
each), except "in cache", which reuses one small cache. Prints microseconds per call (median
of 9 passes) and the K/V bytes read per second.

    python scripts/cpu_decode_attention.py [--fp8]
    python scripts/cpu_decode_attention.py BATCH CONTEXT [ROUNDS]

--fp8: each case also over an fp8 (e4m3) cache, at scale 1 and with K / V scales as
calculate_kv_scales sets them, the three alternated case by case, 3 times (kv_cache_dtype="fp8":
each item's rows widened to bf16 before the same kernel; at scale 1 by byte lookups, else
through fp32 times the scale).

With BATCH and CONTEXT it times that one case (SmolLM2's heads, 30 caches) call by call, with
4 MB of other memory written before each call, as a decode step's weights flush the caches
between two layers' attention, and prints the median microseconds a call (of ROUNDS x 30).

Cases: SmolLM2's heads (9 query heads, 3 KV heads, head size 64) at 64 requests x 200 tokens,
the same in cache, 1 request x 128 tokens and 32 requests x 1,000 tokens; and a larger
model's (16 query heads, 4 KV heads, head size 128) at 32 requests x 300 tokens.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagedllm.ops import cpu_ops


def time_case(
    ops,
    B,
    L,
    caches=30,
    H=9,
    HKV=3,
    D=64,
    in_cache=False,
    bs=16,
    flushed=0,
    kv_dtype=torch.bfloat16,
    kv_scales=(1.0, 1.0),
):
    """(microseconds per call, GB/s of K/V read); flushed > 0: the median of `flushed` rounds
    of calls timed one by one, each after writing 4 MB elsewhere. kv_dtype: the cache's (an
    fp8 cache holds 1 byte an element; queries stay bf16)."""
    g = torch.Generator().manual_seed(0)
    blocks_per_req = -(-L // bs)
    nb = 16 if in_cache else B * blocks_per_req + 8
    kvs = [torch.randn(2, nb, bs, HKV, D, generator=g).to(kv_dtype) for _ in range(caches)]
    if in_cache:
        table = torch.randint(0, nb, (B, blocks_per_req), generator=g).int()
    else:
        table = torch.stack(
            [torch.randperm(nb, generator=g)[:blocks_per_req] for _ in range(B)]
        ).int()
    lens = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=g).bfloat16()
    for kv in kvs[:2]:
        ops.paged_decode_attention(q, kv, table, lens, L, D**-0.5, *kv_scales)
    times = []  # seconds a call: one by one after a flush, or per pass over the caches
    if flushed:
        other, chunk = torch.zeros(64 << 20, dtype=torch.uint8), 4 << 20
        for _ in range(flushed):
            for i, kv in enumerate(kvs):
                other[i % 16 * chunk : (i % 16 + 1) * chunk].add_(1)
                t0 = time.perf_counter()
                ops.paged_decode_attention(q, kv, table, lens, L, D**-0.5, *kv_scales)
                times.append(time.perf_counter() - t0)
    else:
        for _ in range(9):
            t0 = time.perf_counter()
            for kv in kvs:
                ops.paged_decode_attention(q, kv, table, lens, L, D**-0.5, *kv_scales)
            times.append((time.perf_counter() - t0) / len(kvs))
    seconds = statistics.median(times)
    return seconds * 1e6, B * L * HKV * D * 2 * kvs[0].element_size() / seconds / 1e9


def main() -> None:
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("needs pagedllm's native kernels")
    fp8 = "--fp8" in sys.argv
    argv = [a for a in sys.argv if a != "--fp8"]
    if len(argv) > 2:
        B, L = int(argv[1]), int(argv[2])
        rounds = int(argv[3]) if len(argv) > 3 else 20
        us, gbs = time_case(ops, B, L, flushed=rounds)
        print(f"{B} x {L} tokens, flushed between calls: {us:,.1f} us a call ({gbs:.1f} GB/s)")
        return
    cases = {
        "64 x 200 tokens": dict(B=64, L=200),
        "64 x 200 tokens, in cache": dict(B=64, L=200, caches=1, in_cache=True),
        "1 x 128 tokens": dict(B=1, L=128),
        "32 x 1,000 tokens": dict(B=32, L=1000, caches=10),
        "32 x 300 tokens, 16/4 heads of 128": dict(B=32, L=300, H=16, HKV=4, D=128, caches=10),
    }
    print(f"threads {torch.get_num_threads()}")
    if not fp8:
        print("| case | us a call | K/V GB/s |")
        print("|---|---|---|")
        for name, kw in cases.items():
            us, gbs = time_case(ops, **kw)
            print(f"| {name} | {us:,.1f} | {gbs:.1f} |")
        return
    print(
        "| case | bf16 cache: us a call (GB/s) | fp8 cache: us a call (GB/s) | bf16 / fp8 time "
        "| fp8, scaled: us a call | bf16 / fp8 scaled time |"
    )
    print("|---|---|---|---|---|---|")
    variants = {
        "bf16": dict(kv_dtype=torch.bfloat16),
        "fp8": dict(kv_dtype=torch.float8_e4m3fn),
        "scaled": dict(kv_dtype=torch.float8_e4m3fn, kv_scales=(0.0516, 0.0047)),
    }
    for name, kw in cases.items():
        runs = {v: [] for v in variants}
        for _ in range(3):
            for v, got in runs.items():
                got.append(time_case(ops, **kw, **variants[v]))
        (b_us, b_gbs), (f_us, f_gbs), (s_us, _) = (min(r) for r in runs.values())
        print(
            f"| {name} | {b_us:,.1f} ({b_gbs:.1f}) | {f_us:,.1f} ({f_gbs:.1f}) | {b_us / f_us:.2f}x "
            f"| {s_us:,.1f} | {b_us / s_us:.2f}x |"
        )


if __name__ == "__main__":
    main()
