"""`RejectionSampler`: verifies draft tokens against the target model, the whole batch at once.

Layout: request s of the batch has k_s >= 0 draft tokens and owns k_s + 1 consecutive rows of
the target logits: row j < k_s holds the target's distribution at draft j's position (the
logits that predict d_{j+1}), row k_s the distribution after the last draft (the bonus
position). Every row has already been given its own `SamplingMetadata` row (its params, its
generator, its output history including the drafts before it), so `p` is exactly the
distribution the normal `Sampler` would draw from there: penalties, bans and bias, then
temperature, min-p, top-k and top-p.

Algorithm (speculative sampling, Leviathan et al. / Chen et al.), left to right per request:
- greedy rows: accept d_j while d_j == argmax p_j; the first mismatch emits argmax p_j, and
  after k accepted drafts the bonus row emits argmax p_k. So every emitted token is the
  target's argmax: output is token-identical to non-speculative greedy decoding.
- random rows: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection
  emit a sample of normalize(max(p_j - q_j, 0)) and stop; after k acceptances emit a sample of
  p_k. Each emitted token is then distributed exactly as p. q comes from the draft model /
  EAGLE head where it sampled the draft; for argmax drafts (n-gram, Medusa, greedy and
  structured requests) q_j is one-hot on d_j: accept with probability p_j(d_j), resample from
  p_j with d_j removed.
All rows are processed by a handful of batched tensor ops (no loop over requests or tokens);
only seeded rows draw their randomness row by row from their request's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.ops.triton import triton_usable
from pagedllm.sample import ops
from pagedllm.sample.logprobs import LogprobsTensors, gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, has_logits_processors

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionSamplerOutput:
    """Per request: `output_token_ids[s, :num_accepted[s] + 1]` are its new tokens (accepted
    drafts, then the recovered or bonus token); the rest is PLACEHOLDER_TOKEN_ID."""

    output_token_ids: torch.Tensor  # [S, k_max + 1] int64
    num_accepted: torch.Tensor  # [S] int64
    # Logprobs of the emitted token at every row (column 0), when some row asked for them.
    logprobs: LogprobsTensors | None  # [T, n + 1]
    row_start: torch.Tensor  # [S] int64: request s's first row in the logits

    def to_lists(self) -> list[list[int]]:
        """Each request's emitted tokens (one host sync)."""
        tokens = self.output_token_ids.tolist()
        counts = (self.num_accepted + 1).tolist()
        return [row[:n] for row, n in zip(tokens, counts)]


