"""Tests for pagedllm.core.sched.scheduler, driven by a fake model runner (tests/core/utils.py)."""

from collections import deque

import pytest

from pagedllm.config import ParallelConfig
from pagedllm.core.request import RequestStatus
from pagedllm.engine import EngineCoreEventType, FinishReason
from pagedllm.outputs import LogprobsLists
from tests.core.utils import (
    DEFAULT_TOKEN,
    EOS_TOKEN_ID,
    create_requests,
    create_scheduler,
    make_runner_output,
    run_to_completion,
    step,
)


def add_all(scheduler, requests):
    for request in requests:
        scheduler.add_request(request)


def by_id(outputs):
    return {o.request_id: o for o in outputs.outputs}


# ---- admission, budget, chunking ----------------------------------------------------------


def test_new_requests_get_their_whole_block_table():
    scheduler = create_scheduler()
    requests = create_requests(3, prompt_len=20)
    add_all(scheduler, requests)
    so = scheduler.schedule()
    assert [d.req_id for d in so.scheduled_new_reqs] == ["req0", "req1", "req2"]
    assert so.scheduled_cached_reqs.num_reqs == 0
    assert so.num_scheduled_tokens == {"req0": 20, "req1": 20, "req2": 20}
    assert so.total_num_scheduled_tokens == 60
    for data in so.scheduled_new_reqs:
        assert len(data.block_ids) == 2
        assert data.num_computed_tokens == 0 and data.output_token_ids == []
        assert data.block_ids == scheduler.kv_cache_manager.get_block_ids(data.req_id)
    assert all(r.status == RequestStatus.RUNNING for r in requests)
    assert all(r.num_computed_tokens == 20 for r in requests)

    outputs = scheduler.update_from_output(so, make_runner_output(scheduler, so))
    assert [o.new_token_ids for o in outputs.outputs] == [[DEFAULT_TOKEN]] * 3
    so = scheduler.schedule()
    assert so.scheduled_new_reqs == []
    assert so.scheduled_cached_reqs.req_ids == ["req0", "req1", "req2"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [20, 20, 20]
    assert so.scheduled_cached_reqs.new_block_ids == [[], [], []]
    assert so.num_scheduled_tokens == {"req0": 1, "req1": 1, "req2": 1}


def test_token_budget_is_respected():
    scheduler = create_scheduler(max_num_batched_tokens=50)
    add_all(scheduler, create_requests(3, prompt_len=20))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"req0": 20, "req1": 20, "req2": 10}  # last one chunked
    assert so.total_num_scheduled_tokens == 50


def test_max_num_seqs_is_respected():
    scheduler = create_scheduler(max_num_seqs=2)
    requests = create_requests(3, prompt_len=10, max_tokens=3)
    add_all(scheduler, requests)
    so, _ = step(scheduler)
    assert set(so.num_scheduled_tokens) == {"req0", "req1"}
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler)
        assert len(so.num_scheduled_tokens) <= 2
    assert all(r.num_output_tokens == 3 for r in requests)


def test_chunked_prefill_splits_a_long_prompt():
    scheduler = create_scheduler(max_num_batched_tokens=32)
    (request,) = create_requests(1, prompt_len=100, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    for i in range(4):
        so, outputs = step(scheduler)
        chunks.append(so.num_scheduled_tokens["req0"])
        if i == 0:
            assert len(so.scheduled_new_reqs) == 1
            assert len(so.scheduled_new_reqs[0].block_ids) == 2
        else:
            assert so.scheduled_cached_reqs.req_ids == ["req0"]
        # Only the last chunk reaches the end of the prompt and samples.
        assert bool(outputs.outputs) == (i == 3)
    assert chunks == [32, 32, 32, 4]
    assert len(scheduler.kv_cache_manager.get_block_ids("req0")) == 7


def test_chunked_prefill_disabled_makes_a_prompt_wait_for_a_whole_step():
    scheduler = create_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    add_all(scheduler, create_requests(2, prompt_len=40, max_tokens=4))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 40}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 1, "req1": 40}


