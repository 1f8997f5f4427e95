"""Engines for the connector tests: one workload (shared prefixes, so prefix caching hits;
prompts longer than the step budget, so prefill is chunked; more KV than the cache holds at
once, so requests are preempted), run in-process, and its output without any connector (the
reference every connector must reproduce token for token, fp32 greedy)."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=128,
    num_gpu_blocks_override=12,
    max_num_batched_tokens=32,
    max_num_seqs=4,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
)
MAX_TOKENS = 24
SHARED_PREFIX_LEN = 48


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(4, 500) for _ in range(SHARED_PREFIX_LEN)]
    return [shared + [rng.randrange(4, 500) for _ in range(n)] for n in (20, 35, 9, 40, 26, 17)]


def greedy(max_tokens: int = MAX_TOKENS, kv_transfer_params: dict | None = None):
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def scheduler_of(llm: LLM):
    """The in-process engine core's scheduler."""
    return llm.llm_engine.engine_core.engine_core.scheduler


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts()]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompts) -> list[list[int]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(tiny_llama_dir, **ENGINE_KWARGS)
        try:
            out = token_ids(llm.generate(prompts, greedy(), use_tqdm=False))
            assert scheduler_of(llm).num_preemptions_total > 0, "the workload must preempt"
        finally:
            llm.shutdown()
    return out


@pytest.fixture
def make_llm(tiny_llama_dir):
    """LLM(tiny llama, ENGINE_KWARGS overridden by kwargs); shut down after the test."""
    made: list[LLM] = []

    def make(**kwargs) -> LLM:
        llm = LLM(tiny_llama_dir, **{**ENGINE_KWARGS, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def check_idle(llm: LLM) -> None:
    """Every block back in the pool, bookkeeping consistent."""
    scheduler = scheduler_of(llm)
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.usage == 0.0
    assert not scheduler.has_pending_kv_transfers()
