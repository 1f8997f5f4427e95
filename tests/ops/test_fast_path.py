"""The engine's native CPU path against its pure-PyTorch path (`PAGEDLLM_CPU_KERNELS=0`):
the same greedy tokens, bf16, on a trained model and on tiny random models of each family."""

from __future__ import annotations

import pytest

from pagedllm.layers import cpu_gemm
from pagedllm.ops import build, cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="native CPU ops not built here")


def _forget_ops() -> None:
    build.cpu_ops.cache_clear()
    cpu_gemm._panel_ops.cache_clear()


def _generate(model_dir, prompts, kernels: bool, monkeypatch) -> list[list[int]]:
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "1" if kernels else "0")
    _forget_ops()
    try:
        llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_memory=16 << 20)
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        assert (runner.attn_backend.name == "cpu") == kernels
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.shutdown()
    finally:
        monkeypatch.delenv("PAGEDLLM_CPU_KERNELS")
        _forget_ops()
    return [o.outputs[0].token_ids for o in outs]


def test_trained_model_same_greedy_tokens(copy_model_dir, monkeypatch):
    from pagedllm.testing.copy_model import copy_prompts
    from pagedllm.transformers_utils.tokenizer import get_tokenizer

    prompts = copy_prompts(get_tokenizer(copy_model_dir), 12, 40, seed=2)
    prompts += [p[:7] for p in prompts[:4]]  # short prompts: batched decodes, uneven lengths
    fast = _generate(copy_model_dir, prompts, True, monkeypatch)
    assert fast == _generate(copy_model_dir, prompts, False, monkeypatch)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_same_greedy_tokens(arch, tiny_model_dirs, monkeypatch):
    prompts = [[5, 17, 99, 230, 31, 8, 77], [400, 12, 12, 301, 9], list(range(40, 90))]
    model_dir = tiny_model_dirs[arch]
    assert _generate(model_dir, prompts, True, monkeypatch) == _generate(
        model_dir, prompts, False, monkeypatch
    )