def test_long_prefill_token_threshold_caps_each_chunk():
    scheduler = create_scheduler(long_prefill_token_threshold=16)
    add_all(scheduler, create_requests(2, prompt_len=40, max_tokens=2))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 16, "req1": 16}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 16, "req1": 16}
    so, outputs = step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 8, "req1": 8}
    assert len(outputs.outputs) == 2


def test_decode_and_prefill_mixed_in_one_step():
    scheduler = create_scheduler()
    scheduler.add_request(create_requests(1, prompt_len=10, prefix="a")[0])
    step(scheduler)
    scheduler.add_request(create_requests(1, prompt_len=30, prefix="b")[0])
    so, outputs = step(scheduler)
    assert so.num_scheduled_tokens == {"a0": 1, "b0": 30}
    assert so.scheduled_cached_reqs.req_ids == ["a0"]
    assert [d.req_id for d in so.scheduled_new_reqs] == ["b0"]
    assert set(by_id(outputs)) == {"a0", "b0"}


# ---- preemption ---------------------------------------------------------------------------


def _fill_cache(policy, priorities=None, num_blocks=4):
    """Two 30-token prompts fill 4 blocks of 16; the first decode crossing 32 tokens needs a
    fifth block."""
    scheduler = create_scheduler(
        num_blocks=num_blocks, max_model_len=64, policy=policy, enable_prefix_caching=False
    )
    requests = create_requests(2, prompt_len=30, max_tokens=20, priorities=priorities)
    add_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize(
    "policy, priorities, victim, survivor",
    [
        ("fcfs", None, "req1", "req0"),  # the latest arrival goes
        ("priority", [1, 0], "req0", "req1"),  # the lowest priority goes, though it came first
    ],
)
def test_preemption_victim_and_resumption(policy, priorities, victim, survivor):
    scheduler, requests = _fill_cache(policy, priorities)
    victim_req = next(r for r in requests if r.request_id == victim)
    preempted_at = None
    for i in range(10):
        so, outputs = step(scheduler)
        if so.preempted_req_ids:
            preempted_at = i
            break
    assert preempted_at is not None
    assert so.preempted_req_ids == {victim}
    assert set(so.num_scheduled_tokens) == {survivor}
    assert victim_req.status == RequestStatus.PREEMPTED
    assert victim_req.num_computed_tokens == 0
    assert victim_req.num_preemptions == 1
    assert scheduler.waiting.peek_request() is victim_req
    assert victim_req.request_id not in scheduler.kv_cache_manager.req_to_blocks
    assert outputs.scheduler_stats.num_preemptions == 1
    assert scheduler.make_stats().num_preemptions == 0
    assert scheduler.num_preemptions_total == 1
    num_outputs_before = victim_req.num_output_tokens
    assert num_outputs_before > 0

    # Nothing is admitted while the survivor still needs the blocks; then the victim resumes
    # with its output tokens so far and completes.
    resumed = None
    results = {}
    while scheduler.has_unfinished_requests():
        so, outputs = step(scheduler)
        for data in so.scheduled_new_reqs:
            if data.req_id == victim:
                resumed = data
        for out in outputs.outputs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                results[out.request_id + ".reason"] = out.finish_reason
    assert resumed is not None
    assert len(resumed.output_token_ids) == num_outputs_before
    assert resumed.num_computed_tokens == 0
    assert len(results[victim]) == 20 - num_outputs_before
    assert results[victim + ".reason"] == FinishReason.LENGTH
    assert victim_req.num_output_tokens == 20
    assert scheduler.kv_cache_manager.usage == 0.0


def test_preemption_event_is_reported():
    scheduler, requests = _fill_cache("fcfs")
    events = []
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler)
        for out in outputs.outputs:
            if out.request_id == "req1" and out.events:
                events.extend(t for t, _ in out.events)
    assert events.count(EngineCoreEventType.QUEUED) == 1
    assert events.count(EngineCoreEventType.PREEMPTED) == 1
    assert events.count(EngineCoreEventType.SCHEDULED) == 2


