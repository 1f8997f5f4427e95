"""Speculative decoding on a multi-rank target (TP=2 x PP=2, four worker processes): the
driver drafts with a whole (unsharded) drafter, and greedy output stays token-identical to
the single-process engine for every proposer, also with seeded sampling and a structured
request in the batch."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.spec_decode.metrics import SpecDecodingRecorder
from tests.spec_decode.test_spec_decode_e2e import KV_BYTES, _greedy, _prompts, _run

pytestmark = pytest.mark.distributed

METHODS = ["ngram", "draft_model", "draft_is_target", "eagle", "medusa"]
PARALLEL = dict(tensor_parallel_size=2, pipeline_parallel_size=2)


def _llm(target_dir: str, spec_config: dict | None, **kwargs) -> LLM:
    return LLM(model=target_dir, dtype="float32", kv_cache_memory_bytes=KV_BYTES,
               speculative_config=spec_config, **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    llm = _llm(target_dir, None)
    yield _run(llm, _prompts())
    llm.shutdown()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_on_tp2_pp2(method, target_dir, spec_configs, reference):
    llm = _llm(target_dir, spec_configs[method], **PARALLEL)
    try:
        totals = SpecDecodingRecorder()
        llm.llm_engine.stat_loggers.append(totals)
        assert _run(llm, _prompts()) == reference
        assert totals.num_drafts > 0
        if method == "draft_is_target":  # the drafter (whole) agrees with the sharded target
            assert totals.num_accepted_tokens == totals.num_draft_tokens
        if method == "draft_model":
            # Only the driver (rank 2: the last stage's first) keeps a drafter and its KV: it fits
            # the fewest blocks, and that minimum is what every rank allocates.
            core = llm.llm_engine.engine_core.engine_core
            per_rank = core.executor.collective_rpc("determine_num_kv_blocks")
            assert per_rank[2] < per_rank[3] and core.num_blocks == min(per_rank)
    finally:
        llm.shutdown()


def test_seeded_sampling_and_structured_requests(target_dir, spec_configs):
    regex = r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)"
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        _greedy(),
    ]  # fmt: skip
    prompts = _prompts()[:3]
    single = _llm(target_dir, spec_configs["draft_model"])
    expected = _run(single, prompts, params)
    single.shutdown()
    parallel = _llm(target_dir, spec_configs["draft_model"], **PARALLEL)
    try:
        assert _run(parallel, prompts, params) == expected
    finally:
        parallel.shutdown()
