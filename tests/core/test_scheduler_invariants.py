"""Randomized runs of the scheduler against a fake runner that keeps its own block tables and a
fake KV cache (token ids in slots), checking the scheduler/runner protocol and that prefix hits
really point at the right KV."""

import random

import pytest

from pagedllm.core.request import RequestStatus
from pagedllm.outputs import ModelRunnerOutput
from tests.core.utils import EOS_TOKEN_ID, create_requests, create_scheduler


class FakeRunner:
    """Mirrors what a model runner keeps across steps: per-request tokens, block table and
    progress, all updated only from SchedulerOutputs; writes each computed token's id into a
    fake KV slot and checks every position it attends to holds the right token."""

    def __init__(self, block_size: int, rng: random.Random) -> None:
        self.block_size = block_size
        self.rng = rng
        self.states: dict[str, dict] = {}
        self.kv: dict[int, int] = {}  # slot -> token id

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, so) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = dict(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                blocks=list(new.block_ids),
                computed=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            assert state["computed"] == cached.num_computed_tokens[i]
            state["blocks"].extend(cached.new_block_ids[i])
        req_ids = list(so.num_scheduled_tokens)
        # All writes of the step first (as a layer writes its KV before attending), then reads.
        for req_id in req_ids:
            state, n = self.states[req_id], so.num_scheduled_tokens[req_id]
            start = state["computed"]
            assert start + n <= len(state["tokens"])
            assert len(state["blocks"]) * self.block_size >= start + n
            for pos in range(start, start + n):
                self.kv[self.slot(state["blocks"], pos)] = state["tokens"][pos]
        sampled = []
        for req_id in req_ids:
            state, n = self.states[req_id], so.num_scheduled_tokens[req_id]
            end = state["computed"] + n
            seen = [self.kv.get(self.slot(state["blocks"], p)) for p in range(end)]
            assert seen == state["tokens"][:end], f"{req_id} attends to wrong KV"
            state["computed"] = end
            if end == len(state["tokens"]):
                token = EOS_TOKEN_ID if self.rng.random() < 0.02 else self.rng.randrange(3, 50)
                state["tokens"].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


@pytest.mark.parametrize(
    "policy, chunked, caching, seed",
    [
        ("fcfs", True, True, 0),
        ("fcfs", False, True, 1),
        ("priority", True, True, 2),
        ("priority", True, False, 3),
    ],
)
def test_random_workload_keeps_every_invariant(policy, chunked, caching, seed):
    rng = random.Random(seed)
    block_size, max_model_len, budget, max_seqs = 4, 48, 48, 6
    scheduler = create_scheduler(
        block_size=block_size,
        num_blocks=16,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        policy=policy,
    )
    runner = FakeRunner(block_size, rng)
    shared_prefixes = [[rng.randrange(3, 50) for _ in range(12)] for _ in range(3)]
    all_requests, finished = {}, {}
    num_preemptions = 0
    for step_index in range(400):
        if step_index < 250 and rng.random() < 0.4:
            (request,) = create_requests(
                1,
                prompt_len=1,
                max_tokens=rng.randrange(1, 12),
                priorities=[rng.randrange(3)],
                prefix=f"s{step_index}-",
                first_arrival=float(step_index),
            )
            prompt = rng.choice(shared_prefixes)[: rng.randrange(1, 13)]
            prompt += [rng.randrange(3, 50) for _ in range(rng.randrange(0, 20))]
            request.prompt_token_ids = prompt
            request.num_prompt_tokens = len(prompt)
            request._all_token_ids = list(prompt)
            scheduler.add_request(request)
            all_requests[request.request_id] = request
        if rng.random() < 0.03 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            finished[victim] = "abort"

        so = scheduler.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert len(scheduler.running) <= max_seqs
        assert not (so.preempted_req_ids & set(so.num_scheduled_tokens))
        num_preemptions += len(so.preempted_req_ids)
        outputs = scheduler.update_from_output(so, runner.execute(so))
        scheduler.check_integrity()
        for out in outputs.outputs:
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if step_index > 250 and not scheduler.has_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert set(finished) == set(all_requests)
    assert scheduler.kv_cache_manager.usage == 0.0
    for req_id, request in all_requests.items():
        if finished[req_id] != "abort":
            stopped = request.output_token_ids[-1] == EOS_TOKEN_ID
            assert stopped or request.num_output_tokens == request.max_tokens
    assert num_preemptions > 0  # the pool is small enough to force some
