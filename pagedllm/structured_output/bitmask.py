"""Applying the scheduler's grammar bitmask to the logits, in the model runner.

The bitmask is packed: bit j % 32 of int32 word j // 32 says whether token j is allowed.
A structured request that samples owns consecutive bitmask rows from
`SchedulerOutput.structured_output_request_ids[req_id]`, one per verified position (1 + its
scheduled drafts); the logits rows are the runner's verification rows, the same positions in
the same order. Only the logits rows of structured requests are touched. Columns past the
bitmask's vocabulary (a padded lm_head) are never allowed for those rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.sample.ops import native_rows

if TYPE_CHECKING:
    from pagedllm.core.sched.output import SchedulerOutput


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [R, V], request s owning num_rows[s] consecutive rows
    scheduler_output: SchedulerOutput,
    logits_req_ids: list[str],  # [S] requests in logits order
    num_rows: np.ndarray,  # [S] int64 logits rows per request (its drafts + 1)
) -> None:
    """Mask, in place, the logits rows of this step's structured requests with the bitmask
    rows the scheduler filled (`grammar_bitmask`, `structured_output_request_ids`)."""
    bitmask = scheduler_output.grammar_bitmask
    if bitmask is None:
        return
    first = scheduler_output.structured_output_request_ids
    mask_first = np.fromiter(
        (first.get(r, -1) for r in logits_req_ids), dtype=np.int64, count=len(logits_req_ids)
    )
    logits_first = np.cumsum(num_rows) - num_rows  # [S]
    structured = np.repeat(mask_first >= 0, num_rows)  # [R]
    logit_rows = np.flatnonzero(structured)
    mask_rows = logit_rows + np.repeat(mask_first - logits_first, num_rows)[logit_rows]
    apply_token_bitmask(logits, bitmask, logit_rows, mask_rows)


def apply_token_bitmask(
    logits: torch.Tensor,  # [R, V]
    bitmask: np.ndarray,  # [M, W] int32
    logit_rows: np.ndarray,  # [m] int64 logits rows to mask
    mask_rows: np.ndarray,  # [m] int64 the bitmask row of each
) -> None:
    """Set the logits of tokens the grammars forbid to -inf, in place."""
    if len(logit_rows) == 0:
        return
    rows = torch.from_numpy(np.asarray(logit_rows, dtype=np.int64)).to(logits.device)
    packed = torch.from_numpy(np.ascontiguousarray(bitmask[np.asarray(mask_rows)]))  # [m, W]
    vocab = min(logits.shape[-1], packed.shape[-1] * 32)
    native = native_rows(logits)
    if native is not None:
        # ops.cpp's apply_token_bitmask: rows in parallel, whole words at a time (64 rows of
        # a 49k vocabulary: 7.8 ms a step in xgrammar's kernel).
        native.apply_token_bitmask(logits, packed, rows, vocab)
    elif logits.device.type == "cpu" and logits.dtype in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        _apply_xgrammar_cpu(logits, packed, rows.tolist(), vocab)
    else:
        allowed = unpack_bitmask(packed.to(logits.device), vocab)  # [m, vocab] bool
        logits[rows, :vocab] = logits[rows, :vocab].masked_fill(~allowed, float("-inf"))
    if logits.shape[-1] > vocab:
        logits[rows, vocab:] = float("-inf")


def _apply_xgrammar_cpu(
    logits: torch.Tensor, packed: torch.Tensor, logit_rows: list[int], vocab: int
) -> None:
    """xgrammar's CPU kernel: it pairs logits row i with bitmask row i, so the packed rows
    are scattered into an all-allowed [S, W] bitmask first."""
    import xgrammar as xgr

    full = torch.full((logits.shape[0], packed.shape[1]), -1, dtype=torch.int32)
    full[logit_rows] = packed
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=logit_rows)


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 [m, W] -> bool [m, vocab], True where the token is allowed."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [m, W, 32]
    return bits.reshape(packed.shape[0], -1)[:, :vocab].bool()
