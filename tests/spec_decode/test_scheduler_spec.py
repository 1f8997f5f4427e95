"""The scheduler's side of speculative decoding, with a fake runner: lookahead slots, roll
back, stop conditions inside accepted drafts, preemption, max_model_len, and the stats."""

from __future__ import annotations

import types

import torch

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.core.request import RequestStatus
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.spec_decode.config import SpeculativeConfig
from tests.core.utils import EOS_TOKEN_ID, create_requests, make_runner_output

K = 3


def _scheduler(num_blocks: int = 100, max_model_len: int = 256, block_size: int = 16):
    config = EngineConfig(
        model_config=ModelConfig(
            model="fake",
            tokenizer="fake",
            hf_config=types.SimpleNamespace(vocab_size=1000, hidden_size=64),
            dtype=torch.float32,
            max_model_len=max_model_len,
            eos_token_ids=[EOS_TOKEN_ID],
        ),
        cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=16, max_model_len=max_model_len
        ),
        parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cpu"),
        extra={
            "speculative_config": SpeculativeConfig.from_dict(
                {"method": "ngram", "num_speculative_tokens": K}
            )
        },
    )
    return Scheduler(config)


def _step(scheduler, tokens=None, drafts=None):
    so = scheduler.schedule()
    mro = make_runner_output(scheduler, so, tokens)
    if drafts is not None:
        mro.spec_token_ids = [list(drafts.get(r, [])) for r in mro.req_ids]
    out = scheduler.update_from_output(so, mro)
    scheduler.check_integrity()
    return so, out


def test_lookahead_slots_are_reserved():
    scheduler = _scheduler()
    (request,) = create_requests(1, prompt_len=14, max_tokens=50)
    scheduler.add_request(request)
    _step(scheduler, drafts={"req0": [1, 2, 3]})
    # 14 prompt tokens computed + k lookahead slots -> 17 slots -> 2 blocks of 16.
    assert len(scheduler.kv_cache_manager.get_block_ids("req0")) == 2
    assert request.spec_token_ids == [1, 2, 3]
    so, _ = _step(scheduler, tokens={"req0": [1, 2, 9]})
    assert so.num_scheduled_tokens == {"req0": 4}
    assert so.scheduled_spec_decode_tokens == {"req0": [1, 2, 3]}
    assert request.num_computed_tokens == 17  # 15 known + 2 accepted drafts, then rolled back


def test_stats_count_drafts_and_accepted_tokens_per_position():
    scheduler = _scheduler()
    add = create_requests(2, prompt_len=8, max_tokens=50)
    for r in add:
        scheduler.add_request(r)
    _step(scheduler, drafts={"req0": [1, 2, 3], "req1": [4, 5, 6]})
    scheduler.make_stats()
    _, out = _step(scheduler, tokens={"req0": [1, 2, 3, 7], "req1": [9]})
    spec = out.scheduler_stats.spec_decode
    assert spec == {
        "num_spec_tokens": K,
        "num_drafts": 2,
        "num_draft_tokens": 6,
        "num_accepted_tokens": 3,
        "num_accepted_tokens_per_pos": [1, 1, 1],
    }
    assert scheduler.make_stats().spec_decode is None  # reset after being reported


def test_stop_inside_accepted_drafts_truncates_and_finishes():
    scheduler = _scheduler()
    (request,) = create_requests(1, prompt_len=8, max_tokens=50)
    scheduler.add_request(request)
    _step(scheduler, drafts={"req0": [11, EOS_TOKEN_ID, 13]})
    _, out = _step(scheduler, tokens={"req0": [11, EOS_TOKEN_ID, 13, 14]})
    (eco,) = out.outputs
    assert eco.new_token_ids == [11, EOS_TOKEN_ID]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert "req0" not in scheduler.requests


def test_max_tokens_inside_accepted_drafts():
    scheduler = _scheduler()
    (request,) = create_requests(1, prompt_len=8, max_tokens=3)
    scheduler.add_request(request)
    _step(scheduler, drafts={"req0": [11, 12, 13]})
    _, out = _step(scheduler, tokens={"req0": [11, 12, 13, 14]})
    assert out.outputs[0].new_token_ids == [11, 12]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_drafts_never_run_past_max_model_len():
    scheduler = _scheduler(max_model_len=32)
    (request,) = create_requests(1, prompt_len=29, max_tokens=None)
    scheduler.add_request(request)
    _step(scheduler, drafts={"req0": [11, 12, 13]})  # 30 tokens now
    so, _ = _step(scheduler, tokens={"req0": [11, 12]})
    # Positions 29 (last token) and 30 (one draft): position 31 is left for the bonus token.
    assert so.scheduled_spec_decode_tokens == {"req0": [11]}
    assert request.num_tokens == 32 and request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_preemption_drops_the_drafts():
    # 4 blocks of 16 tokens: two requests of 24 tokens + lookahead cannot both grow.
    scheduler = _scheduler(num_blocks=4, max_model_len=64)
    for r in create_requests(2, prompt_len=24, max_tokens=30):
        scheduler.add_request(r)
    _step(scheduler, drafts={"req0": [1, 2, 3], "req1": [4, 5, 6]})
    preempted = []
    for _ in range(20):
        so, _ = _step(scheduler, drafts={"req0": [1, 2, 3], "req1": [4, 5, 6]})
        preempted += list(so.preempted_req_ids)
        for req_id in so.preempted_req_ids:
            assert scheduler.requests[req_id].spec_token_ids == []
            assert req_id not in so.scheduled_spec_decode_tokens
        if preempted:
            break
    assert preempted
