"""Beam search in the scheduler (core/sched/beam.py), against a plain reference search, with a
shadow runner whose "KV cache" holds token ids: every step it runs the block copies, writes
each scheduled token into its slot, and checks that every scheduled request reads its own
tokens back through its block table. So forks, copy-on-write, preemption, chunked prefill and
prefix caching are checked for never serving one beam another beam's KV."""

from __future__ import annotations

import random

import pytest

from pagedllm.beam_search import get_beam_search_score
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.engine import FinishReason
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from tests.core.utils import DEFAULT_TOKEN, EOS_TOKEN_ID, create_requests, create_scheduler

VOCAB = 40


def scorer(tokens: list[int], num: int) -> tuple[list[int], list[float], list[int]]:
    """A fake model: the top `num` next tokens of a sequence and their logprobs, a fixed
    function of its last three tokens (distinct values, so no ties)."""
    rng = random.Random(hash(tuple(tokens[-3:])) & 0xFFFFFFFF)
    ids = rng.sample(range(VOCAB), num)
    logprobs = sorted((-rng.random() * 4 - 0.01 * i for i in range(num)), reverse=True)
    return ids, logprobs, list(range(1, num + 1))


def reference(prompt: list[int], params: BeamSearchParams, eos: int, max_model_len: int):
    """vLLM's beam search written out plainly: [(output tokens, cum logprob, reason)]."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    for _ in range(params.max_tokens):
        candidates = []
        for out, cum in beams:
            for t, lp, _ in zip(*scorer(prompt + out, params.num_candidates)):
                if t == eos and not params.ignore_eos:
                    done.append(
                        (out + [t] if params.include_stop_str_in_output else out, cum + lp, "stop")
                    )
                else:
                    candidates.append((out + [t], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[: params.beam_width]
        if len(prompt) + len(beams[0][0]) >= max_model_len:
            break
    done += [(out, cum, "length") for out, cum in beams]

    def score(h):
        return get_beam_search_score(prompt + h[0], h[1], eos, params.length_penalty)

    return sorted(done, key=score, reverse=True)[: params.beam_width]


class ShadowRunner:
    """Runs SchedulerOutputs on a KV cache of token ids (see the module docstring)."""

    def __init__(self, scheduler, block_size: int) -> None:
        self.scheduler = scheduler
        self.bs = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_candidates: dict[str, int] = {}
        self.num_copies = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.tables.pop(rid, None)
        start: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            self.num_candidates[new.req_id] = new.num_beam_candidates
            start[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self.tables[rid].extend(cached.new_block_ids[i])
            start[rid] = cached.num_computed_tokens[i]
            new_tokens = cached.new_token_ids[i]
            self.tokens[rid][start[rid] : start[rid] + len(new_tokens)] = new_tokens
        before = dict(self.slots)
        for copy in so.blocks_to_copy:
            self.num_copies += 1
            for offset in range(self.bs):
                if (copy.src_block_id, offset) in before:
                    self.slots[(copy.dst_block_id, offset)] = before[(copy.src_block_id, offset)]
            if copy.req_id in self.tables:
                self.tables[copy.req_id][copy.block_index] = copy.dst_block_id
        for rid, n in so.num_scheduled_tokens.items():
            for pos in range(start[rid], start[rid] + n):
                self.slots[self._slot(rid, pos)] = self.tokens[rid][pos]
        req_ids = list(so.num_scheduled_tokens)
        sampled, candidates = [], {}
        for rid in req_ids:
            end = start[rid] + so.num_scheduled_tokens[rid]
            for pos in range(end):  # the context this step attends over
                assert self.slots.get(self._slot(rid, pos)) == self.tokens[rid][pos], (rid, pos)
            toks: list[int] = []
            if end >= len(self.tokens[rid]):
                if self.num_candidates[rid]:
                    candidates[rid] = scorer(self.tokens[rid], self.num_candidates[rid])
                else:
                    toks = [DEFAULT_TOKEN]
                    self.tokens[rid].append(DEFAULT_TOKEN)
            sampled.append(toks)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            beam_candidates=candidates,
        )

    def _slot(self, rid: str, pos: int) -> tuple[int, int]:
        return (self.tables[rid][pos // self.bs], pos % self.bs)


def beam_request(rid: str, prompt: list[int], params: BeamSearchParams, **kw) -> Request:
    sp = SamplingParams(max_tokens=params.max_tokens)
    sp.update_from_generation_config({}, [EOS_TOKEN_ID])
    return Request(rid, prompt, sp, eos_token_id=EOS_TOKEN_ID, beam_search=params, **kw)


def run(scheduler, runner: ShadowRunner, max_steps: int = 2000):
    """Step to completion; returns request id -> EngineCoreOutput (its last one) and the
    most KV blocks in use at once."""
    outputs, peak = {}, 0
    pool = scheduler.kv_cache_manager.block_pool
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs, peak
        so = scheduler.schedule()
        peak = max(peak, pool.num_blocks - pool.get_num_free_blocks())
        engine_outputs = scheduler.update_from_output(so, runner.execute(so))
        scheduler.check_integrity()
        for out in engine_outputs.outputs:
            outputs[out.request_id] = out
    raise AssertionError("unfinished")


def as_tuples(out):
    return [
        (b.token_ids, round(b.cum_logprob, 9), str(b.finish_reason)) for b in out.beam_sequences
    ]


def ref_tuples(prompt, params, max_model_len=1024):
    return [
        (o, round(c, 9), r) for o, c, r in reference(prompt, params, EOS_TOKEN_ID, max_model_len)
    ]


PROMPTS = [list(range(3, 3 + 21)), list(range(5, 5 + 16)), [9, 8, 7]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 8},  # chunked prefill, beams split over steps
        {"num_blocks": 26},  # preemption of whole groups
        {"num_blocks": 26, "policy": "priority"},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
    ],
)
def test_matches_reference_under_scheduling_pressure(kwargs):
    params = [
        BeamSearchParams(beam_width=3, max_tokens=9),
        BeamSearchParams(beam_width=2, max_tokens=12, length_penalty=0.5),
        BeamSearchParams(beam_width=4, max_tokens=7, ignore_eos=True),
    ]
    scheduler = create_scheduler(block_size=4, max_model_len=64, **kwargs)
    runner = ShadowRunner(scheduler, 4)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        scheduler.add_request(beam_request(f"b{i}", prompt, p, arrival_time=i))
    # An ordinary request runs beside the groups.
    scheduler.add_request(create_requests(1, prompt_len=10, max_tokens=20)[0])
    outputs, _ = run(scheduler, runner)
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        assert as_tuples(outputs[f"b{i}"]) == ref_tuples(prompt, p), i
    assert outputs["req0"].finish_reason == FinishReason.LENGTH
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0
    if kwargs.get("num_blocks"):
        assert scheduler.num_preemptions_total > 0
    assert runner.num_copies > 0


def test_eos_and_include_stop_str():
    """EOS candidates become finished hypotheses (reason stop); with
    include_stop_str_in_output the EOS stays in the tokens."""
    prompt = next(p for p in ([i, i + 1] for i in range(3, 400)) if _eos_soon(p))
    for include in (False, True):
        p = BeamSearchParams(beam_width=3, max_tokens=6, include_stop_str_in_output=include)
        scheduler = create_scheduler(block_size=4)
        scheduler.add_request(beam_request("b", prompt, p))
        outputs, _ = run(scheduler, ShadowRunner(scheduler, 4))
        got = as_tuples(outputs["b"])
        assert got == ref_tuples(prompt, p)
        stopped = [t for t, _, r in got if r == "stop"]
        assert stopped and all((t[-1] == EOS_TOKEN_ID) == include for t in stopped)
        assert outputs["b"].beam_sequences[0].finish_reason in (
            FinishReason.STOP,
            FinishReason.LENGTH,
        )


def _eos_soon(prompt: list[int]) -> bool:
    """Whether EOS is among the top candidates of the best sequences at step 2 and makes the
    final ranking: a prompt that exercises EOS handling."""
    done = reference(prompt, BeamSearchParams(beam_width=3, max_tokens=6), EOS_TOKEN_ID, 1024)
    return any(r == "stop" for _, _, r in done)


def test_beams_share_blocks():
    """Forked beams share the prompt's (and their common output's) full blocks: the group's
    peak usage stays far below beam_width separate copies."""
    prompt = list(range(3, 3 + 40))  # 10 full blocks of 4
    p = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    scheduler = create_scheduler(block_size=4)
    scheduler.add_request(beam_request("b", prompt, p))
    _, peak = run(scheduler, ShadowRunner(scheduler, 4))
    separate = 4 * -(-(40 + 8) // 4)
    assert peak <= 10 + 4 * 3 < separate


def test_abort_frees_every_beam():
    p = BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True)
    scheduler = create_scheduler(block_size=4)
    runner = ShadowRunner(scheduler, 4)
    scheduler.add_request(beam_request("b", PROMPTS[0], p))
    for _ in range(5):
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
    assert len(scheduler.running) == 3
    # By the group's id, whether or not its first beam is still alive.
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0
    assert scheduler.beam_search.group("b") is None


def test_group_must_fit():
    scheduler = create_scheduler(block_size=4, num_blocks=20, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width=5 is more than max_num_seqs=4"):
        scheduler.add_request(
            beam_request("a", [1, 2], BeamSearchParams(beam_width=5, max_tokens=4))
        )
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(
            beam_request("b", [1, 2], BeamSearchParams(beam_width=4, max_tokens=40))
        )


def test_seats_reserved_for_a_groups_beams():
    """A group in its prefill runs one beam but holds beam_width seats, so admitting more
    requests never pushes its fork past max_num_seqs."""
    scheduler = create_scheduler(block_size=4, max_num_seqs=4)
    runner = ShadowRunner(scheduler, 4)
    scheduler.add_request(
        beam_request("b", PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=4))
    )
    for r in create_requests(3, prompt_len=4, max_tokens=4):
        scheduler.add_request(r)
    max_running = 0
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        max_running = max(max_running, len(scheduler.running))
        scheduler.update_from_output(so, runner.execute(so))
    assert max_running == 4
