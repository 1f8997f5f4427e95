"""Next-token candidates of beam-search rows (the runner does not sample those rows; the
scheduler's `BeamGroup` picks among the candidates)."""

from __future__ import annotations

import torch

from pagedllm.outputs import BeamCandidates


def beam_candidates(
    logits: torch.Tensor,  # [B, V]
    num_candidates: list[int],  # [B]
    temperatures: list[float],  # [B]
) -> list[BeamCandidates]:
    """Per row, its top `num_candidates[i]` tokens by raw log-softmax (vLLM scores beams on
    raw logprobs). A row with temperature > 0 also gets one token sampled from
    softmax(logits / temperature), appended when it is not already among them (vLLM's
    beam search adds the sampled token to the scored candidates)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [B, V]
    k = min(max(num_candidates), logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # [B, k] each, best first
    ids_rows, lp_rows = top_ids.tolist(), top_logprobs.tolist()
    results: list[BeamCandidates] = []
    for i, (n, temperature) in enumerate(zip(num_candidates, temperatures)):
        ids, lps = ids_rows[i][:n], lp_rows[i][:n]
        ranks = list(range(1, len(ids) + 1))
        if temperature > 0:
            probs = torch.softmax(logits[i].to(torch.float32) / temperature, dim=-1)
            token_id = int(torch.multinomial(probs, 1))
            if token_id not in ids:
                logprob = logprobs[i, token_id]
                ids.append(token_id)
                lps.append(float(logprob))
                ranks.append(int((logprobs[i] > logprob).sum()) + 1)
        results.append((ids, lps, ranks))
    return results
