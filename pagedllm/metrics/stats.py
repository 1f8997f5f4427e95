"""Per-iteration statistics gathered in the front end, consumed by the stat loggers.

`SchedulerStats` (engine side: queue lengths, KV usage, prefix-cache and preemption counts)
arrives with each `EngineCoreOutputs`; `IterationStats` (front-end side: token counts and
latencies) is filled by the OutputProcessor while it turns core outputs into RequestOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds, arrival -> last token
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None
    num_cached_tokens: int = 0


@dataclass
class IterationStats:
    """What one batch of core outputs contributed."""

    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
