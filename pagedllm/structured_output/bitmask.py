"""Applying the scheduler's grammar bitmask to the logits, in the model runner.

The bitmask is packed: bit j % 32 of int32 word j // 32 says whether token j is allowed.
Rows of the bitmask belong to requests (`SchedulerOutput.structured_output_request_ids`), rows
of the logits to the requests that sample this step, in the runner's order; only the logits
rows of structured requests are touched. Columns past the bitmask's vocabulary (a padded
lm_head) are never allowed for those rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedllm.core.sched.output import SchedulerOutput


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [S, V], rows in the order of `logits_req_ids`
    scheduler_output: SchedulerOutput,
    logits_req_ids: list[str],
) -> None:
    """Mask, in place, the logits rows of this step's structured requests with the bitmask
    the scheduler filled (`grammar_bitmask`, `structured_output_request_ids`)."""
    bitmask = scheduler_output.grammar_bitmask
    if bitmask is not None:
        apply_token_bitmask(
            logits, bitmask, scheduler_output.structured_output_request_ids, logits_req_ids
        )


def apply_token_bitmask(
    logits: torch.Tensor,  # [S, V], rows in the order of `logits_req_ids`
    bitmask: np.ndarray,  # [R, W] int32, rows as in `request_rows`
    request_rows: dict[str, int],
    logits_req_ids: list[str],
) -> None:
    """Set the logits of tokens the grammars forbid to -inf, in place."""
    pairs = [(k, request_rows[r]) for k, r in enumerate(logits_req_ids) if r in request_rows]
    if not pairs:
        return
    logit_rows = [k for k, _ in pairs]
    mask_rows = [j for _, j in pairs]
    packed = torch.from_numpy(np.ascontiguousarray(bitmask[mask_rows]))  # [m, W]
    vocab = min(logits.shape[-1], packed.shape[-1] * 32)
    if logits.device.type == "cpu" and logits.dtype in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        _apply_xgrammar_cpu(logits, packed, logit_rows, vocab)
    else:
        rows = torch.as_tensor(logit_rows, device=logits.device)
        allowed = unpack_bitmask(packed.to(logits.device), vocab)  # [m, vocab] bool
        logits[rows, :vocab] = logits[rows, :vocab].masked_fill(~allowed, float("-inf"))
    if logits.shape[-1] > vocab:
        rows = torch.as_tensor(logit_rows, device=logits.device)
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
