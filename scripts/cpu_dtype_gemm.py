"""bf16 vs fp32 `F.linear` on this CPU, one thread, alternated: what `dtype="auto"` decides
on (config.cpu_has_fast_bf16). Prints the best of 5 blocks of 50 calls per shape and dtype.

    python scripts/cpu_dtype_gemm.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pagedllm.config import cpu_has_fast_bf16


def main() -> None:
    torch.set_num_threads(1)
    print(f"cpu_has_fast_bf16: {cpu_has_fast_bf16()}")
    for rows in (1, 64):
        best: dict[torch.dtype, float] = {}
        for _ in range(2):  # alternate the dtypes
            for dtype in (torch.float32, torch.bfloat16):
                w = torch.randn(3072, 768).to(dtype)
                x = torch.randn(rows, 768).to(dtype)
                for _ in range(5):
                    F.linear(x, w)
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(50):
                        F.linear(x, w)
                    elapsed = (time.perf_counter() - t) / 50
                    best[dtype] = min(best.get(dtype, elapsed), elapsed)
        fp32, bf16 = best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3
        print(f"{rows} x 768 @ 768 x 3072: fp32 {fp32:.3f} ms, bf16 {bf16:.3f} ms, "
              f"bf16 / fp32 {bf16 / fp32:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
