"""What the Scheduler tells the model runner each step: plain, picklable data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: a new one, one resumed after preemption (the runner
    dropped its state then), or a beam forked from another. `output_token_ids` is non-empty
    only for the last two.

    `num_beam_candidates > 0` marks a beam of a beam search: when it reaches the end of its
    known tokens the runner does not sample; it returns its top `num_beam_candidates`
    tokens by log-softmax (plus, at temperature > 0, one token sampled at that temperature)
    in `ModelRunnerOutput.beam_candidates`, and the scheduler picks the continuation.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_beam_candidates: int = 0


@dataclass
class CachedRequestData:
    """Requests the runner already holds. Index i of every list describes req_ids[i]."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to the request's block table this step (may be empty).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Tokens the runner did not produce itself, to set at positions new_token_start[i] on: a
    # beam's continuation (its group chose it) and, with several ranks, the tokens sampled on
    # the driver since the request was last scheduled (vLLM's new_token_ids). [] for every
    # other request (the runner appends what it sampled itself); setting tokens a runner
    # already holds changes nothing.
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_token_start: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class KVBlockCopy:
    """Copy-on-write of a KV block shared by forked beams and only partly filled: before the
    forward pass the runner copies block `src_block_id` into `dst_block_id` (every layer),
    and from this step on request `req_id`'s block table holds `dst_block_id` at
    `block_index`."""

    req_id: str
    block_index: int
    src_block_id: int
    dst_block_id: int


@dataclass
class SchedulerOutput:
    """One step's work.

    `num_scheduled_tokens[req_id]` tokens of each scheduled request run through the model,
    starting at the request's `num_computed_tokens`. A request samples this step when those
    tokens reach the end of its known tokens (a partial prefill chunk does not sample).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Draft tokens to verify, per request (speculative decoding); they are part of
    # num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests the runner must forget: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Feature hooks (structured-output bitmasks, KV connector metadata) ride here. A
    # structured request that samples owns grammar_bitmask rows from
    # structured_output_request_ids[req_id], one per verified position (its drafts + 1).
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: object | None = None
    # Block copies to run before this step's forward pass, in order (beam search).
    blocks_to_copy: list[KVBlockCopy] = field(default_factory=list)
    # What the KV connector's worker side must load and save this step (None: no connector).
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
