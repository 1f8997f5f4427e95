"""Fixtures for end-to-end engine tests: the transformers greedy oracle, and short names for
the session-wide tiny checkpoints of tests/conftest.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _engine_core_in_process():
    """Engine tests here run the EngineCore in-process (fast start); the multiprocess client
    has its own tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="session")
def model_dirs(tiny_model_dirs):
    """arch ("llama", "mistral", "qwen2", "qwen3") -> tiny fp32 checkpoint dir."""
    return tiny_model_dirs


@pytest.fixture(scope="session")
def llama_dir(tiny_llama_dir) -> str:
    return tiny_llama_dir


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
