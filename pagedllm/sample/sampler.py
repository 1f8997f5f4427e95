"""The `Sampler`: model logits of the rows that sample this step -> one token per row.

Order of operations (vLLM V1's):
1. logprobs, if any row asked for them, from the RAW logits (log_softmax before any processing);
2. float32, then allowed_token_ids, bad words and min_tokens masks, logit_bias, and the
   repetition / frequency / presence penalties: these can change the argmax, so they apply to
   greedy rows too;
3. greedy rows take the argmax here;
4. random rows: temperature, min-p, top-k, top-p, then one inverse-CDF draw (seeded rows draw
   their uniform from their own generator; no torch.multinomial, which syncs). On the CPU,
   top-p is not a mask but part of the draw (`ops.random_sample_top_p`: rejection, no sort);
   with none of min-p / top-k / top-p, the native `sample_rows` makes the same draw in one
   pass per row (temperature, max, exp and the chunk sums together; `ops.native_sampling`),
   and with any of them `sample_rows_truncated` makes each round of the rejection draw, the
   truncations as weight floors (`ops.native_random_sample`).
Mixed batches run both paths and pick per row with `torch.where`; on the device nothing syncs
with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.batch_invariant import det_exp
from pagedllm.sample import ops
from pagedllm.sample.logprobs import LogprobsTensors, compute_token_logprobs
from pagedllm.sample.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """One token per row, and the logprobs when some row asked for them."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # [B, max_num_logprobs + 1]; column 0 = sampled token


class Sampler(nn.Module):
    """Samples one token per row of the logits, following each row's `SamplingParams`.

    `batch_invariant`: the draw's weights come from `det_exp`, whose bits do not depend on
    the row's place in the batch (layers/batch_invariant.py)."""

    def __init__(self, batch_invariant: bool = False) -> None:
        super().__init__()
        self.batch_invariant = batch_invariant

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata, overwrite: bool = False
    ) -> SamplerOutput:
        """`logits [B, V]` (any float dtype) -> `SamplerOutput`. `logits` is left unchanged
        unless the caller hands it over with `overwrite=True` (saves a [B, V] copy)."""
        processed = logits.to(torch.float32)
        # Logprobs are of the raw logits, taken after the draw: then nothing may write to them.
        raw = processed if metadata.max_num_logprobs is not None else None

        # The ops work in place on the sampler's own copy; an fp32 input has to be copied
        # first, unless nothing writes to it before temperature (which can copy as it goes).
        owned = (overwrite or processed is not logits) and raw is None
        if not owned and has_logits_processors(metadata):
            processed, owned = processed.clone(), True
        processed = self.apply_logits_processors(processed, metadata)
        sampled = self.sample(
            processed, metadata, in_place=owned, batch_invariant=self.batch_invariant
        )

        logprobs = None
        if raw is not None:
            logprobs = compute_token_logprobs(raw, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The processing that applies to every row, greedy ones included."""
        if metadata.allowed_token_ids is not None:
            logits = ops.apply_allowed_token_ids(logits, *metadata.allowed_token_ids)
        if metadata.banned_token_ids is not None:
            logits = ops.apply_banned_tokens(logits, *metadata.banned_token_ids)
        if metadata.logit_bias is not None:
            logits = ops.apply_logit_bias(logits, *metadata.logit_bias)
        if metadata.repetition_penalties is not None:
            logits = ops.apply_repetition_penalty(
                logits, metadata.repetition_token_ids, metadata.repetition_penalties
            )
        if metadata.output_token_counts is not None:
            logits = ops.apply_frequency_presence_penalties(
                logits,
                metadata.output_token_ids,
                metadata.output_token_counts,
                metadata.frequency_penalties,
                metadata.presence_penalties,
            )
        return logits

    @staticmethod
    def sample(
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        in_place: bool = True,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Processed `logits [B, V]` -> token ids [B]. Random rows overwrite `logits` when
        `in_place`, else work on a copy."""
        greedy = None
        if not metadata.all_random:
            greedy = ops.argmax(logits)  # [B]
            if metadata.all_greedy:
                return greedy

        plain = metadata.min_p is None and metadata.top_k is None and metadata.top_p is None
        native = ops.native_sampling(logits) if not batch_invariant else None
        if native is not None and plain:
            # One native pass per row: the same inverse-CDF draw, the logits left as they are.
            u = ops.uniform(logits.shape[0], metadata.generators, logits.device)
            sampled = native.sample_rows(logits, metadata.temperature, u)
        elif native is not None:  # the same truncations and rounds, each round one native call
            sampled = ops.native_random_sample(
                native,
                logits,
                metadata.temperature,
                metadata.generators,
                top_k=metadata.top_k,
                max_top_k=metadata.max_top_k,
                top_p=metadata.top_p,
                min_p=metadata.min_p,
            )
        else:
            sampled = Sampler._draw(logits, metadata, in_place, batch_invariant)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature == 0.0, greedy, sampled)

    @staticmethod
    def _draw(
        logits: torch.Tensor, metadata: SamplingMetadata, in_place: bool, batch_invariant: bool
    ) -> torch.Tensor:
        """The random rows' draw in PyTorch ops: temperature, min-p, top-k / top-p, exp, the
        inverse CDF (rows with temperature 0 draw too; the caller replaces them)."""
        logits = ops.apply_temperature(logits, metadata.temperature, in_place=in_place)
        if metadata.min_p is not None:
            logits = ops.apply_min_p(logits, metadata.min_p)
        # On the CPU top-p is part of the draw (no sort); elsewhere it masks the logits.
        top_p_in_draw = metadata.top_p is not None and logits.device.type == "cpu"
        mask_top_p = None if top_p_in_draw else metadata.top_p
        logits = ops.apply_top_k_top_p(logits, metadata.top_k, mask_top_p, metadata.max_top_k)
        # Unnormalized probabilities are enough for the draw; computed in place.
        logits = logits.sub_(logits.amax(dim=-1, keepdim=True))
        weights = det_exp(logits) if batch_invariant else logits.exp_()  # [B, V]
        if top_p_in_draw:
            return ops.random_sample_top_p(weights, metadata.top_p, metadata.generators)
        return ops.random_sample(weights, metadata.generators)


def has_logits_processors(metadata: SamplingMetadata) -> bool:
    """Whether any op before sampling writes to the logits."""
    return not (
        metadata.no_penalties
        and metadata.allowed_token_ids is None
        and metadata.banned_token_ids is None
        and metadata.logit_bias is None
    )
