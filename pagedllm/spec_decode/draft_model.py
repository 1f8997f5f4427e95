"""Draft-model proposer: a second, smaller checkpoint with the target's vocabulary drafts k
tokens autoregressively, for the whole batch at once: the argmax for greedy requests, a sample
of the draft model's own distribution q (returned with the drafts) for sampling ones
(`DraftSampler`).

Per step, after verification:
1. One forward of the draft model over every scheduled request's valid tokens (those whose
   target KV is valid now: prompt chunks, the last token, accepted drafts) plus, for a request
   that sampled, its newest token. This rewrites the draft's KV for exactly the positions the
   target computed (rejected drafts' slots are overwritten) and its last row predicts d_1.
2. k - 1 single-token decode passes over the sampling requests: d_j at the next position
   predicts d_{j+1}. Their KV lands in the lookahead slots the scheduler reserved; the next
   step's first pass overwrites whatever the target does not accept.
A request still prefilling contributes step 1 only (its KV), and no drafts.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from pagedllm.spec_decode.proposer import (
    DraftBatch,
    PagedModelProposer,
    Proposal,
    gather_token_ids,
)


class DraftModelProposer(PagedModelProposer):
    """Drafts from a small causal LM loaded with the engine's own model loader."""

    def load_model(self, target_model: nn.Module) -> None:
        from pagedllm.models.loader import get_model

        draft_config = replace(self.config, model_config=self.spec.draft_model_config, extra={})
        self.model = get_model(draft_config)

    def propose(self, batch: DraftBatch) -> Proposal:
        states, idx = batch.states, batch.sample_idx
        sampled = np.zeros(len(states), dtype=np.int64)
        sampled[idx] = 1
        counts = batch.num_valid + sampled  # [B] rows of the first pass
        meta, positions = self.attention_metadata(batch.block_table, batch.start, counts)
        input_ids = torch.from_numpy(gather_token_ids(states, batch.start, counts))
        hidden = self.model(input_ids.to(self.device), positions, meta)  # [N, hidden]
        return self.draft(
            batch,
            counts,
            hidden,
            self.model.compute_logits,
            lambda token, _, positions, meta: self.model(token, positions, meta),
        )
