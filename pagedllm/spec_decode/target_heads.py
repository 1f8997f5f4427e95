"""The target's token embedding and LM head, whole, for a drafter on a multi-rank target.

EAGLE and Medusa heads may share the target's embedding and LM head. With tensor or pipeline
parallelism the driver (the rank that drafts) holds a slice of them, or none; it loads this
unsharded copy instead, so drafting needs no collective. It looks like the target to the
proposers: `model.embed_tokens` and `compute_logits`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

_EMBED = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


class TargetHeads(nn.Module):
    """`model.embed_tokens` and `lm_head` of a Llama-family checkpoint (tied or not), built
    outside the process groups (call under `single_process_groups`)."""

    def __init__(self, *, config: EngineConfig) -> None:
        super().__init__()
        hf = config.model_config.hf_config
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        self.tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens if self.tied else ParallelLMHead(hf.vocab_size, hf.hidden_size)
        )
        self.lm_head.tied_lm_head = self.tied
        self.logits_processor = LogitsProcessor(hf.vocab_size)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> float32 logits [N, vocab_size]."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Takes the embedding (and the untied head) from the target's checkpoint; skips the
        rest."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == _EMBED:
                param = self.model.embed_tokens.weight
            elif name == _HEAD and not self.tied:
                param = self.lm_head.weight
            else:
                continue
            param.weight_loader(param, tensor)
            loaded.add(name)
        return loaded


def load_target_heads(config: EngineConfig, device: torch.device) -> TargetHeads:
    """The target's embedding and LM head, whole, on `device`."""
    from pagedllm.models.loader import load_module

    model_config = config.model_config
    return load_module(
        lambda: TargetHeads(config=config),
        model_config.model,
        model_config.dtype,
        device,
        f"checkpoint {model_config.model!r}",
        load_format=config.load_config.load_format,
        seed=model_config.seed,
    )
