"""Fixtures for end-to-end engine tests: tiny checkpoints per architecture, and the
transformers greedy oracle."""

from __future__ import annotations

import os

import pytest
import torch

# Engine tests in this package run the engine core in-process unless they say otherwise.
os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")

ARCH_OVERRIDES = {
    # Llama with GQA and Llama-3 rope scaling.
    "llama": dict(
        architecture="LlamaForCausalLM",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "mistral": dict(architecture="MistralForCausalLM"),
    "qwen2": dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen3": dict(architecture="Qwen3ForCausalLM", head_dim=32),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch name -> tiny fp32 checkpoint dir (built lazily, once per session)."""
    from pagedllm.testing import make_demo_model

    cache: dict[str, str] = {}

    class _Dirs(dict):
        def __missing__(self, arch: str) -> str:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            made = make_demo_model(str(path), preset="tiny", seed=0, **ARCH_OVERRIDES[arch])
            self[arch] = made
            return made

    return _Dirs(cache)


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own `generate` (fp32, greedy, EOS not stopping) for each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            out = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            results.append(out[0, len(ids) :].tolist())
    return results
