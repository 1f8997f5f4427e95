"""fp8 KV-cache rows in the Triton kernels (`kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2",
scale 1: attention/fp8_kv.py), by integer bit operations on the cache's bytes.

The kernels take an fp8 cache as its uint8 view and a `FP8` constexpr (`fp8_code`): 0 for a
cache in the model's dtype, 1 for float8_e4m3fn, 2 for float8_e5m2. Bit operations instead of
Triton's fp8 types, for two reasons: the compiled fp8 conversions need an sm_89 or newer GPU
(and so would fail on an A100), and Triton's interpreter rounds fp32 -> fp8 wrongly where the
rounding carries into the exponent (7.87 -> 4.0 instead of 8.0 in e4m3, Triton 3.x), so the
interpreted kernels, which `make test` checks, would not store what the GPU stores.

- `fp8_encode`: fp32 values -> their fp8 bits as `x.float().clamp(-M, M).to(fp8)` stores
  them (saturated at the largest finite value M, rounded to nearest even, NaN kept NaN): the
  native CPU store's algorithm (ops/csrc/fp8.h's fp8_bits), bit for bit.
- `fp8_decode`: fp8 bits -> their fp32 values, exactly (e5m2 is fp16's upper byte; e4m3 moved
  into fp16's fields is the value times 2^-8, subnormals included; e4m3's NaN codes stay NaN).
- `fp8_read`: fp8 bits -> their value times the cache's scale, rounded to the query's dtype
  to nearest even (bf16 by integer operations: the interpreter's fp32 -> bf16 cast truncates,
  `fp_downcast_rounding` or not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def fp8_code(cache_dtype: torch.dtype) -> int:
    """The kernels' `FP8` constexpr for a cache of `cache_dtype` (0: not fp8)."""
    return FP8_CODES.get(cache_dtype, 0)


def cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """What the kernels get for `kv_cache`: an fp8 cache's bytes, else the cache itself."""
    return kv_cache.view(torch.uint8) if fp8_code(kv_cache.dtype) else kv_cache


@triton.jit
def fp8_encode(x, FP8: tl.constexpr):
    """fp32 `x` -> uint8 fp8 bits of format FP8 (1: e4m3fn, 2: e5m2)."""
    if FP8 == 1:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MAX: tl.constexpr = 448.0
        MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
        STEP_UP: tl.constexpr = 16384.0  # 2^(24 - BIAS - MANT)
        PER_STEP: tl.constexpr = 512.0  # 2^(BIAS - 1 + MANT)
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MAX: tl.constexpr = 57344.0
        MIN_NORMAL: tl.constexpr = 6.103515625e-05  # 2^-14
        STEP_UP: tl.constexpr = 128.0
        PER_STEP: tl.constexpr = 65536.0
    DROP: tl.constexpr = 23 - MANT
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    nan = a != a
    a = tl.where(a < MAX, a, MAX)  # (NaN too; its bits are set below)
    # Below the smallest normal the step is 2^(1 - BIAS - MANT): adding and subtracting 2^23
    # steps rounds to it (to nearest even), and a / step is the subnormal's bits (the smallest
    # normal's, 1 << MANT, when it rounds up).
    sub = ((a + STEP_UP) - STEP_UP) * PER_STEP
    # Normal: the fp32 bits rounded to MANT mantissa bits (a carry moves into the exponent),
    # then the exponent rebiased from 127 to BIAS.
    b = a.to(tl.uint32, bitcast=True)
    b = (b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) >> DROP
    normal = b - ((127 - BIAS) << MANT)
    bits = tl.where(a < MIN_NORMAL, sub.to(tl.uint32), normal)
    return (sign | tl.where(nan, 0x7F, bits)).to(tl.uint8)


@triton.jit
def fp8_decode(b, FP8: tl.constexpr):
    """uint8 fp8 bits `b` of format FP8 (1: e4m3fn, 2: e5m2) -> their fp32 values."""
    w = b.to(tl.uint16)
    if FP8 == 2:
        return (w << 8).to(tl.float16, bitcast=True).to(tl.float32)
    h = ((w & 0x80) << 8) | ((w & 0x7F) << 7)
    v = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((w & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def fp8_read(b, FP8: tl.constexpr, scale, dtype: tl.constexpr):
    """uint8 fp8 bits `b` of format FP8 read as `dtype`: the value times `scale` (fp32),
    rounded to nearest even."""
    x = fp8_decode(b, FP8) * scale
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
