"""A request as the engine core sees it: tokens, progress, status, and its KV block hashes."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagedllm.engine import EngineCoreEventType, EngineCoreRequest, FinishReason
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_utils import BlockHash


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # a KV connector is loading its KV asynchronously
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASON_MAP.get(status)


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class Request:
    """One sequence being generated.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `num_computed_tokens <= num_tokens_with_spec`; the tokens in [num_computed_tokens,
    num_tokens_with_spec) are what the scheduler still has to run through the model.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        beam_search: BeamSearchParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # Prefix-cache namespace: part of the first block's hash (see kv_cache_utils).
        self.cache_salt = cache_salt
        # Beam search: the scheduler turns the request into a BeamGroup (core/sched/beam.py).
        self.beam_search = beam_search
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prefix-cache hits found when the request was first scheduled (-1: not yet scheduled).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of the request's full blocks, extended as tokens arrive (see kv_cache_utils).
        self.block_hashes: list[BlockHash] = []
        self.events: list[tuple[int, float]] = []
        self.record_event(EngineCoreEventType.QUEUED)
        # What a KV connector should do with this request (vLLM's kv_transfer_params, from
        # SamplingParams.extra_args); a private copy: connectors update it as they go.
        params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.kv_transfer_params: dict | None = dict(params) if params else None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            beam_search=request.beam_search,
            cache_salt=request.cache_salt,
        )

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append((int(event_type), time.monotonic()))

    def take_events(self) -> list[tuple[int, float]] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower `priority` first, then earlier arrival, then id."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
