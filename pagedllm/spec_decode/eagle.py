"""EAGLE proposer: a one-layer head that extrapolates the target's hidden states.

The head (EAGLE-1, Llama flavour) maps (token embedding e_{p+1}, target feature f_p) to the
feature at p + 1:

    x = fc(concat(e_{p+1}, f_p))           # [N, 2H] -> [N, H]
    x, r = decoder_layer(x)                 # Llama layer; layer 0 has no input norm
    f'_{p+1} = x + r                        # no final norm; logits = target lm_head(f')

so its row at position p predicts token p + 2. Its attention layer has its own paged KV cache
over the target's block ids, position p holding the row (f_p, t_{p+1}).

Per step, after verification (f_p = the target's last hidden state at p, already normed):
1. One pass over every valid row: positions start .. start + num_valid - 1 of each request,
   with the token one ahead of each (t_{p+1}; for a sampling request the last one is the token
   just sampled). The last row of a sampling request predicts d_1.
2. k - 1 single-row passes: (e(d_j), f' of the previous pass) at the next position predicts
   d_{j+1}.

Checkpoint (as published for EAGLE, and vLLM's layout): config.json of a Llama with
`num_hidden_layers` 1 and architectures `EagleLlamaForCausalLM` or `LlamaForCausalLMEagle`
(or vLLM's model_type "eagle" wrapping the Llama config under "model"); tensors `fc.weight`
(optional `fc.bias`), `layers.0.*` (q/k/v, o, gate/up/down, post_attention_layernorm;
an `input_layernorm` is used when present), optionally `embed_tokens.weight` and
`lm_head.weight` (otherwise the target's are shared); a leading `model.` is ignored.
Prefix caching caveat: a cached block's last EAGLE row was computed with the token that
followed it in the request that filled it, which may differ for a request sharing only the
prefix; that only costs acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.layers.linear import ReplicatedLinear, default_weight_loader
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.rotary_embedding import get_rope, rope_parameters_from_config
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, get_head_dim
from pagedllm.spec_decode.proposer import (
    DraftBatch,
    PagedModelProposer,
    Proposal,
    checkpoint_tensor_names,
    gather_token_ids,
    load_head,
)

_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _canonical(name: str) -> str:
    return name.removeprefix("model.")


class EagleLlamaForCausalLM(nn.Module):
    """The EAGLE head (see the module docstring). Built by `EagleProposer` with what the
    checkpoint holds: `fc_bias`, `own_embed` / `own_lm_head` (else the target's are used),
    `first_input_norm` (layer 0's input RMSNorm)."""

    def __init__(
        self,
        *,
        config: EngineConfig,
        fc_bias: bool = False,
        own_embed: bool = False,
        own_lm_head: bool = False,
        first_input_norm: bool = False,
        prefix: str = "eagle",
    ) -> None:
        super().__init__()
        hf = config.model_config.hf_config
        hidden = hf.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=fc_bias, prefix=f"{prefix}.fc")
        head_dim = get_head_dim(hf)
        theta, rope_params = rope_parameters_from_config(hf)
        partial = (rope_params or {}).get("partial_rotary_factor", 1.0)
        rotary = get_rope(
            head_dim,
            int(head_dim * partial),
            hf.max_position_embeddings,
            theta,
            rope_params,
            cache_len=max(hf.max_position_embeddings, config.model_config.max_model_len),
        )
        spec = LlamaForCausalLM.layer_spec(hf)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf, spec, rotary, prefix=f"{prefix}.layers.{i}")
            for i in range(hf.num_hidden_layers)
        )
        if not first_input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = (
            VocabParallelEmbedding(hf.vocab_size, hidden, prefix=f"{prefix}.embed_tokens")
            if own_embed
            else None
        )
        self.lm_head = (
            ParallelLMHead(hf.vocab_size, hidden, prefix=f"{prefix}.lm_head")
            if own_lm_head
            else None
        )
        self.logits_processor = LogitsProcessor(hf.vocab_size)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [N, H] embeddings of t_{p+1}
        features: torch.Tensor,  # [N, H] target (or previous head) features at p
        positions: torch.Tensor,  # [N]
        attn_metadata: Any,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([inputs_embeds, features.to(inputs_embeds.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn_metadata)
        return x + residual  # [N, H] predicted features at p + 1

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = _canonical(name)
            if "rotary_emb." in name:
                continue
            if name.startswith("lm_head.") and self.lm_head is None:
                continue
            if name.startswith("embed_tokens.") and self.embed_tokens is None:
                continue
            parts, shard_id = name.split("."), None
            for i, part in enumerate(parts):
                if part in _PACKED:
                    parts[i], shard_id = _PACKED[part]
                    break
            param_name = ".".join(parts)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"EAGLE checkpoint tensor {name!r} matches no head parameter")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(param_name)
        return loaded


class EagleProposer(PagedModelProposer):
    """Drafts k tokens per sampling request with an EAGLE head: the argmax for greedy
    requests, a sample of the head's distribution q for sampling ones (`DraftSampler`)."""

    def load_model(self, target_model: nn.Module) -> None:
        self.target = target_model
        model_dir = self.spec.model
        load_format = self.config.load_config.load_format
        names = {_canonical(n) for n in checkpoint_tensor_names(model_dir, load_format)}
        draft_config = replace(self.config, model_config=self.spec.draft_model_config, extra={})
        self.model = load_head(
            lambda: EagleLlamaForCausalLM(
                config=draft_config,
                fc_bias="fc.bias" in names,
                own_embed="embed_tokens.weight" in names,
                own_lm_head="lm_head.weight" in names,
                first_input_norm="layers.0.input_layernorm.weight" in names,
            ),
            model_dir,
            self.dtype,
            self.device,
            load_format,
        )

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        embed = self.model.embed_tokens or self.target.model.embed_tokens
        return embed(token_ids)

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        if self.model.lm_head is not None:
            return self.model.logits_processor(self.model.lm_head, features)
        return self.target.compute_logits(features)

    def propose(self, batch: DraftBatch) -> Proposal:
        states = batch.states
        counts = batch.num_valid  # [B] rows: every position whose target KV is valid
        # Row at position p pairs the target's feature f_p with token t_{p+1}.
        token_ids = gather_token_ids(states, batch.start + 1, counts)
        offsets = np.cumsum(counts) - counts
        rows = np.repeat(batch.row_start - offsets, counts) + np.arange(int(counts.sum()))
        features = batch.hidden[torch.from_numpy(rows).to(self.device)]
        meta, positions = self.attention_metadata(batch.block_table, batch.start, counts)
        embeds = self._embed(torch.from_numpy(token_ids).to(self.device))
        out = self.model(embeds, features, positions, meta)  # [N, H]
        return self.draft(
            batch,
            counts,
            out,
            self._logits,
            lambda token, feature, positions, meta: self.model(
                self._embed(token), feature, positions, meta
            ),
        )
