"""Verification step of speculative decoding, as the model runner calls it.

For each request that samples this step, with drafts d_1..d_k scheduled after its last known
token, the flattened batch holds [last token, d_1, ..., d_k] at consecutive positions; the
hidden states of those k + 1 rows give the target distributions that verify d_1..d_k and
sample one more token. The runner takes the logits of all those rows (`verification_rows`,
one LM-head call) and masks structured requests' rows with their grammar bitmask rows;
`verify_and_sample` gives each row its own sampling-metadata row (the request's params and
generator, and an output history that includes the drafts before that row, so penalties,
min_tokens and bad words see what the target would have seen), lays out the draft
distributions q of sampled drafts, runs the `RejectionSampler`, and returns each request's
accepted tokens plus the recovered / bonus token. A request without drafts is the k = 0 case:
one row, one sampled token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.outputs import LogprobsLists
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection_sampler import RejectionSampler, RejectionSamplerOutput


def verification_rows(last_rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Flattened-batch rows of every verified position: for request s the k_s + 1 rows ending
    at `last_rows[s]` -> [sum(k_s + 1)] int64."""
    counts = num_drafts + 1
    firsts = last_rows - num_drafts  # [S]
    offsets = np.cumsum(counts) - counts  # [S]
    within = np.arange(int(counts.sum())) - np.repeat(offsets, counts)
    return np.repeat(firsts, counts) + within


def _needs_history(p: SamplingParams, num_output: int) -> bool:
    """Whether this request's sampling reads its output tokens (so each verified position
    needs its own history, drafts included)."""
    return (
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or bool(p.bad_words_token_ids)
        or num_output < p.min_tokens
    )


def build_row_metadata(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[list[int]],
    output_token_ids: Sequence[list[int]],
    generators: Sequence[torch.Generator | None],
    drafts: Sequence[list[int]],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """One `SamplingMetadata` row per verified position (request s repeated k_s + 1 times);
    row j of request s sees output history `outputs[s] + drafts[s][:j]`."""
    row_params, row_prompts, row_outputs, row_gens = [], [], [], []
    for p, prompt, out, gen, d in zip(
        params, prompt_token_ids, output_token_ids, generators, drafts
    ):
        n = len(d) + 1
        row_params += [p] * n
        row_prompts += [prompt] * n
        row_gens += [gen] * n
        if _needs_history(p, len(out)):
            row_outputs += [out + d[:j] for j in range(n)]
        else:
            row_outputs += [out] * n
    return SamplingMetadata.build(
        row_params, row_prompts, row_outputs, row_gens, vocab_size=vocab_size, device=device
    )


def verify_and_sample(
    logits: torch.Tensor,  # [R, V] target logits at the rows of `verification_rows`
    drafts: list[list[int]],  # [S] the drafts scheduled for each request (possibly empty)
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    rejection_sampler: RejectionSampler,
    draft_probs: list[torch.Tensor | None] | None = None,  # [S] q [>= k_s, V], None: one-hot
) -> tuple[list[list[int]], list[LogprobsLists | None] | None]:
    """-> (emitted tokens per request, their logprobs per request or None)."""
    device = logits.device
    num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
    metadata = build_row_metadata(
        params, prompt_token_ids, output_token_ids, generators, drafts, logits.shape[-1], device
    )
    # Draft j of request s sits at row offset_s + j of the logits; bonus rows keep 0.
    offsets = np.cumsum(num_drafts + 1) - (num_drafts + 1)  # [S]
    total_drafts = int(num_drafts.sum())
    draft_rows = np.repeat(offsets, num_drafts) + (
        np.arange(total_drafts) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
    )
    draft_ids = np.zeros(logits.shape[0], dtype=np.int64)
    draft_ids[draft_rows] = np.fromiter(
        itertools.chain.from_iterable(drafts), dtype=np.int64, count=total_drafts
    )
    draft_ids_t = torch.from_numpy(draft_ids).to(device)
    q = None
    if draft_probs is not None:
        q = _dense_draft_probs(logits, draft_probs, drafts, offsets, draft_rows, draft_ids_t)
    out = rejection_sampler(logits, metadata, draft_ids_t, num_drafts.tolist(), q)
    token_lists = out.to_lists()
    logprobs = None
    if out.logprobs is not None:
        logprobs = _logprobs_lists(out, token_lists, [p.logprobs for p in params])
    return token_lists, logprobs


def _dense_draft_probs(
    logits: torch.Tensor,  # [R, V]
    draft_probs: list[torch.Tensor | None],  # [S]
    drafts: list[list[int]],  # [S]
    offsets: np.ndarray,  # [S] first row of each request
    draft_rows: np.ndarray,  # [D] rows holding a draft
    draft_ids: torch.Tensor,  # [R] the draft at each row
) -> torch.Tensor | None:
    """q at every row [R, V] for the rejection sampler: the proposer's distribution where it
    sampled, one-hot on the draft where it picked the argmax, zero at bonus rows. None when
    no scheduled draft was sampled (all one-hot: the sampler's cheaper path)."""
    sampled = [s for s, (p, d) in enumerate(zip(draft_probs, drafts)) if p is not None and d]
    if not sampled:
        return None
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    rows = torch.from_numpy(draft_rows).to(logits.device)
    q[rows, draft_ids[rows]] = 1.0
    q_rows = np.concatenate([offsets[s] + np.arange(len(drafts[s])) for s in sampled])
    q[torch.from_numpy(q_rows).to(logits.device)] = torch.cat(
        [draft_probs[s][: len(drafts[s])] for s in sampled]
    )
    return q


def _logprobs_lists(
    out: RejectionSamplerOutput, token_lists: list[list[int]], num_per_req: list[int | None]
) -> list[LogprobsLists | None]:
    ids = out.logprobs.top_token_ids.tolist()
    lps = out.logprobs.top_logprobs.tolist()
    ranks = out.logprobs.sampled_rank.tolist()
    starts = out.row_start.tolist()
    result: list[LogprobsLists | None] = []
    for s, n in enumerate(num_per_req):
        if n is None:
            result.append(None)
            continue
        a, b = starts[s], starts[s] + len(token_lists[s])
        result.append(
            LogprobsLists(
                token_ids=[row[: n + 1] for row in ids[a:b]],
                logprobs=[row[: n + 1] for row in lps[a:b]],
                ranks=ranks[a:b],
            )
        )
    return result