class RejectionSampler(nn.Module):
    """Accept / reject draft tokens and sample the extra token (see the module docstring)."""

    def forward(
        self,
        logits: torch.Tensor,  # [T, V] target logits, T = sum(k_s + 1)
        metadata: SamplingMetadata,  # T rows
        draft_token_ids: torch.Tensor,  # [T] int64; the draft at each row, anything at bonus rows
        num_draft_tokens: list[int],  # [S] k_s
        draft_probs: torch.Tensor | None = None,  # [T, V] q at each draft row, or None: one-hot
    ) -> RejectionSamplerOutput:
        device = logits.device
        num_rows = logits.shape[0]
        k = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [S]
        row_start = torch.cumsum(k + 1, 0) - (k + 1)  # [S]
        # Row -> its request and its index j within the request; bonus rows have j == k_s.
        req_of_row = torch.repeat_interleave(torch.arange(k.shape[0], device=device), k + 1)
        j_of_row = torch.arange(num_rows, device=device) - row_start[req_of_row]  # [T]
        is_draft_row = j_of_row < k[req_of_row]  # [T]
        drafts = torch.where(is_draft_row, draft_token_ids, 0)

        processed = logits.to(torch.float32)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(processed, dim=-1)
        # The processing below works in place; greedy rows without logits processors only
        # take an argmax and can read the caller's tensor.
        writes = not metadata.all_greedy or has_logits_processors(metadata)
        if processed is logits and writes:
            processed = processed.clone()
        processed = Sampler.apply_logits_processors(processed, metadata)

        emitted, accepted = self._verify(processed, metadata, drafts, is_draft_row, draft_probs)

        # Per request: [S, k_max + 1] views of the rows, accepted prefix length, emitted tokens.
        k_max = max(num_draft_tokens, default=0)
        cols = torch.arange(k_max + 1, device=device)  # [K+1]
        in_req = cols[None, :] <= k[:, None]  # [S, K+1]
        rows = (row_start[:, None] + torch.minimum(cols[None, :], k[:, None])).clamp_(
            max=max(num_rows - 1, 0)
        )
        acc = accepted[rows] & (cols[None, :] < k[:, None])  # [S, K+1]
        num_accepted = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [S]
        keep = in_req & (cols[None, :] <= num_accepted[:, None])
        output = torch.where(keep, emitted[rows], PLACEHOLDER_TOKEN_ID)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, emitted, metadata.max_num_logprobs)
        return RejectionSamplerOutput(output, num_accepted, logprobs, row_start)

    @staticmethod
    def _verify(
        processed: torch.Tensor,  # [T, V] after penalties / bans / bias
        metadata: SamplingMetadata,
        drafts: torch.Tensor,  # [T]
        is_draft_row: torch.Tensor,  # [T] bool
        draft_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token emitted at each row if the walk reaches it [T], draft accepted [T])."""
        greedy = None
        if not metadata.all_random:
            greedy = ops.argmax(processed)  # [T]
            if metadata.all_greedy:
                return greedy, is_draft_row & (drafts == greedy)

        probs = target_probs(processed, metadata)  # [T, V]
        uniform = ops.uniform(probs.shape[0], metadata.generators, processed.device)  # [T]
        if probs.device.type == "cuda" and triton_usable(probs.device):
            from pagedllm.ops.triton.rejection_sample import accept_and_recover

            u_recover = ops.uniform(probs.shape[0], metadata.generators, probs.device)
            args = (probs, drafts, is_draft_row, draft_probs, uniform, u_recover)
            accept, recovered = accept_and_recover(*args)
        else:
            accept, recovered = accept_and_recover_torch(
                probs, drafts, is_draft_row, draft_probs, uniform, metadata.generators
            )
        emitted = torch.where(accept, drafts, recovered)
        if greedy is None:
            return emitted, accept
        is_greedy = metadata.temperature == 0.0
        return (
            torch.where(is_greedy, greedy, emitted),
            torch.where(is_greedy, is_draft_row & (drafts == greedy), accept),
        )


def accept_and_recover_torch(
    probs: torch.Tensor,  # [T, V] target probabilities
    drafts: torch.Tensor,  # [T]
    is_draft_row: torch.Tensor,  # [T] bool
    draft_probs: torch.Tensor | None,  # [T, V] q, or None: one-hot on the draft
    uniform: torch.Tensor,  # [T] U[0, 1): accept d when uniform * q(d) < p(d)
    generators: dict[int, torch.Generator],  # the recovered draw's uniforms come from here
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (draft accepted [T] bool, token emitted on rejection [T]). The PyTorch path of
    `ops/triton/rejection_sample.py` (its docstring states the step)."""
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1)  # [T]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        # max(p - onehot(d), 0) is p with d removed.
        residual = probs.scatter(1, drafts[:, None], 0.0)
    else:
        q = draft_probs.to(torch.float32)
        q_draft = q.gather(1, drafts[:, None]).squeeze(1)
        residual = (probs - q).clamp_min_(0.0)
    # Bonus rows (and any row that cannot reject) sample p itself.
    residual = torch.where(is_draft_row[:, None], residual, probs)
    # A rejection is impossible where the residual is empty (p <= q everywhere, i.e.
    # p == q): sampling it would pick an arbitrary token; accept instead.
    empty = residual.sum(dim=-1) <= 0
    accept = is_draft_row & ((uniform * q_draft < p_draft) | empty)
    return accept, ops.random_sample(residual, generators)


def target_probs(processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The random rows' sampling distribution: temperature, min-p, top-k, top-p, softmax.
    `processed [T, V]` is overwritten. Greedy rows (temperature 0) come out as a softmax at
    temperature 1; callers use their argmax instead."""
    logits = ops.apply_temperature(processed, metadata.temperature)
    if metadata.min_p is not None:
        logits = ops.apply_min_p(logits, metadata.min_p)
    logits = ops.apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    return torch.softmax(logits, dim=-1)
