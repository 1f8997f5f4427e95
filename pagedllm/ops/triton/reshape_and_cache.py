"""Write a step's new keys and values into the paged KV cache (vLLM's reshape_and_cache).

Token t goes to slot `slot_mapping[t]` = block * block_size + offset of the cache
`[2, num_blocks, block_size, num_kv_heads, head_size]`. A negative slot (a padding row, e.g.
of a CUDA-graph batch padded to its captured size) is skipped. One program per token copies
all of its heads; key/value rows may be strided views (q/k/v split from one fused GEMM). An
fp8 cache (`kv_cache_dtype`) gets each value times 1 / its scale stored as fp8
(`fp8.fp8_encode`: saturated, rounded to nearest even, the bits the other backends store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales
from pagedllm.ops.triton import next_power_of_2
from pagedllm.ops.triton.fp8 import cache_view, fp8_code, fp8_encode


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] (an fp8 cache's bytes: FP8 > 0)
    v_cache_ptr,  # same strides as k_cache
    slot_mapping_ptr,  # [T] int64
    k_inv,  # fp8: 1 / the keys' scale (fp32)
    v_inv,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    FP8: tl.constexpr,  # 0: the cache keeps the rows' dtype; 1 / 2: fp8 e4m3 / e5m2 (fp8.py)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]
    dst = (
        (slot // BLOCK_SIZE) * stride_c_blk
        + (slot % BLOCK_SIZE) * stride_c_slot
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :]
    )
    k = tl.load(
        key_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :],
        mask=mask,
    )
    if FP8:
        tl.store(k_cache_ptr + dst, fp8_encode(k.to(tl.float32) * k_inv, FP8), mask=mask)
        tl.store(v_cache_ptr + dst, fp8_encode(v.to(tl.float32) * v_inv, FP8), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [>= N, Hkv, D], last dim contiguous
    value: torch.Tensor,  # [>= N, Hkv, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64; < 0: skip the row
    kv_scales: KVScales = UNIT_SCALES,  # an fp8 cache's (attention/fp8_kv.py)
) -> None:
    """Write rows 0..N-1 of key/value at their slots (N = len(slot_mapping))."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, num_kv_heads, head_size = key.shape
    key_cache, value_cache = cache_view(kv_cache).unbind(0)
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride(3) == 1
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_scales.k_inv,
        kv_scales.v_inv,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
        FP8=fp8_code(kv_cache.dtype),
    )
