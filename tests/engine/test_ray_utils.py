"""`data_parallel_backend="ray"`: engine cores as Ray actors give one engine's greedy output."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture
def ray_cluster():
    """A local Ray cluster that fits this test: 2 CPUs, no dashboard, a small object store
    (the engines exchange nothing through it: they talk ZMQ)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20)
    yield ray
    ray.shutdown()


def test_ray_engines_match_one_engine(llama_dir, ray_cluster):
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 12 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=2 << 20)
    one = LLM(llama_dir, **kwargs)  # in process (tests/engine/conftest.py)
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    llm = LLM(llama_dir, data_parallel_size=2, data_parallel_backend="ray", **kwargs)
    try:
        engine_core = llm.llm_engine.engine_core
        assert engine_core.num_engines == 2 and engine_core.engine_pids == {}  # no processes
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()
