"""Logprobs on the device (`LogprobsTensors`) and their conversion to per-request lists.

Each row holds one position: column 0 is the token that was chosen there (sampled, or the
prompt's next token for prompt logprobs), columns 1..k the row's top-k tokens, best first; the
chosen token's rank is 1 + the number of tokens with a strictly larger logprob. Rows that asked
for fewer than k alternatives are trimmed when converted to lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.outputs import LogprobsLists
from pagedllm.sample.ops import native_rows


@dataclass
class LogprobsTensors:
    """Logprobs of a batch of positions, still on the device."""

    top_token_ids: torch.Tensor  # [N, k + 1] int64; column 0 is the chosen token
    top_logprobs: torch.Tensor  # [N, k + 1] float32
    sampled_rank: torch.Tensor  # [N] int64; rank of column 0's token, 1 = best

    def tolists(self) -> LogprobsLists:
        """All N positions as one `LogprobsLists` (prompt logprobs of one request's chunk)."""
        return LogprobsLists(
            token_ids=self.top_token_ids.tolist(),
            logprobs=self.top_logprobs.tolist(),
            ranks=self.sampled_rank.tolist(),
        )

    def to_lists(self, num_per_row: Sequence[int | None]) -> list[LogprobsLists | None]:
        """One `LogprobsLists` (of one position) per row, keeping the chosen token plus
        `num_per_row[i]` alternatives; None where `num_per_row[i]` is None."""
        token_ids = self.top_token_ids.tolist()
        logprobs = self.top_logprobs.tolist()
        ranks = self.sampled_rank.tolist()
        return [
            None
            if n is None
            else LogprobsLists(
                token_ids=[token_ids[i][: n + 1]],
                logprobs=[logprobs[i][: n + 1]],
                ranks=[ranks[i]],
            )
            for i, n in enumerate(num_per_row)
        ]


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Pick the logprob and rank of `token_ids [N]` and the top `num_logprobs` of each row
    of `logprobs [N, V]`."""
    num_logprobs = min(num_logprobs, logprobs.shape[1])
    token_ids = token_ids.to(torch.int64)[:, None]  # [N, 1]
    token_logprobs = logprobs.gather(1, token_ids)  # [N, 1]
    # int32 sum: summing bools into the default int64 costs several times more on the CPU.
    ranks = (logprobs > token_logprobs).sum(dim=-1, dtype=torch.int32).to(torch.int64) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k] each
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def compute_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of the given next tokens from raw `logits [N, V]` (e.g. prompt logprobs:
    row i holds the logits at position i and `token_ids[i]` is the prompt token at i + 1).
    On fp32 CPU rows one native call (ops/csrc/sampling.h's row_logprobs: at 64 rows of a
    49k vocabulary 1.1-1.7 ms against 3.2-5.8 ms for log_softmax, gather, the ranks' sum and
    topk, BENCHMARKS.md); the same values to a few ulps of the normalizer, top-k ties by
    index."""
    num_logprobs = min(num_logprobs, logits.shape[1])
    native = native_rows(logits)
    if native is not None:
        token_ids = token_ids.to(torch.int64).contiguous()
        return LogprobsTensors(*native.token_logprobs(logits, token_ids, num_logprobs))
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return gather_logprobs(logprobs, token_ids, num_logprobs)
