"""N-gram (prompt lookup) proposer: drafts by copying what followed the same n-gram earlier.

For a request with tokens t_0..t_{L-1}, find the longest n in [prompt_lookup_min,
prompt_lookup_max] such that the suffix t_{L-n}..t_{L-1} occurred earlier; among occurrences of
that length take the most recent one, ending at position e < L - 1, and propose the k tokens
that followed it: t_{e+1}, t_{e+2}, ... When the copy runs into the end of the sequence
(e + k >= L - 1, e.g. a short period), it continues over the tokens it has just proposed,
LZ77-style, which repeats the period.

Vectorized per request with numpy: the candidates are the earlier positions holding t_{L-1};
one [candidates, prompt_lookup_max] comparison against the reversed suffix gives every
candidate's match length (a cumulative product), and the best is an argmax. No Python loop
over tokens. It needs no model, no KV cache and no GPU. Its drafts are copies, not samples:
the rejection sampler treats them as drawn from a one-hot q, also for sampling requests.
"""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.proposer import DraftBatch, Proposal, Proposer


def propose_ngram(
    tokens: np.ndarray, min_n: int, max_n: int, k: int, max_candidates: int = 1024
) -> np.ndarray:
    """Draft up to `k` tokens for one sequence `tokens [L]` (int64); empty if no n-gram of
    size >= min_n recurs. Only the `max_candidates` most recent occurrences of the last token
    are examined, which bounds the work for very long, low-entropy sequences."""
    length = tokens.shape[0]
    max_n = min(max_n, length - 1)
    if max_n < min_n or k <= 0:
        return tokens[:0]
    last = tokens[length - 1]
    # Earlier positions that can end a match of >= min_n tokens.
    candidates = np.flatnonzero(tokens[min_n - 1 : length - 1] == last) + (min_n - 1)
    if candidates.size == 0:
        return tokens[:0]
    candidates = candidates[-max_candidates:]
    back = np.arange(max_n)  # [N]
    suffix = tokens[length - 1 - back]  # [N] t_{L-1}, t_{L-2}, ...
    idx = candidates[:, None] - back[None, :]  # [C, N]
    same = (tokens[np.maximum(idx, 0)] == suffix[None, :]) & (idx >= 0)
    match_len = np.cumprod(same, axis=1).sum(axis=1)  # [C]
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    # Most recent among the longest: argmax finds the first, so search reversed.
    end = int(candidates[len(candidates) - 1 - np.argmax(match_len[::-1] == best)])
    start = end + 1
    period = length - start  # >= 1: start <= L - 1
    return tokens[start + np.arange(k) % period]


class NgramProposer(Proposer):
    """Prompt-lookup drafts for every request that sampled this step."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes min={min_n}, max={max_n} need 1 <= min <= max")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, batch: DraftBatch) -> Proposal:
        drafts = []
        for i in batch.sample_idx.tolist():
            tokens = np.asarray(batch.states[i].token_ids, dtype=np.int64)
            drafts.append(propose_ngram(tokens, self.min_n, self.max_n, self.k).tolist())
        return Proposal(drafts)
