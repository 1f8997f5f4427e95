"""The rejection sampler's accept / recover step, one program per row (spec_decode/).

Row r holds the target distribution `p` at one verified position and the draft token `d`
proposed there (bonus rows: none). Draft rows accept d with probability
min(1, p(d) / q(d)) (`u_accept * q(d) < p(d)`), q being the draft distribution, or one-hot on
d when there is none; every row also draws the token emitted on rejection from the residual
normalize(max(p - q, 0)) (p with d removed for a one-hot q, p itself at bonus rows) by inverse
CDF with `u_recover`. A draft row whose residual is empty (p == q) accepts.

It does in two streaming passes over the row (the residual's total, then the scan for the
draw) what the PyTorch path does with several [T, V] temporaries; both take the same uniforms
in the same order, so their draws agree up to float rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _residual(p_ptr, q_ptr, offs, vocab_size, draft, IS_DRAFT, HAS_Q: tl.constexpr):
    """The residual weights of columns `offs` (0 past the vocabulary)."""
    in_row = offs < vocab_size
    p = tl.load(p_ptr + offs, mask=in_row, other=0.0)
    if HAS_Q:
        q = tl.load(q_ptr + offs, mask=in_row, other=0.0)
        r = tl.maximum(p - q, 0.0)
    else:
        r = tl.where(offs == draft, 0.0, p)
    return tl.where(IS_DRAFT, r, p)


@triton.jit
def _accept_recover_kernel(
    probs_ptr,  # [T, V] float32 target probabilities
    q_ptr,  # [T, V] float32 draft probabilities (unused without HAS_Q)
    drafts_ptr,  # [T] int64 (anything at bonus rows)
    is_draft_ptr,  # [T] bool
    u_accept_ptr,  # [T] float32 in [0, 1)
    u_recover_ptr,  # [T] float32 in [0, 1)
    accept_ptr,  # [T] bool out
    recovered_ptr,  # [T] int64 out
    vocab_size,
    stride_p,
    stride_q,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_row = probs_ptr + row * stride_p
    q_row = q_ptr + row * stride_q
    draft = tl.load(drafts_ptr + row)
    is_draft = tl.load(is_draft_ptr + row) != 0
    total = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.sum(_residual(p_row, q_row, offs, vocab_size, draft, is_draft, HAS_Q), 0)

    p_draft = tl.load(p_row + draft)
    q_draft = 1.0
    if HAS_Q:
        q_draft = tl.load(q_row + draft)
    u = tl.load(u_accept_ptr + row)
    accept = is_draft & ((u * q_draft < p_draft) | (total <= 0.0))
    tl.store(accept_ptr + row, accept)

    # Inverse CDF: the first column whose cumulative weight exceeds u * total; rounding can
    # leave none, then the last column with weight (a zero-weight column is never drawn).
    target = tl.load(u_recover_ptr + row) * total
    before = tl.zeros([], dtype=tl.float32)
    picked = tl.full([], vocab_size, dtype=tl.int64)
    last = tl.zeros([], dtype=tl.int64)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        r = _residual(p_row, q_row, offs, vocab_size, draft, is_draft, HAS_Q)
        cdf = before + tl.cumsum(r, 0)
        hit = (cdf > target) & (r > 0.0)
        picked = tl.minimum(picked, tl.min(tl.where(hit, offs, vocab_size), 0).to(tl.int64))
        last = tl.maximum(last, tl.max(tl.where(r > 0.0, offs, 0), 0).to(tl.int64))
        before += tl.sum(r, 0)
    tl.store(recovered_ptr + row, tl.where(picked < vocab_size, picked, last))


def accept_and_recover(
    probs: torch.Tensor,  # [T, V] float32
    drafts: torch.Tensor,  # [T] int64
    is_draft_row: torch.Tensor,  # [T] bool
    draft_probs: torch.Tensor | None,  # [T, V] float32 q, or None: one-hot on the draft
    u_accept: torch.Tensor,  # [T] float32
    u_recover: torch.Tensor,  # [T] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [T] bool, token emitted on rejection [T] int64). No host sync."""
    num_rows, vocab_size = probs.shape
    accept = torch.empty(num_rows, dtype=torch.bool, device=probs.device)
    recovered = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows == 0:
        return accept, recovered
    probs = probs.contiguous()
    q = probs if draft_probs is None else draft_probs.to(torch.float32).contiguous()
    _accept_recover_kernel[(num_rows,)](
        probs,
        q,
        drafts,
        is_draft_row,
        u_accept,
        u_recover,
        accept,
        recovered,
        vocab_size,
        probs.stride(0),
        q.stride(0),
        HAS_Q=draft_probs is not None,
        BLOCK=min(_BLOCK, triton.next_power_of_2(vocab_size)),
    )
    return accept, recovered
