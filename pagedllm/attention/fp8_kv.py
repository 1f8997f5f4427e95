"""fp8 KV caches (vLLM's `kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2"): how the PyTorch
code stores K/V rows in one and reads them back, by the rule the native CPU kernels
(ops/csrc/fp8.h) and the Triton kernels (ops/triton/fp8.py) follow too, so that every backend
reads what another wrote.

Each attention layer has a scale for its keys and one for its values (`KVScales`): 1.0, vLLM's
default for a checkpoint without scales, unless `calculate_kv_scales` set them from a
calibration forward at start-up (worker/kv_scales.py). Scales are fp32 values; `inv` is 1 /
scale rounded to fp32 once.
Stored: `(x.float() * inv).clamp(-M, M).to(fp8)`, M the format's largest finite value (448
for float8_e4m3fn, 57344 for float8_e5m2), rounded to nearest even by PyTorch's cast; the
clamp makes out-of-range values saturate in both formats (a bare cast to e5m2 overflows to
inf).
Read: `(fp8.float() * scale).to(dtype)`, the query's dtype; with scale 1 that is the fp8 value
itself, exactly (every e4m3 and e5m2 value is a bf16, fp16 and fp32 value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.config import FP8_KV_CACHE_DTYPES

# The smallest scale taken: far above where a scaled fp8 value would fall among bf16's
# subnormals (which the native kernels' bf16 rounding flushes), far below any real K / V.
MIN_KV_SCALE = 1e-6


def is_fp8(dtype: torch.dtype | None) -> bool:
    """Whether `dtype` is one of the fp8 KV-cache dtypes."""
    return dtype in FP8_KV_CACHE_DTYPES.values()


@dataclass(frozen=True)
class KVScales:
    """A layer's fp8 K and V scales (fp32 values) and their fp32 reciprocals."""

    k: float = 1.0
    v: float = 1.0
    k_inv: float = field(init=False)
    v_inv: float = field(init=False)

    def __post_init__(self) -> None:
        for name in ("k", "v"):
            s = getattr(self, name)
            if not (math.isfinite(s) and s >= MIN_KV_SCALE):
                raise ValueError(f"{name}_scale={s!r}: a finite scale >= {MIN_KV_SCALE}")
            f = np.float32(s)
            object.__setattr__(self, name, float(f))
            object.__setattr__(self, f"{name}_inv", float(np.float32(1.0) / f))

    @property
    def unit(self) -> bool:
        return self.k == 1.0 and self.v == 1.0


UNIT_SCALES = KVScales()


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, inv: float = 1.0) -> torch.Tensor:
    """`x` as an fp8 cache of `cache_dtype` stores it with reciprocal scale `inv` (a new
    tensor)."""
    bound = torch.finfo(cache_dtype).max
    y = x.float()
    if inv != 1.0:
        y = y * inv  # (a Python float: multiplied in fp32, as the kernels do)
    return y.clamp(-bound, bound).to(cache_dtype)


def dequantize_kv(t: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """fp8 `t` read back in `dtype` with `scale` (a new tensor)."""
    if scale == 1.0:
        return t.to(dtype)
    return (t.float() * scale).to(dtype)


def as_stored(
    x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0, inv: float = 1.0
) -> torch.Tensor:
    """`x` (K or V rows) as a later read of them from a cache of `cache_dtype` sees them:
    `x` itself when the cache keeps its dtype, else its fp8 round trip with `scale`."""
    if cache_dtype == x.dtype:
        return x
    return dequantize_kv(quantize_kv(x, cache_dtype, inv), x.dtype, scale)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as its raw bytes' integer type where it is fp8 (the same memory, any
    strides): PyTorch's CPU `index_copy_` has no fp8 kernel, and a byte copy is exact."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