def test_waiting_request_of_higher_priority_preempts_a_running_one():
    scheduler = create_scheduler(
        num_blocks=4, max_model_len=64, policy="priority", enable_prefix_caching=False
    )
    (low,) = create_requests(1, prompt_len=60, max_tokens=4, priorities=[5], prefix="low")
    scheduler.add_request(low)
    step(scheduler)  # low holds all 4 blocks
    (high,) = create_requests(
        1, prompt_len=20, max_tokens=2, priorities=[0], prefix="high", first_arrival=10.0
    )
    scheduler.add_request(high)
    so, _ = step(scheduler)
    assert so.preempted_req_ids == {"low0"}
    # low0 was scheduled for its decode first; that was undone.
    assert so.num_scheduled_tokens == {"high0": 20}
    assert so.scheduled_cached_reqs.num_reqs == 0
    assert low.status == RequestStatus.PREEMPTED
    results = run_to_completion(scheduler)
    assert len(results["high0"][0]) == 1  # its first token came in the preempting step
    assert low.num_output_tokens == 4


def test_lower_priority_waiting_request_does_not_preempt():
    scheduler = create_scheduler(
        num_blocks=4, max_model_len=64, policy="priority", enable_prefix_caching=False
    )
    (high,) = create_requests(1, prompt_len=60, max_tokens=3, priorities=[0], prefix="high")
    scheduler.add_request(high)
    step(scheduler)
    (low,) = create_requests(1, prompt_len=20, priorities=[5], prefix="low", first_arrival=1.0)
    scheduler.add_request(low)
    so, _ = step(scheduler)
    assert not so.preempted_req_ids
    assert so.num_scheduled_tokens == {"high0": 1}
    assert low.status == RequestStatus.WAITING


def test_priority_admission_order():
    scheduler = create_scheduler(max_num_seqs=1, policy="priority")
    add_all(scheduler, create_requests(3, prompt_len=8, max_tokens=1, priorities=[2, 0, 1]))
    order = []
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler)
        order.extend(d.req_id for d in so.scheduled_new_reqs)
    assert order == ["req1", "req2", "req0"]


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    scheduler = create_scheduler(num_blocks=4, max_model_len=64, enable_prefix_caching=False)
    add_all(scheduler, create_requests(1, prompt_len=40, max_tokens=8, prefix="a"))
    step(scheduler)  # a0: 3 blocks
    add_all(scheduler, create_requests(1, prompt_len=40, prefix="big", first_arrival=1.0))
    add_all(scheduler, create_requests(1, prompt_len=4, prefix="small", first_arrival=2.0))
    so, _ = step(scheduler)
    assert set(so.num_scheduled_tokens) == {"a0"}  # small0 does not overtake big0


# ---- stop conditions ----------------------------------------------------------------------


def _one_step_finish(tokens, **params):
    scheduler = create_scheduler()
    (request,) = create_requests(1, prompt_len=8, **params)
    scheduler.add_request(request)
    _, outputs = step(scheduler, {"req0": tokens})
    return scheduler, request, outputs.outputs[0]


def test_eos_stops_with_no_stop_reason():
    scheduler, request, out = _one_step_finish([EOS_TOKEN_ID])
    assert out.finish_reason == FinishReason.STOP and out.stop_reason is None
    assert out.new_token_ids == [EOS_TOKEN_ID]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0


def test_stop_token_ids_report_the_token():
    _, _, out = _one_step_finish([42], stop_token_ids=[42])
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == 42


def test_ignore_eos():
    scheduler = create_scheduler()
    add_all(scheduler, create_requests(1, prompt_len=8, max_tokens=3, ignore_eos=True))
    outs = [step(scheduler, {"req0": [EOS_TOKEN_ID]})[1].outputs[0] for _ in range(3)]
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]


