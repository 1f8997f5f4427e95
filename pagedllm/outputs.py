"""Outputs: `ModelRunnerOutput` (runner -> scheduler) and `RequestOutput` (engine -> user)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Logprobs as vLLM returns them: per position, {token_id: Logprob}.
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class LogprobsLists:
    """Per sampled token i of a request: `token_ids[i]` and `logprobs[i]` hold the sampled
    token first, then the top-k alternatives; `ranks[i]` is the sampled token's rank (1 = best)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


# A beam's candidates for its next token (beam search): token ids, their logprobs and ranks,
# best first.
BeamCandidates = tuple[list[int], list[float], list[int]]


@dataclass
class KVConnectorOutput:
    """What the worker side of a KV connector reports after a step (vLLM's shape).

    `finished_sending`: requests whose blocks the remote side has read (or that nobody read
    before the timeout): the scheduler may free them now. `finished_recving`: requests whose
    asynchronous load ended, successfully or not; a failed load's blocks are in
    `invalid_block_ids`, and the scheduler recomputes that request instead.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass
class ModelRunnerOutput:
    """One step's results, indexed like `req_ids` (the runner's batch order)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Tokens sampled per request: [] for a partial prefill chunk; 1 normally; up to k+1 with
    # speculative decoding (the accepted drafts plus one).
    sampled_token_ids: list[list[int]]
    # Per request (None when it did not ask for logprobs or sampled nothing).
    logprobs: list[LogprobsLists | None] | None = None
    # Prompt logprobs computed this step, per request id: (token ids, logprobs, ranks) per
    # prompt position covered by this step's chunk.
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
    # Draft tokens proposed for the next step (speculative decoding), per request.
    spec_token_ids: list[list[int]] | None = None
    # Beams of a beam search that reached the end of their tokens: their candidates for
    # the next token (see NewRequestData.num_beam_candidates).
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)
    # Transfers the KV connector finished (None without a connector).
    kv_connector_output: KVConnectorOutput | None = None
    # Seconds the runner spent sampling (and drafting) this step: the dashboard's step split.
    sampling_time_s: float = 0.0


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class CompletionOutput:
    """One of the `n` sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The result of one request (vLLM's fields)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # What a KV connector hands back for the next hop (e.g. where a prefill's KV can be
    # pulled from); None without a connector.
    kv_transfer_params: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens})"
        )
