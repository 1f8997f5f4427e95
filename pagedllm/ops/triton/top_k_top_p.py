"""Top-k then top-p masking of sampling logits without sorting: one program per row.

Semantics (those of `sample/ops.py`): keep a row's `top_k` largest logits and every logit tied
with the k-th; then, of what is left, keep each token whose strictly-more-probable mass is
below `top_p` (so tokens tied with the last kept one are kept); mask the rest with -inf.
k >= V or p >= 1 disables that part.

Algorithm: both thresholds are a weighted selection, "the largest value t such that the
weight of the row's values >= t reaches W": for top-k the weight of a token is 1 and W = k;
for top-p it is its unnormalized probability exp(x - max) among the top-k survivors and
W = p * (their total). The largest such t is always one of the row's values, so keeping
x >= t gives exactly the semantics above. It is found by radix selection over the floats'
order-preserving 32-bit keys, 4 bits a pass: a pass builds a 16-bin histogram of the next
digit among the values matching the digits fixed so far and fixes the largest digit whose
suffix weight still reaches what remains of W. Eight passes per threshold, each a streaming
read of the row, instead of an O(V log V) sort of every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256  # columns per step; the histogram passes hold a [_BLOCK, 16] one-hot


@triton.jit
def _order_key(x):
    """float32 -> int64 in [0, 2^32) with the floats' order (-0.0 counts as +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, -1 - bits, bits + 2147483648)


@triton.jit
def _select_threshold(
    row_ptr, vocab_size, need, row_max, min_key, USE_MASS: tl.constexpr, BLOCK: tl.constexpr
):
    """The key of the largest value t with weight(values >= t) >= need, among the values
    whose key >= min_key (weight 1 each, or exp(x - row_max) with USE_MASS); -1 if even all
    of them weigh less than `need`."""
    digits = tl.arange(0, 16)
    prefix = tl.zeros([], dtype=tl.int64)
    remaining = need
    found = True
    for step in tl.static_range(8):
        shift = 28 - 4 * step
        hist = tl.zeros([16], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
            key = _order_key(x)
            live = (
                (offs < vocab_size)
                & (key >= min_key)
                & ((key >> (shift + 4)) == (prefix >> (shift + 4)))
            )
            if USE_MASS:
                w = tl.where(live, tl.exp(x - row_max), 0.0)
            else:
                w = tl.where(live, 1.0, 0.0)
            digit = (key >> shift) & 15
            hist += tl.sum(tl.where(digit[:, None] == digits[None, :], w[:, None], 0.0), axis=0)
        suffix = tl.cumsum(hist, axis=0, reverse=True)  # weight of digits >= d
        digit_found = tl.max(tl.where(suffix >= remaining, digits, -1), axis=0)
        found = found & (digit_found >= 0)
        digit_found = tl.maximum(digit_found, 0)
        remaining -= tl.sum(tl.where(digits > digit_found, hist, 0.0), axis=0)
        prefix = prefix | (digit_found.to(tl.int64) << shift)
    return tl.where(found, prefix, -1)


@triton.jit
def _top_k_top_p_kernel(
    logits_ptr,  # [B, V] float32, masked in place
    top_k_ptr,  # [B] int64 (unused without HAS_TOP_K)
    top_p_ptr,  # [B] float32 (unused without HAS_TOP_P)
    vocab_size,
    stride_row,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    row_max = tl.full([], float("-inf"), dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
        row_max = tl.maximum(row_max, tl.max(x, axis=0))

    threshold = tl.zeros([], dtype=tl.int64)  # keep keys >= threshold; 0 keeps everything
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        if k < vocab_size:
            threshold = tl.maximum(
                _select_threshold(
                    row_ptr, vocab_size, k.to(tl.float32), row_max, threshold, False, BLOCK
                ),
                0,
            )
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row)
        if p < 1.0:
            total = tl.zeros([], dtype=tl.float32)
            for start in range(0, vocab_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
                live = (offs < vocab_size) & (_order_key(x) >= threshold)
                total += tl.sum(tl.where(live, tl.exp(x - row_max), 0.0), axis=0)
            threshold = tl.maximum(
                _select_threshold(row_ptr, vocab_size, p * total, row_max, threshold, True, BLOCK),
                threshold,
            )
    if threshold > 0:
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            in_row = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=in_row, other=0.0)
            tl.store(row_ptr + offs, float("-inf"), mask=in_row & (_order_key(x) < threshold))


def apply_top_k_top_p_triton(
    logits: torch.Tensor,  # [B, V] float32, last dim contiguous; masked in place
    top_k: torch.Tensor | None,  # [B] int64 in [1, V]; V = disabled
    top_p: torch.Tensor | None,  # [B] float32 in (0, 1]; 1 = disabled
) -> torch.Tensor:
    """Mask `logits` in place to each row's top-k, then top-p (see the module docstring);
    returns it. No host sync."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0 or (top_k is None and top_p is None):
        return logits
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    _top_k_top_p_kernel[(num_rows,)](
        logits,
        top_k if top_k is not None else logits,
        top_p if top_p is not None else logits,
        vocab_size,
        logits.stride(0),
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        BLOCK=min(_BLOCK, triton.next_power_of_2(vocab_size)),
    )
    return logits
