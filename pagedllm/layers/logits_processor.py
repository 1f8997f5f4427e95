"""Hidden states -> full-vocabulary float32 logits."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import tp_gather
from pagedllm.layers.cpu_gemm import packed_linear
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    """Projects hidden states with an LM head (a `ParallelLMHead`, or the embedding when tied),
    gathers the vocabulary slices of all tensor-parallel ranks on the first one (the rank that
    samples), trims the padding rows and returns float32 logits there; the other ranks of a
    sharded head get None."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor
    ) -> torch.Tensor | None:
        # hidden_states [N, hidden] -> local logits [N, V_p] -> gathered [N, V_p * tp]
        bias = getattr(lm_head, "bias", None)
        logits = packed_linear(lm_head, hidden_states, bias, out_dtype=torch.float32)
        if lm_head.tp_size > 1:
            logits = tp_gather(logits, dst=0, dim=-1)
            if logits is None:
                return None
        return logits[:, : self.vocab_size]  # [N, vocab_size] float32
