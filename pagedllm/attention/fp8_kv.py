"""fp8 KV caches (vLLM's `kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2", scale 1.0): how the
PyTorch code stores K/V rows in one and reads them back, by the rule the native CPU kernels
(ops/csrc/fp8.h) and the Triton kernels (ops/triton/fp8.py) follow too, so that every backend
reads what another wrote.

Stored: `x.float().clamp(-M, M).to(fp8)`, M the format's largest finite value (448 for
float8_e4m3fn, 57344 for float8_e5m2), rounded to nearest even by PyTorch's cast; the clamp
makes out-of-range values saturate in both formats (a bare cast to e5m2 overflows to inf).
Read: the fp8 value widened to the query's dtype, exactly (every e4m3 and e5m2 value is a
bf16, fp16 and fp32 value). No scale: vLLM's k_scale = v_scale = 1.0, its default for a
checkpoint that has none.
"""

from __future__ import annotations

import torch

from pagedllm.config import FP8_KV_CACHE_DTYPES


def is_fp8(dtype: torch.dtype | None) -> bool:
    """Whether `dtype` is one of the fp8 KV-cache dtypes."""
    return dtype in FP8_KV_CACHE_DTYPES.values()


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as an fp8 cache of `cache_dtype` stores it (a new tensor)."""
    bound = torch.finfo(cache_dtype).max
    return x.float().clamp(-bound, bound).to(cache_dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` (K or V rows) as a later read of them from a cache of `cache_dtype` sees them:
    `x` itself when the cache keeps its dtype, else its fp8 round trip."""
    if cache_dtype == x.dtype:
        return x
    return quantize_kv(x, cache_dtype).to(x.dtype)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as its raw bytes' integer type where it is fp8 (the same memory, any
    strides): PyTorch's CPU `index_copy_` has no fp8 kernel, and a byte copy is exact."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
