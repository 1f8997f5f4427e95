"""`data_parallel_backend="ray"`: engine cores as Ray actors give one engine's greedy output."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_ray_engines_match_one_engine(llama_dir):
    pytest.importorskip("ray")
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 12 + i]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, kv_cache_memory=2 << 20)
    one = LLM(llama_dir, **kwargs)  # in process (tests/engine/conftest.py)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    one.shutdown()
    llm = LLM(llama_dir, data_parallel_size=2, data_parallel_backend="ray", **kwargs)
    try:
        engine_core = llm.llm_engine.engine_core
        assert engine_core.num_engines == 2 and engine_core.engine_pids == {}  # no processes
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()
        import ray

        ray.shutdown()