def test_max_tokens():
    scheduler = create_scheduler()
    add_all(scheduler, create_requests(1, prompt_len=8, max_tokens=5))
    results = run_to_completion(scheduler)
    assert results["req0"] == [[DEFAULT_TOKEN] * 5, FinishReason.LENGTH]


def test_min_tokens_gates_eos_and_stop_tokens():
    scheduler = create_scheduler()
    add_all(scheduler, create_requests(1, prompt_len=8, min_tokens=3, stop_token_ids=[42]))
    reasons = []
    for token in (EOS_TOKEN_ID, 42, EOS_TOKEN_ID):
        reasons.append(step(scheduler, {"req0": [token]})[1].outputs[0].finish_reason)
    assert reasons == [None, None, FinishReason.STOP]


def test_max_model_len_caps_the_length():
    scheduler = create_scheduler(max_model_len=32)
    add_all(scheduler, create_requests(1, prompt_len=28, max_tokens=None))
    results = run_to_completion(scheduler)
    assert results["req0"] == [[DEFAULT_TOKEN] * 4, FinishReason.LENGTH]


def test_prompt_of_exactly_max_model_len_still_runs():
    scheduler = create_scheduler(max_model_len=32, max_num_batched_tokens=16)
    add_all(scheduler, create_requests(1, prompt_len=32, max_tokens=10))
    results = run_to_completion(scheduler)
    assert results["req0"] == [[DEFAULT_TOKEN], FinishReason.LENGTH]


def test_tokens_after_a_stop_are_discarded():
    scheduler = create_scheduler()
    (request,) = create_requests(1, prompt_len=8)
    scheduler.add_request(request)
    so = scheduler.schedule()
    runner_output = make_runner_output(scheduler, so, {"req0": [5, EOS_TOKEN_ID, 9]})
    runner_output.logprobs = [LogprobsLists([[5], [2], [9]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])]
    out = scheduler.update_from_output(so, runner_output).outputs[0]
    assert out.new_token_ids == [5, EOS_TOKEN_ID]
    assert out.new_logprobs == [([5], [-0.1], 1), ([2], [-0.2], 1)]
    assert request.output_token_ids == [5, EOS_TOKEN_ID]


# ---- abort, finished ids, stats, logprobs --------------------------------------------------


