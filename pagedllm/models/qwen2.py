"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj, none in the
MLP); small checkpoints usually tie the LM head to the embedding."""

from __future__ import annotations

from typing import Any

from pagedllm.models.llama import LlamaForCausalLM, LlamaLayerSpec


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    @classmethod
    def layer_spec(cls, hf_config: Any) -> LlamaLayerSpec:
        return LlamaLayerSpec(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
