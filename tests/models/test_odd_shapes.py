"""Greedy output on checkpoint shapes the presets do not have, token-identical to
transformers (fp32) through `LLM.generate` with its defaults (the fused native layers where
the CPU has them): head sizes 24, 48 and 80, one KV head, as many KV heads as query heads,
hidden and intermediate sizes that are no multiple of 32, odd vocabularies, biases."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.testing import make_demo_model

SHAPES = {
    "llama-mqa-head24": dict(
        architecture="LlamaForCausalLM", hidden_size=72, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, intermediate_size=200, vocab_size=1000,
    ),
    "llama-mha-biases": dict(
        architecture="LlamaForCausalLM", hidden_size=96, num_attention_heads=6,
        num_key_value_heads=6, intermediate_size=100, vocab_size=777, attention_bias=True,
        mlp_bias=True,
    ),
    "qwen3-head48": dict(
        architecture="Qwen3ForCausalLM", hidden_size=80, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, intermediate_size=136, vocab_size=555,
    ),
    "mistral-head80": dict(
        architecture="MistralForCausalLM", hidden_size=120, num_attention_heads=5,
        num_key_value_heads=5, head_dim=80, intermediate_size=333, vocab_size=700,
    ),
}  # fmt: skip
NEW_TOKENS = 12


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' argmax continuation, EOS included (no generate() stopping rules)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_odd_shapes_match_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    shape = SHAPES[name]
    path = make_demo_model(tmp_path / name, preset="tiny", seed=3, **shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, shape["vocab_size"]) for _ in range(n)] for n in (1, 17, 70)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, prompt), len(prompt)
