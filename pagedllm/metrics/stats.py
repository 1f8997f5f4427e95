"""Per-iteration statistics gathered in the front end, consumed by the stat loggers.

`SchedulerStats` (engine side: queue lengths, KV usage, prefix-cache and preemption counts)
arrives with each `EngineCoreOutputs`; `IterationStats` (front-end side: token counts,
latencies, finished requests) is filled by the OutputProcessor while it turns core outputs
into RequestOutputs, from each request's `RequestStateStats`.

Two clocks, as in vLLM: time to first token, inter-token latency and end-to-end latency are
measured on the front end's wall clock from the request's arrival; the phases of a request
(queued, prefill, decode, inference) from the engine core's monotonic timestamps (its
QUEUED / SCHEDULED events and the step that produced the first and the last token), so they
do not include the trip to the front end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.engine import EngineCoreEventType


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds, arrival -> last token
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    num_cached_tokens: int = 0
    queued_time: float = 0.0  # queued -> first scheduled
    prefill_time: float = 0.0  # first scheduled -> first token
    decode_time: float = 0.0  # first token -> last token
    inference_time: float = 0.0  # first scheduled -> last token
    mean_time_per_output_token: float = 0.0  # decode_time / (tokens - 1)
    max_tokens_param: int | None = None


@dataclass
class IterationStats:
    """What one batch of core outputs contributed."""

    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Per user request (once for all n samples): its n, and the most tokens one sample made.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)


@dataclass
class RequestStateStats:
    """One request's timestamps (see the module docstring for the two clocks)."""

    arrival_time: float  # wall clock
    first_token_time: float | None = None  # wall clock
    last_token_time: float | None = None  # wall clock
    queued_ts: float = 0.0  # engine core, monotonic
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0

    def observe_events(self, events: Iterable[tuple[int, float]] | None) -> None:
        for kind, ts in events or ():
            if kind == EngineCoreEventType.QUEUED:
                self.queued_ts = ts
            elif kind == EngineCoreEventType.SCHEDULED and self.scheduled_ts == 0.0:
                self.scheduled_ts = ts  # the first time only (a preempted request comes back)

    def observe_tokens(
        self,
        num_tokens: int,
        num_prompt_tokens: int,
        now: float,
        engine_ts: float,
        it: IterationStats | None,
    ) -> None:
        """`num_tokens` new output tokens arrived at `now` (wall) from the core step at
        `engine_ts` (monotonic)."""
        if num_tokens == 0:
            return
        if self.first_token_time is None:
            self.first_token_time, self.first_token_ts = now, engine_ts
            if it is not None:
                it.num_prompt_tokens += num_prompt_tokens
                it.time_to_first_tokens.append(now - self.arrival_time)
        elif it is not None and self.last_token_time is not None:
            it.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time, self.last_token_ts = now, engine_ts
        self.num_generation_tokens += num_tokens
        if it is not None:
            it.num_generation_tokens += num_tokens

    def finished(
        self,
        reason: str,
        now: float,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        max_tokens_param: int | None,
    ) -> FinishedRequestStats:
        ttft = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
        scheduled = self.scheduled_ts
        first, last = self.first_token_ts, self.last_token_ts
        decode = max(last - first, 0.0) if first else 0.0
        num_tokens = self.num_generation_tokens
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - self.arrival_time,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_tokens,
            time_to_first_token=ttft,
            num_cached_tokens=num_cached_tokens,
            queued_time=max(scheduled - self.queued_ts, 0.0) if scheduled else 0.0,
            prefill_time=max(first - scheduled, 0.0) if scheduled and first else 0.0,
            decode_time=decode,
            inference_time=max(last - scheduled, 0.0) if scheduled and last else 0.0,
            mean_time_per_output_token=decode / (num_tokens - 1) if num_tokens > 1 else 0.0,
            max_tokens_param=max_tokens_param,
        )