def test_abort_frees_blocks_and_tells_the_runner():
    scheduler = create_scheduler(max_num_seqs=2)
    add_all(scheduler, create_requests(3, prompt_len=20))
    step(scheduler)
    scheduler.finish_requests(["req0", "req2", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert scheduler.get_num_unfinished_requests() == 1
    assert scheduler.has_finished_requests()
    assert "req0" not in scheduler.kv_cache_manager.req_to_blocks
    so, _ = step(scheduler)
    assert so.finished_req_ids == {"req0", "req2"}
    assert not scheduler.has_finished_requests()
    scheduler.finish_requests("req1", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
    with pytest.raises(ValueError):
        scheduler.finish_requests("req1", RequestStatus.RUNNING)


def test_finished_ids_are_passed_to_the_runner_next_step():
    scheduler = create_scheduler()
    add_all(scheduler, create_requests(2, prompt_len=8, max_tokens=1))
    so, outputs = step(scheduler)
    assert all(o.finished for o in outputs.outputs)
    assert so.finished_req_ids == set()
    assert scheduler.has_requests() and not scheduler.has_unfinished_requests()
    so = scheduler.schedule()
    assert so.finished_req_ids == {"req0", "req1"}
    assert so.is_empty
    assert not scheduler.has_requests()


def test_prefix_cache_hits_and_stats():
    scheduler = create_scheduler()
    (first,) = create_requests(1, prompt_len=64, same_prompt=True, prefix="a")
    scheduler.add_request(first)
    _, outputs = step(scheduler)
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (64, 0)
    assert outputs.outputs[0].num_cached_tokens == 0
    (second,) = create_requests(1, prompt_len=64, same_prompt=True, prefix="b")
    scheduler.add_request(second)
    so, outputs = step(scheduler)
    assert so.num_scheduled_tokens["b0"] == 16  # 48 of 64 tokens hit
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (64, 48)
    assert by_id(outputs)["b0"].num_cached_tokens == 48
    assert scheduler.make_stats().prefix_cache_queries == 0  # taken with the last stats


def test_stats():
    scheduler = create_scheduler(max_num_seqs=1, num_blocks=10, max_model_len=160)
    add_all(scheduler, create_requests(2, prompt_len=32))
    _, outputs = step(scheduler)
    stats = outputs.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)
    assert stats.num_blocks_total == 10


def test_sample_logprobs_are_converted():
    scheduler = create_scheduler()
    add_all(scheduler, create_requests(1, prompt_len=8, logprobs=1))
    so = scheduler.schedule()
    runner_output = make_runner_output(scheduler, so, logprobs=True)
    out = scheduler.update_from_output(so, runner_output).outputs[0]
    assert out.new_logprobs == [([DEFAULT_TOKEN], [-1.0], 1)]


def _add_prompt_logprobs(scheduler, so, runner_output):
    """Fill `prompt_logprobs_dict` as a runner would: for a chunk over prompt positions
    [start, start + n), rows for prompt tokens start + 1 .. min(start + n, P - 1), each row's
    token id being the position it is for."""
    for req_id, n in so.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        if request.sampling_params.prompt_logprobs is None:
            continue
        start = request.num_computed_tokens - n
        end = min(start + n, request.num_prompt_tokens - 1)
        if end > start:
            positions = range(start + 1, end + 1)
            runner_output.prompt_logprobs_dict[req_id] = LogprobsLists(
                [[p] for p in positions], [[-float(p)] for p in positions], [1] * len(positions)
            )
    return runner_output


def _step_with_prompt_logprobs(scheduler):
    so = scheduler.schedule()
    runner_output = _add_prompt_logprobs(scheduler, so, make_runner_output(scheduler, so))
    return so, scheduler.update_from_output(so, runner_output)


def test_prompt_logprobs_accumulate_over_chunks_and_ride_on_the_first_output():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    add_all(scheduler, create_requests(1, prompt_len=20, prompt_logprobs=0))
    got = []
    for chunk in (8, 8, 4):
        so, outputs = _step_with_prompt_logprobs(scheduler)
        assert so.num_scheduled_tokens == {"req0": chunk}
        got.append(outputs.outputs)
    assert got[0] == [] and got[1] == []
    (out,) = got[2]
    assert out.new_prompt_logprobs[0] is None
    assert [e[0][0] for e in out.new_prompt_logprobs[1:]] == list(range(1, 20))
    # Later outputs carry none.
    _, outputs = _step_with_prompt_logprobs(scheduler)
    assert outputs.outputs[0].new_prompt_logprobs is None


def test_prompt_logprobs_are_not_duplicated_by_a_recomputation():
    scheduler = create_scheduler(
        num_blocks=4, max_model_len=64, max_num_batched_tokens=40, enable_prefix_caching=False
    )
    (plain,) = create_requests(1, prompt_len=30, max_tokens=3, prefix="plain")
    (wants,) = create_requests(1, prompt_len=34, prompt_logprobs=1, prefix="lp", first_arrival=1)
    add_all(scheduler, [plain, wants])
    so, _ = _step_with_prompt_logprobs(scheduler)
    assert so.num_scheduled_tokens == {"plain0": 30, "lp0": 10}
    so, _ = _step_with_prompt_logprobs(scheduler)
    assert so.preempted_req_ids == {"lp0"}  # preempted itself, mid-prefill
    outputs = []
    while scheduler.has_unfinished_requests():
        _, step_outputs = _step_with_prompt_logprobs(scheduler)
        outputs.extend(o for o in step_outputs.outputs if o.request_id == "lp0")
    assert wants.num_preemptions == 1
    prompt_logprobs = outputs[0].new_prompt_logprobs
    assert len(prompt_logprobs) == 34
    assert [e[0][0] for e in prompt_logprobs[1:]] == list(range(1, 34))
    assert all(o.new_prompt_logprobs is None for o in outputs[1:])


# ---- speculative decoding bookkeeping ------------------------------------------------------


def test_rejected_draft_tokens_roll_back_num_computed_tokens():
    scheduler = create_scheduler()
    (request,) = create_requests(1, prompt_len=8, max_tokens=20)
    scheduler.add_request(request)
    step(scheduler)  # prefill; 9 tokens, 8 computed
    request.spec_token_ids = [11, 12, 13]
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"req0": 4}
    assert so.scheduled_spec_decode_tokens == {"req0": [11, 12, 13]}
    runner_output = make_runner_output(scheduler, so, {"req0": [11, 50]})  # 1 draft accepted
    runner_output.spec_token_ids = [[60, 61]]
    out = scheduler.update_from_output(so, runner_output).outputs[0]
    assert out.new_token_ids == [11, 50]
    assert request.num_tokens == 11
    assert request.num_computed_tokens == 10  # 12 scheduled positions, 2 rejected
    assert request.spec_token_ids == [60, 61]
    scheduler.check_integrity()


# ---- several batches in flight (pipeline parallel), several ranks -------------------------


def test_in_flight_requests_are_neither_rescheduled_nor_preempted():
    """Two batches in flight, as the engine's batch queue keeps them: a request is in at
    most one, and the preemption victim is never one whose batch is still running (here r1,
    the latest arrival, is in flight when r0 needs a block, so r0 yields its own)."""
    scheduler = create_scheduler(num_blocks=4, max_model_len=64, enable_prefix_caching=False)
    r0, r1 = create_requests(2, prompt_len=30, max_tokens=20)
    scheduler.add_request(r0)
    queue = deque([scheduler.schedule()])
    scheduler.add_request(r1)
    tokens: dict[str, list[int]] = {"req0": [], "req1": []}
    preempted: list[str] = []
    while scheduler.has_unfinished_requests():
        if len(queue) < 2:
            so = scheduler.schedule()
            in_flight = set().union(*(q.num_scheduled_tokens for q in queue))
            assert not in_flight & set(so.num_scheduled_tokens)
            assert not in_flight & so.preempted_req_ids
            preempted += so.preempted_req_ids
            queue.append(so)
        so = queue.popleft()
        outputs = scheduler.update_from_output(so, make_runner_output(scheduler, so))
        for out in outputs.outputs:
            tokens[out.request_id] += out.new_token_ids
    assert preempted == ["req0"]
    assert tokens == {"req0": [DEFAULT_TOKEN] * 20, "req1": [DEFAULT_TOKEN] * 20}


@pytest.mark.parametrize("tp", [1, 2])
def test_other_ranks_learn_the_sampled_tokens(tp):
    """With several ranks, each step tells the runners the tokens sampled since a request
    was last scheduled, at their positions; one rank samples them itself."""
    scheduler = create_scheduler(parallel_config=ParallelConfig(tensor_parallel_size=tp))
    add_all(scheduler, create_requests(2, prompt_len=16, max_tokens=5))
    step(scheduler, {"req0": [11], "req1": [12]})
    so, _ = step(scheduler, {"req0": [13, 15], "req1": [14]})  # req0: a draft accepted
    cached = so.scheduled_cached_reqs
    if tp == 1:
        assert cached.new_token_ids == [[], []] and cached.new_token_start == [0, 0]
        return
    assert cached.new_token_ids == [[11], [12]] and cached.new_token_start == [16, 16]
    so, _ = step(scheduler)
    cached = so.scheduled_cached_reqs
    assert cached.new_token_ids == [[13, 15], [14]] and cached.new_token_start == [17, 17]
