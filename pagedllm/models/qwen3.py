"""Qwen3: the Llama decoder with an RMSNorm over every query and key head before RoPE, an
explicit `head_dim` (which may differ from hidden_size / num_heads) and no q/k/v bias unless
`attention_bias` is set (then o_proj has one too)."""

from __future__ import annotations

from typing import Any

from pagedllm.models.llama import LlamaForCausalLM, LlamaLayerSpec


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM."""

    @classmethod
    def layer_spec(cls, hf_config: Any) -> LlamaLayerSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return LlamaLayerSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
