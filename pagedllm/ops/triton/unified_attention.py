"""Unified paged attention: prefill chunks and decodes of one step in a single launch.

Algorithm. The step's new tokens are one flattened sequence; request s owns query rows
`query_start_loc[s]:query_start_loc[s+1]` and its context after the step holds `seq_lens[s]`
tokens, the new ones last (so query row i of s sits at key position `seq_lens[s] - q_len + i`
and attends causally to keys `0..` that position). Keys and values are read from the paged
cache `[num_blocks, block_size, num_kv_heads, head_size]` through the block table; the step's
own K/V must already be written there (`reshape_and_cache`).

Grid: `(num_tokens // BLOCK_Q + num_seqs, num_kv_heads)`. Program (b, h) takes one block of
BLOCK_Q consecutive query tokens of one request and every query head that shares KV head h
(GQA: `BLOCK_M = BLOCK_Q * heads_per_kv` rows, so each K/V tile is loaded once for the whole
group). Request s owns the programs `query_start_loc[s] // BLOCK_Q + s` onwards, at least
ceil(q_len / BLOCK_Q) of them; a program finds its request by binary search over that
monotone start, and the spare ones exit at once. The grid depends only on host integers (the
number of rows and requests), never on a device value, so a launch needs no host sync and can
be captured in a CUDA graph. Each program walks the key tiles its last query row needs with an
online softmax (fp32 running max, sum and accumulator).

Every output row is reduced over its keys in the same tile order whatever else is in the
batch, so the result of a request does not depend on its batch (batch invariance).

An fp8 cache (`kv_cache_dtype`) is read as its bytes, each K / V tile widened to fp32, times
its scale and rounded to the query's dtype (`fp8.fp8_read`) before the same products: the
bits the kernel gives over that cache read back beforehand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales
from pagedllm.ops.triton import next_power_of_2
from pagedllm.ops.triton.fp8 import cache_view, fp8_code, fp8_read

# Query rows per program (BLOCK_M) when the heads of one KV head fit in it; keys per tile.
_BLOCK_M = 16
_TILE = 32


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning program `q_block`: the last s with qsl[s] // BLOCK_Q + s <= q_block."""
    # int32 tensors from the start: loop-carried values keep one type when compiled.
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] (an fp8 cache's bytes: FP8 > 0)
    v_cache_ptr,  # same strides as k_cache
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale,
    k_scale,  # fp8: the keys' scale (fp32)
    v_scale,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # 0: the cache is in the query's dtype; 1 / 2: fp8 e4m3 / e5m2 (fp8.py)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_tok = local_block * BLOCK_Q + offs_m // QUERIES_PER_KV  # [M] index within the request
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV  # [M]
    row_ok = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_row = (q_start + q_tok).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )  # [M, HEAD_PAD]
    q_pos = ctx_len + q_tok  # [M] key position of each query row

    # Keys up to the last query row of this block.
    kv_len = ctx_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_t = tl.arange(0, TILE)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(0, tl.cdiv(kv_len, TILE)):
        k_pos = tile * TILE + offs_t  # [TILE]
        k_ok = k_pos < kv_len
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = block * stride_c_blk + (k_pos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
        k = tl.load(
            k_cache_ptr + slot[None, :] + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_PAD, TILE]
        if FP8:
            k = fp8_read(k, FP8, k_scale, q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [M, TILE] fp32
        allowed = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps max -inf: exponentiate against 0 instead.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot[:, None] + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TILE, HEAD_PAD]
        if FP8:
            v = fp8_read(v, FP8, v_scale, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_row[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def unified_attention(
    out: torch.Tensor,  # [T, H, D], written at the rows of real query tokens
    query: torch.Tensor,  # [T, H, D], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    kv_scales: KVScales = UNIT_SCALES,  # an fp8 cache's (attention/fp8_kv.py)
) -> torch.Tensor:
    """Causal paged attention of every query row over its request's cached keys and values.

    Rows past `query_start_loc[-1]` (padding) are not written. Returns `out`."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(_BLOCK_M, next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    key_cache, value_cache = cache_view(kv_cache).unbind(0)
    assert query.stride(2) == 1 and out.stride(2) == 1 and key_cache.stride(3) == 1
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        kv_scales.k,
        kv_scales.v,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        BLOCK_SIZE=kv_cache.shape[2],
        QUERIES_PER_KV=queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=max(16, next_power_of_2(head_size)),  # tl.dot needs extents >= 16
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=_TILE,
        # fp32 inputs: full-precision dots (Triton's default for fp32 is TF32).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        FP8=fp8_code(kv_cache.dtype),
    )
    return out
