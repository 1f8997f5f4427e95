"""Messages that cross the front-end / EngineCore boundary (msgspec structs, msgpack on the wire)."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI API's word."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_id: int | None = None
    # Read by the front end only: with data parallelism, the engine to send this request to
    # (None: the load balancer picks one); the API server's X-data-parallel-rank header.
    data_parallel_rank: int | None = None
    # Read by the front end only: OpenAI's prompt_cache_key, which keeps requests that share
    # it on one data-parallel engine (engine/load_balancer.py).
    prompt_cache_key: str | None = None
    # Set for a beam-search request: the core runs the whole search and answers once, with
    # EngineCoreOutput.beam_sequences (`sampling_params` then only guides detokenization).
    beam_search: BeamSearchParams | None = None
    # Prefix-cache namespace: only requests with the same salt share cached blocks.
    cache_salt: str | None = None


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class BeamSequenceOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """One finished beam of a beam-search request: its output tokens, per token the logprob
    entry (chosen token first, then the candidates scored at that step), the cumulative
    logprob the ranking used, and why it ended."""

    token_ids: list[int]
    logprobs: list[tuple[list[int], list[float], int]]
    cum_logprob: float
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    # Per new token: (token ids, logprobs, rank of the sampled token); the first entry of each
    # list is the sampled token, the rest the top-`logprobs` alternatives.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # Per prompt position (first has none): same layout as new_logprobs.
    new_prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # (event type, monotonic timestamp) pairs for the metrics: queued, first scheduled, ...
    events: list[tuple[int, float]] | None = None
    # A finished beam-search request's best sequences, best first (new_token_ids is empty).
    beam_sequences: list[BeamSequenceOutput] | None = None
    # Set on a finished request by the KV connector (e.g. where its KV can be pulled from).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up since the last stats
    prefix_cache_hits: int = 0  # tokens found since the last stats
    num_preemptions: int = 0  # since the last stats
    num_blocks_total: int = 0
    spec_decode: dict[str, Any] | None = None


class RequestProgress(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    """One request in an `EngineSnapshot`: where it stands in the engine core."""

    request_id: str
    status: str  # RequestStatus name: WAITING, RUNNING, PREEMPTED, WAITING_FOR_FSM, ...
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    arrival_time: float  # front end's wall clock
    num_preemptions: int


class EngineSnapshot(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """What only the engine core knows, for the dashboard (engine/snapshot.py builds it, at
    most about once a second and only for front ends that asked for it).

    `block_states`: one byte per KV block (or per group of `blocks_per_cell` blocks for a big
    cache, the busiest state of the group): 0 free, 1 in use, 2 cached and evictable (free,
    but still holding a prefix a later request can hit). `step_times`: mean seconds per step
    since the last snapshot for scheduling, model, sampling and output processing, over
    `num_steps` steps."""

    timestamp: float  # wall clock
    num_blocks: int
    block_states: bytes
    blocks_per_cell: int = 1
    running: list[RequestProgress] = []
    waiting: list[RequestProgress] = []
    num_running: int = 0  # the lists above are cut to a few dozen entries each
    num_waiting: int = 0
    num_preemptions_total: int = 0
    num_steps: int = 0
    step_times: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)


class EngineHealth(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """The engine's heartbeat (engine/stall.py): sent to every front end about once a second
    while `--stall-timeout-s` is on. `stalled_for_s` > 0: requests are waiting or running and
    no step has finished for that long (beyond the timeout); `reason` then says what is in
    flight."""

    stalled_for_s: float = 0.0
    reason: str = ""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    # The core's time.monotonic() when the step that made these outputs finished (metrics).
    timestamp: float = 0.0
    # Reply to a utility call: (call id, result or None, error message or None).
    utility_output: tuple[int, Any, str | None] | None = None
    # The engine (data-parallel rank) these outputs come from.
    engine_index: int = 0
    # Set by the front end's client only: requests that failed because their engine died,
    # request id -> error text (an empty dict still says an engine died).
    errored_requests: dict[str, str] | None = None
    # For the dashboard, only to front ends that asked (see EngineSnapshot).
    snapshot: EngineSnapshot | None = None
    # The engine's heartbeat (see EngineHealth); read by the client's reader thread.
    health: EngineHealth | None = None


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every message to an EngineCoreProc."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"
    # Internal to the engine process (never on the wire): a worker of the executor died.
    EXECUTOR_FAILED = b"\x05"
    # From the DP coordinator: the engines start a new wave of steps (see engine/coordinator.py).
    START_DP_WAVE = b"\x06"
