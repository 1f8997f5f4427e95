"""MultiProcExecutor end to end: greedy output (fp32) token-identical to the single-process
engine for TP=2, PP=2 and TP=2 x PP=2 on every architecture, with prefix caching, chunked
prefill and preemption at work; n > 1 and structured outputs too; and faults: a worker that
is killed or fails makes the engine raise within seconds and leaves no worker behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import re
import signal
import time

import pytest
import zmq

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.abstract import WorkerDiedError
from pagedllm.executor.multiproc_executor import MultiProcExecutor

pytestmark = pytest.mark.distributed

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}
MAX_NEW = 16
# The parallel engines run with every scheduling feature at work: 48-token chunks for prompts
# of up to 90 tokens, prefix caching over a shared 40-token prefix, and 14 KV blocks of 16
# tokens for 6 requests needing up to 7 each (so some are preempted and recomputed).
FEATURES = dict(
    enable_prefix_caching=True,
    max_num_batched_tokens=48,
    long_prefill_token_threshold=32,
    num_gpu_blocks_override=14,
    max_model_len=112,
)


@pytest.fixture(scope="module", autouse=True)
def _engine_core_in_process():
    """The EngineCore runs in the test process (its scheduler is inspectable); the executor
    still starts one worker process per rank."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        yield


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(10, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(10, 500) for _ in range(n)] for n in (3, 21, 50)]
    return prompts + [[rng.randrange(10, 500) for _ in range(n)] for n in (9, 33, 90)]


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _token_ids(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _generate(llm: LLM, params=None, prompts=None):
    prompts = prompts or _prompts()
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params or _greedy(), use_tqdm=False
    )


def _scheduler(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _worker_procs(llm: LLM) -> list:
    executor = llm.llm_engine.engine_core.engine_core.executor
    assert isinstance(executor, MultiProcExecutor)
    return [w.proc for w in executor.workers]


@pytest.fixture(scope="module")
def references(tiny_model_dirs) -> dict[str, list[list[list[int]]]]:
    """Per architecture: the single-process engine's greedy outputs (no caching, whole
    prompts, ample KV)."""
    refs = {}
    for arch in ARCHS:
        llm = LLM(model=tiny_model_dirs[arch], dtype="float32", kv_cache_memory_bytes=4 << 20,
                  enable_prefix_caching=False)  # fmt: skip
        refs[arch] = _token_ids(_generate(llm))
        llm.shutdown()
    return refs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_single_process(arch, layout, tiny_model_dirs, references):
    llm = LLM(model=tiny_model_dirs[arch], dtype="float32", **LAYOUTS[layout], **FEATURES)
    try:
        outs = _generate(llm)
        assert _token_ids(outs) == references[arch]
        assert _scheduler(llm).num_preemptions_total > 0
        assert all(o.num_cached_tokens >= 32 for o in outs[1:3])  # the shared prefix hit
        procs = _worker_procs(llm)
        assert len(procs) == LAYOUTS[layout].get("tensor_parallel_size", 1) * LAYOUTS[layout].get(
            "pipeline_parallel_size", 1
        )
    finally:
        llm.shutdown()
    assert all(p.exitcode is not None for p in procs)  # shutdown leaves no worker


def test_calculated_kv_scales_are_the_single_process_ones(tiny_model_dirs):
    """calculate_kv_scales under TP=2 x PP=2: the ranks take the max over their heads, so every
    layer gets the scales the single-process engine computes, and the greedy tokens over the
    scaled fp8 cache are the single-process engine's (each rank's own heads' maxima gave other
    scales, and other tokens)."""
    model = tiny_model_dirs["qwen3"]
    common = dict(
        dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True, max_model_len=112
    )
    single = LLM(model=model, kv_cache_memory_bytes=4 << 20, **common)
    expected = _token_ids(_generate(single))
    runner = single.llm_engine.engine_core.engine_core.executor.worker.model_runner
    from pagedllm.attention.layer import get_attention_layers

    scales = [layer.kv_scales for layer in get_attention_layers(runner.model)]
    single.shutdown()
    assert all(s.k != 1.0 for s in scales)
    llm = LLM(model=model, kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2,
              pipeline_parallel_size=2, **common)  # fmt: skip
    try:
        assert _token_ids(_generate(llm)) == expected
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tp2xpp2_llm(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=4 << 20,
              tensor_parallel_size=2, pipeline_parallel_size=2)  # fmt: skip
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def single_llm(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=4 << 20)
    yield llm
    llm.shutdown()


def test_seeded_n_and_structured_outputs_identical(tp2xpp2_llm, single_llm):
    """Sampling happens once, on the driver, from the request's own generator: seeded n > 1
    sampling and grammar-constrained output come out as in one process."""
    structured = StructuredOutputsParams(regex=r"(yes|no|maybe)( and (yes|no|maybe)){2}")
    params = [
        SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=structured),
        SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, logprobs=2),
    ]
    prompts = _prompts()[:3]
    expected = single_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)  # fmt: skip
    got = tp2xpp2_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
    assert _token_ids(got) == _token_ids(expected)
    assert re.fullmatch(structured.regex, got[1].outputs[0].text)
    ref_lp, got_lp = expected[2].outputs[0].logprobs, got[2].outputs[0].logprobs
    assert [sorted(p) for p in got_lp] == [sorted(p) for p in ref_lp]


