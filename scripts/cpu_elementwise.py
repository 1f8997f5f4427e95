"""The decoder's elementwise ops on bf16 rows (pagedllm's native kernels): fused_add_rms_norm
over SmolLM2's 576-wide hidden rows, RoPE on a 960-wide QKV row (9 query and 3 KV heads of
64), SiLU x mul on 2 x 1,536. Prints the median of 5 calls for each op, in microseconds.

    python scripts/cpu_elementwise.py ROWS [ROWS ...]
"""

from __future__ import annotations

import statistics
import sys

import torch

from pagedllm.benchmarks.timing import call_seconds
from pagedllm.ops import cpu_ops


def median_us(fn, calls: int = 5) -> float:
    return statistics.median(call_seconds(fn, calls)) * 1e6


def time_ops(rows: int) -> dict[str, float]:
    """Microseconds a call of each op on `rows` rows."""
    ops = torch.ops.pagedllm
    qkv = torch.randn(rows, 960).bfloat16()
    positions = torch.arange(rows) % 128
    cos_sin = torch.randn(8192, 64)
    x, res = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    weight = torch.ones(576).bfloat16()
    gate_up = torch.randn(rows, 3072).bfloat16()
    q, k = qkv[:, :576], qkv[:, 576:768]
    return {
        "fused_add_rms_norm": median_us(lambda: ops.fused_add_rms_norm(x, res, weight, 1e-5)),
        "rotary_embedding": median_us(
            lambda: ops.rotary_embedding(positions, q, k, cos_sin, 64, 64)
        ),
        "silu_and_mul": median_us(lambda: ops.silu_and_mul(gate_up)),
    }


def main() -> None:
    if cpu_ops() is None:
        sys.exit("needs pagedllm's native kernels")
    for rows in [int(a) for a in sys.argv[1:]] or [64, 512, 8192]:
        timings = time_ops(rows)
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.0f} us" for k, v in timings.items()))


if __name__ == "__main__":
    main()