def test_killed_worker_fails_the_engine_within_seconds(tiny_llama_dir):
    engine = LLMEngine.from_engine_args(
        _engine_args(tiny_llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
    )
    procs = [w.proc for w in engine.engine_core.engine_core.executor.workers]
    try:
        for i, p in enumerate(_prompts()[:3]):
            engine.add_request(str(i), {"prompt_token_ids": p}, _greedy(200))
        engine.step()
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1 .* died"):
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - t0 < 3
        deadline = time.monotonic() + 5  # the others were stopped: none hangs in a collective
        while any(p.is_alive() for p in procs):
            assert time.monotonic() < deadline, "a worker outlived its dead peer"
            time.sleep(0.05)
        with pytest.raises(WorkerDiedError):  # and every later call fails the same way
            engine.engine_core.engine_core.executor.execute_model(None)
    finally:
        engine.shutdown()


def test_failing_worker_call_is_reported(tiny_llama_dir):
    engine = LLMEngine.from_engine_args(_engine_args(tiny_llama_dir, tensor_parallel_size=2))
    executor = engine.engine_core.engine_core.executor
    try:
        with pytest.raises(WorkerDiedError, match="AttributeError"):
            executor.collective_rpc("no_such_method")
        for w in executor.workers:
            w.proc.join(5)
            assert w.proc.exitcode is not None
    finally:
        engine.shutdown()


def _engine_args(model_dir: str, **kwargs):
    from pagedllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, dtype="float32", kv_cache_memory_bytes=4 << 20, **kwargs)


def test_failed_start_up_leaves_no_worker_nor_open_queue(tiny_llama_dir):
    """A start-up that fails after the workers are up (here: a KV cache too small for
    max_model_len) stops them and frees their queues before the error reaches the user."""

    def open_contexts() -> int:
        gc.collect()
        return sum(isinstance(o, zmq.Context) and not o.closed for o in gc.get_objects())

    def workers() -> set[int]:
        return {p.pid for p in multiprocessing.active_children() if p.name.startswith("Worker-")}

    before, workers_before = open_contexts(), workers()  # other tests' engines may be up
    with pytest.raises(ValueError, match="fewer than one request of max_model_len=512"):
        LLMEngine.from_engine_args(
            _engine_args(
                tiny_llama_dir, tensor_parallel_size=2, max_model_len=512, num_gpu_blocks_override=2
            )  # fmt: skip
        )
    assert workers() == workers_before
    assert open_contexts() == before
