"""Scheduler: decides, every step, which tokens of which requests run through the model.

There is no prefill phase and no decode phase. A request has `num_tokens_with_spec` known tokens
(prompt + outputs + draft tokens) of which `num_computed_tokens` have KV in the cache; each step
moves `num_computed_tokens` toward `num_tokens_with_spec`. A decode is a request one token
behind; a chunked prefill is one many tokens behind; a prefix-cache hit starts a request ahead.

Each step spends a budget of `max_num_batched_tokens`:
1. Running requests, in order (arrival order for fcfs, priority order for priority), each get
   min(tokens behind, budget, long_prefill_token_threshold) tokens and the blocks for them. If
   the pool is out of blocks, the last running request (latest arrival / lowest priority) is
   preempted by recomputation: its blocks are freed, its progress reset, and it goes back to
   the front of the waiting queue; repeat until the allocation fits or the request itself was
   the victim.
2. If nothing was preempted, waiting requests are admitted in queue order while the budget and
   `max_num_seqs` allow: prefix-cache lookup, then a first chunk (without chunked prefill,
   the whole rest of the prompt or nothing: it waits for a step with room). With the
   priority policy a waiting request may preempt running requests of lower priority to get
   blocks. The first request that cannot be admitted stops admission (no overtaking).
`schedule()` then advances every scheduled request's `num_computed_tokens` (the tokens will be
computed by the time anyone looks again); `update_from_output` appends sampled tokens, rolls
back rejected draft tokens, checks stop conditions, stores the next drafts (cut to what a
structured request's grammar accepts) and frees finished requests.

Beam search (`beam.py`): a beam-search request becomes a `BeamGroup` whose beams are ordinary
requests here, except that the runner returns their next-token candidates instead of a
sampled token and the group forks, extends and drops beams once all of them reported. A group
is admitted and preempted whole.

With pipeline parallelism the engine keeps several batches in flight: a request scheduled in
one is *in flight* until its output is folded back, and is neither scheduled again nor chosen
as a preemption victim meanwhile (its next tokens depend on that output, and its KV blocks are
still being written). With more than one rank, the runners other than the sampling one learn
each request's new output tokens from the `SchedulerOutput` (`new_token_ids`, as beams do).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedllm.core.kv_cache_utils import update_request_block_hashes
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.beam import BeamGroup, BeamSearchManager
from pagedllm.core.sched.kv_transfer import KVTransferTracker
from pagedllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.core.sched.request_queue import create_request_queue
from pagedllm.core.sched.utils import (
    LogprobsEntry,
    PromptLogprobsAccumulator,
    check_stop,
    logprobs_entries,
)
from pagedllm.engine import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from pagedllm.outputs import BeamCandidates, LogprobsLists, ModelRunnerOutput
from pagedllm.spec_decode.config import get_speculative_config
from pagedllm.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.structured_output.manager import StructuredOutputManager


@dataclass
class _StepState:
    """What one `schedule()` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    cached_reqs: list[Request] = field(default_factory=list)  # the runner already has them
    new_reqs: list[Request] = field(default_factory=list)  # admitted from waiting
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, blocks: KVCacheBlocks, is_new: bool) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_blocks[request.request_id] = blocks
        (self.new_reqs if is_new else self.cached_reqs).append(request)
        self.token_budget -= num_tokens

    def remove(self, request: Request) -> None:
        """Undo `add` for a request preempted after it was scheduled this step."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.new_blocks.pop(request.request_id, None)
        self.spec_tokens.pop(request.request_id, None)
        reqs = self.new_reqs if request in self.new_reqs else self.cached_reqs
        reqs.remove(request)


class Scheduler:
    """Continuous-batching scheduler over one KV cache (see the module docstring).

    Contract with the engine: `config.cache_config.num_blocks` is set before construction;
    each step is `schedule()` -> model runner -> `update_from_output()` with that same
    SchedulerOutput; `add_request` / `finish_requests` are called between steps only.
    Invariants between steps: every request in `self.requests` is unfinished and is either in
    `self.running` (holding KV blocks) or in `self.waiting` (holding none, except requests
    whose KV a connector is loading or has loaded: see core/sched/kv_transfer.py).
    """

    def __init__(
        self,
        config: EngineConfig,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        sched, cache = config.scheduler_config, config.cache_config
        if cache.num_blocks is None:
            raise ValueError(
                "cache_config.num_blocks is not set: the engine must size the KV cache before "
                "it builds the Scheduler"
            )
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_num_seqs = sched.max_num_seqs
        self.max_model_len = sched.max_model_len
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.policy = sched.policy
        self.block_size = cache.block_size
        self.enable_caching = cache.enable_prefix_caching
        # Block hashes key the prefix cache and the KV connectors' stores.
        self.hash_blocks = self.enable_caching or config.kv_transfer_config is not None
        self.kv_cache_manager = KVCacheManager(
            cache.num_blocks, self.block_size, self.max_model_len, self.enable_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        # fcfs: admission order; priority: sorted by Request.__lt__. Either way the last one is
        # the preemption victim.
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Extra slots to reserve per running request for draft tokens (speculative decoding),
        # and the acceptance counters reported in SchedulerStats.spec_decode.
        spec = get_speculative_config(config)
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_decoding_stats = SpecDecodingStats(spec.num_speculative_tokens) if spec else None
        self._num_preemptions = 0  # since the last make_stats()
        self.num_preemptions_total = 0  # since construction
        self._prompt_logprobs: dict[str, PromptLogprobsAccumulator] = {}
        # Grammars of structured-output requests (None: such requests are not constrained).
        self.structured_output_manager = structured_output_manager
        self.beam_search = BeamSearchManager(
            self.kv_cache_manager, self.max_model_len, self.max_num_seqs
        )
        # Running requests the runner holds no state for yet (beams forked or admitted with
        # their group but not scheduled so far): sent as new requests when next scheduled.
        self._unsent: set[str] = set()
        # A KV connector's loads and held blocks (None: KV never leaves this engine).
        self.kv_transfer: KVTransferTracker | None = None
        if config.kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer.base import KVConnectorRole
            from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

            connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
            self.kv_transfer = KVTransferTracker(connector, self.kv_cache_manager)
        # Requests in a batch whose output has not come back yet (see the module docstring).
        self._in_flight: set[str] = set()
        # Where each request's runner copy ends (tokens it was sent or produced), for requests
        # whose runners must be told new tokens: beams, and every request with several ranks.
        self._sync_all_tokens = config.parallel_config.world_size > 1
        self._runner_num_tokens: dict[str, int] = {}

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING, or WAITING_FOR_FSM while its grammar compiles)."""
        if request.request_id in self.requests or (
            self.kv_transfer is not None and request.request_id in self.kv_transfer.held
        ):
            raise ValueError(f"request_id={request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens is longer than "
                f"max_model_len={self.max_model_len}"
            )
        if request.beam_search is not None:
            self.beam_search.check(request)
        if self.hash_blocks:
            update_request_block_hashes(request, self.block_size)
        if request.sampling_params.prompt_logprobs is not None:
            self._prompt_logprobs[request.request_id] = PromptLogprobsAccumulator(
                request.num_prompt_tokens
            )
        self.requests[request.request_id] = request
        if request.beam_search is not None:
            self.beam_search.add(request)
        elif self.structured_output_manager is not None:
            self.structured_output_manager.add_request(request)  # -> WAITING_FOR_FSM
        self.waiting.add_request(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (abort): free their blocks, drop them from the queues.
        Unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status={finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        request_ids = self._expand_beam_groups(request_ids)
        from_running: set[str] = set()
        from_waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                from_running.add(req_id)
            else:
                from_waiting.append(request)
            request.status = finished_status
            self._free_request(request)
        if from_running:
            self.running = [r for r in self.running if r.request_id not in from_running]
        if from_waiting:
            self.waiting.remove_requests(from_waiting)

    def _expand_beam_groups(self, request_ids: Iterable[str]) -> list[str]:
        """Request ids with each beam-search group id replaced by its live beams' ids."""
        expanded: list[str] = []
        for req_id in request_ids:
            group = self.beam_search.group(req_id)
            if group is None:
                expanded.append(req_id)
                continue
            expanded.extend(b.request_id for b in group.beams)
            self.beam_search.remove(group)
        return expanded

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Drop a finished request and free its blocks (unless a KV transfer still needs
        them); returns what the KV connector hands back to the client, if anything."""
        self._unsent.discard(request.request_id)
        kv_transfer_params = None
        held = False
        if self.kv_transfer is not None:
            held, kv_transfer_params = self.kv_transfer.request_finished(request)
        if not held:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._prompt_logprobs.pop(request.request_id, None)
        self._runner_num_tokens.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        if self.structured_output_manager is not None:
            self.structured_output_manager.free_request(request.request_id)
        return kv_transfer_params

    # ---- schedule ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens (see the module docstring) and advance the scheduled
        requests' `num_computed_tokens` by them."""
        state = _StepState(token_budget=self.max_num_batched_tokens)
        self._schedule_running(state)
        if not state.preempted:
            self._schedule_waiting(state)
        output = self._make_output(state)
        if self.kv_transfer is not None:
            self.kv_transfer.build_meta(output)
        if self.structured_output_manager is not None:
            self.structured_output_manager.fill_bitmask(output, self.requests)
        for req_id, num_tokens in state.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self._in_flight.update(state.num_scheduled_tokens)
        self.finished_req_ids = set()
        return output

    def _cap_new_tokens(self, num_tokens: int, budget: int) -> int:
        if self.long_prefill_token_threshold > 0:
            num_tokens = min(num_tokens, self.long_prefill_token_threshold)
        return min(num_tokens, budget)

    def _schedule_running(self, state: _StepState) -> None:
        i = 0
        while i < len(self.running) and state.token_budget > 0:
            request = self.running[i]
            if request.request_id in self._in_flight:
                i += 1
                continue
            behind = request.num_tokens_with_spec - request.num_computed_tokens
            num_new = self._cap_new_tokens(behind, state.token_budget)
            # Draft tokens must not run past position max_model_len - 1 (known tokens never do).
            limit = max(self.max_model_len - 1, request.num_tokens) - request.num_computed_tokens
            num_new = min(num_new, limit)
            if num_new <= 0:
                i += 1
                continue
            num_running = len(self.running)
            blocks = self._allocate_or_preempt(request, num_new, state)
            if blocks is None:
                break  # the request preempted itself: nothing behind it fits either
            if len(self.running) < num_running - 1:
                # A preempted beam group may have had beams before this request.
                i = self.running.index(request)
            state.add(request, num_new, blocks, is_new=request.request_id in self._unsent)
            num_drafts = request.num_computed_tokens + num_new - request.num_tokens
            if num_drafts > 0:
                state.spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            i += 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, state: _StepState
    ) -> KVCacheBlocks | None:
        """Allocate for a running request, preempting from the back of `self.running` until it
        fits. The victims always sit after `request` in the list, so none of them was scheduled
        earlier in this step. None if `request` itself had to go."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if blocks is not None:
                return blocks
            victims = self._preempt_last(state, self._last_preemptable())
            if not victims or request in victims:
                return None

    def _last_preemptable(self) -> int | None:
        """Index in `self.running` of the next preemption victim: the last request that is
        not in flight, nor a beam whose group has a beam in flight (None if there is none)."""
        for i in range(len(self.running) - 1, -1, -1):
            request = self.running[i]
            group = self.beam_search.group_of(request)
            members = group.beams if group is not None else (request,)
            if not any(m.request_id in self._in_flight for m in members):
                return i
        return None

    def _schedule_waiting(self, state: _StepState) -> None:
        skipped: list[Request] = []
        while (
            self.waiting
            and state.token_budget > 0
            and len(self.running) + self.beam_search.num_reserved_seats() < self.max_num_seqs
        ):
            request = self.waiting.peek_request()
            # A request preempted this step (by a higher-priority admission) waits a step.
            if not self._is_ready(request) or request in state.preempted:
                skipped.append(self.waiting.pop_request())
                continue
            if not self._try_admit(request, state):
                break
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)  # its KV loads in the background; it keeps its place
        self.waiting.prepend_requests(skipped)

    def _is_ready(self, request: Request) -> bool:
        """Whether a waiting request may be admitted now. Structured outputs hook in here: a
        request stays WAITING_FOR_FSM (and is skipped, keeping its place) until its grammar is
        compiled, when the structured-output manager sets it back to WAITING. A request whose
        KV a connector loads asynchronously waits for the load to end."""
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert self.kv_transfer is not None
            return self.kv_transfer.finish_load(request)
        if request.status != RequestStatus.WAITING_FOR_FSM:
            return True
        som = self.structured_output_manager
        return som is not None and som.is_ready(request)

    def _try_admit(self, request: Request, state: _StepState) -> bool:
        """Admit the head of the waiting queue with its first chunk; False if it must wait.
        A beam brings its group's other waiting beams along (they hold their prefix-cache
        hits, and get tokens from the next step on). With a KV connector, the tokens it
        supplies count as computed; if it loads them asynchronously the request only gets its
        blocks and is parked (WAITING_FOR_REMOTE_KVS). A request whose asynchronous load ended
        already holds its blocks."""
        group = self.beam_search.group_of(request)
        if group is not None:
            seats = len(self.running) + self.beam_search.num_reserved_seats()
            if seats + group.params.beam_width > self.max_num_seqs:
                return False
        num_external, load_async = 0, False
        if request.num_computed_tokens > 0:
            hit_blocks, num_hit_tokens = KVCacheBlocks(), 0
            num_computed = request.num_computed_tokens
        else:
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_transfer is not None and group is None:
                num_external, load_async = self.kv_transfer.get_external_tokens(
                    request, num_hit_tokens
                )
            num_computed = num_hit_tokens + num_external
        behind = request.num_tokens - num_computed
        if load_async:
            num_new = 0
        elif self.enable_chunked_prefill:
            num_new = self._cap_new_tokens(behind, state.token_budget)
        elif behind <= state.token_budget:
            num_new = behind
        else:
            return False  # the whole prompt must fit in one step
        blocks = self._allocate_for_waiting(
            request, num_new + num_external, hit_blocks, num_hit_tokens, state, load_async
        )
        if blocks is None:
            return False
        self.waiting.pop_request()
        if self.kv_transfer is not None:
            request.num_computed_tokens = num_computed - num_external  # what is in place
            self.kv_transfer.after_alloc(request, num_external, load_async)
            if load_async:
                return True
        self._start_running(request, num_computed)
        state.add(request, num_new, blocks, is_new=True)
        if group is not None:
            self._admit_beams(group)
        return True

    def _start_running(self, request: Request, num_computed_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        request.record_event(EngineCoreEventType.SCHEDULED)
        if self.policy == "priority":
            bisect.insort(self.running, request)
        else:
            self.running.append(request)

    def _admit_beams(self, group: BeamGroup) -> None:
        """Move a just-admitted beam's waiting siblings to running with their prefix-cache
        hits (which need no free block, so this cannot fail)."""
        siblings = [b for b in group.beams if b.status != RequestStatus.RUNNING]
        if not siblings:
            return
        self.waiting.remove_requests(siblings)
        kv = self.kv_cache_manager
        for beam in siblings:
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(beam)
            blocks = kv.allocate_slots(beam, 0, num_hit_tokens, hit_blocks)
            assert blocks is not None, "taking prefix-cache hits needs no free block"
            self._start_running(beam, num_hit_tokens)
            self._unsent.add(beam.request_id)

    def _allocate_for_waiting(
        self,
        request: Request,
        num_new: int,
        hit_blocks: KVCacheBlocks,
        num_hit_tokens: int,
        state: _StepState,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Allocate a waiting request's first chunk. Waiting requests behind it that hold
        KV a connector loaded give their blocks back first; then, with the priority policy,
        running requests of strictly lower priority are preempted (possibly undoing their
        scheduling this step) until it fits."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new,
                num_hit_tokens,
                hit_blocks,
                self.num_lookahead_tokens,
                delay_cache_blocks,
            )
            if blocks is not None:
                return blocks
            if self.kv_transfer is not None and self.kv_transfer.release_waiting_holder(
                list(self.waiting), request
            ):
                continue
            i = self._last_preemptable()
            if self.policy != "priority" or i is None or not request < self.running[i]:
                return None
            self._preempt_last(state, i)

    def _preempt_last(self, state: _StepState, index: int | None) -> list[Request]:
        """Preempt the running request at `index`, or all running beams of its beam group,
        undoing their scheduling this step; returns them ([] for no index)."""
        if index is None:
            return []
        victim = self.running[index]
        group = self.beam_search.group_of(victim)
        if group is None:
            victims = [self.running.pop(index)]
        else:
            victims = [b for b in self.running if b in group.beams]
            self.running = [r for r in self.running if r not in victims]
        for request in reversed(victims):  # prepended one by one: keep their order
            state.remove(request)
            self._preempt(request, state)
        return victims

    def _preempt(self, request: Request, state: _StepState) -> None:
        """Preempt by recomputation: drop the KV, restart from token 0 when resumed (prefix
        caching usually brings most of it back)."""
        self.kv_cache_manager.free(request)
        self._unsent.discard(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)
        self._num_preemptions += 1
        self.num_preemptions_total += 1
        state.preempted.append(request)

    def _make_output(self, state: _StepState) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                num_beam_candidates=r.beam_search.num_candidates if r.beam_search else 0,
            )
            for r in state.new_reqs
        ]
        self._unsent.difference_update(r.request_id for r in state.new_reqs)
        cached = CachedRequestData()
        for r in state.cached_reqs:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(state.new_blocks[r.request_id].get_block_ids())
            cached.num_computed_tokens.append(r.num_computed_tokens)
            start, tokens = self._tokens_for_runner(r)
            cached.new_token_start.append(start)
            cached.new_token_ids.append(tokens)
        for r in state.new_reqs + state.cached_reqs:
            if self._sync_all_tokens or r.beam_search is not None:
                self._runner_num_tokens[r.request_id] = r.num_tokens
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=state.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(state.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=state.spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in state.preempted},
            blocks_to_copy=kv.take_blocks_to_copy(),
        )

    def _tokens_for_runner(self, request: Request) -> tuple[int, list[int]]:
        """(position, tokens): what the request's runners must set that they did not produce:
        a beam's continuation (its group chose it) or, with several ranks, what the driver
        sampled (the other ranks never saw it); everything after where their copy ended when
        the request was last scheduled. (0, []) for the rest."""
        end = self._runner_num_tokens.get(request.request_id)
        if end is None:
            return 0, []
        return end, request.output_token_ids[end - request.num_prompt_tokens :]

    # ---- results ----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Fold one step's sampled tokens back into the requests; one EngineCoreOutput per
        request that produced tokens. Finished requests are freed here."""
        mro = model_runner_output
        outputs: list[EngineCoreOutput] = []
        num_finished = 0
        if self.kv_transfer is not None and mro.kv_connector_output is not None:
            self.kv_transfer.update_from_output(mro.kv_connector_output)
        self._in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted after it was scheduled
            chunk_start = request.num_computed_tokens - num_scheduled
            idx = mro.req_id_to_index.get(req_id)
            sampled = mro.sampled_token_ids[idx] if idx is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:
                # len(drafts) + 1 positions were verified; the rejected ones are not computed.
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                if self.spec_decoding_stats is not None:
                    self.spec_decoding_stats.observe_draft(len(drafts), len(sampled) - 1)
            accumulator = self._prompt_logprobs.get(req_id)
            if accumulator is not None and not accumulator.complete:
                chunk = mro.prompt_logprobs_dict.get(req_id)
                if chunk is not None:
                    accumulator.add(chunk_start, chunk)
            candidates = mro.beam_candidates.get(req_id)
            if candidates is not None:
                num_finished += self._advance_beams(request, candidates, outputs)
                continue
            if not sampled:
                continue
            lists = mro.logprobs[idx] if mro.logprobs is not None and idx is not None else None
            new_token_ids, new_logprobs = self._append_sampled(request, sampled, lists)
            if mro.spec_token_ids is not None and idx is not None and not request.is_finished():
                request.spec_token_ids = self._valid_drafts(request, list(mro.spec_token_ids[idx]))
            else:
                request.spec_token_ids = []
            output = self._make_engine_output(request, new_token_ids, new_logprobs)
            outputs.append(output)
            if request.is_finished():
                output.kv_transfer_params = self._free_request(request)
                num_finished += 1
        if num_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic()
        )

    def _advance_beams(
        self, beam: Request, candidates: BeamCandidates, outputs: list[EngineCoreOutput]
    ) -> int:
        """Hand a beam's candidates to its group; once all its beams reported, apply the
        group's step: new beams join `running` after their parents (the runner gets them as
        new requests), dropped beams are freed, a finished search reports its output.
        Returns how many beams finished (the caller filters them out of `running`)."""
        group = self.beam_search.group_of(beam)
        assert group is not None, f"{beam.request_id} returned candidates but is no beam"
        if not group.report(beam, candidates):
            return 0
        step = group.step()
        self.beam_search.apply(step, group)
        for child, parent in step.new_beams:
            self.requests[child.request_id] = child
            self._unsent.add(child.request_id)
            if self.policy == "priority":
                bisect.insort(self.running, child)
            else:
                self.running.insert(self.running.index(parent) + 1, child)
        for dropped in step.dropped:
            dropped.status = RequestStatus.FINISHED_STOPPED
            self._free_request(dropped)
        if step.output is not None:
            outputs.append(step.output)
        return len(step.dropped)

    def _valid_drafts(self, request: Request, draft_token_ids: list[int]) -> list[int]:
        """The drafts to schedule next step: a structured request's are cut to the longest
        prefix its grammar accepts after this step's tokens (vLLM's update_draft_token_ids)."""
        som = self.structured_output_manager
        if som is None or not draft_token_ids:
            return draft_token_ids
        return som.validate_tokens(request.request_id, draft_token_ids)

    def _append_sampled(
        self, request: Request, sampled: list[int], lists: LogprobsLists | None
    ) -> tuple[list[int], list[LogprobsEntry] | None]:
        """Append sampled tokens one by one, stopping at the first stop condition (tokens after
        it are discarded); returns the kept tokens and their logprobs."""
        kept: list[int] = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            kept.append(token_id)
            if check_stop(request, self.max_model_len):
                break
            som = self.structured_output_manager
            if som is not None and som.accept_token(request, token_id):
                break  # the grammar ended (or rejected the token): finished with "stop"
        if self.hash_blocks:
            update_request_block_hashes(request, self.block_size)
        new_logprobs = logprobs_entries(lists, 0, len(kept)) if lists is not None else None
        return kept, new_logprobs

    def _make_engine_output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list[LogprobsEntry] | None
    ) -> EngineCoreOutput:
        # Prompt logprobs ride on the request's first output, once; whatever arrives after
        # (a recomputation after preemption) is ignored because the accumulator is gone.
        accumulator = self._prompt_logprobs.pop(request.request_id, None)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=accumulator.entries if accumulator is not None else None,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            events=request.take_events(),
        )

    # ---- state queries ----------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished ids the runner has not been told about yet (next schedule() tells it)."""
        return len(self.finished_req_ids) > 0

    def has_requests(self) -> bool:
        """Whether a step has anything to do: run requests, tell the runner of finished ones,
        or wait for KV transfers."""
        return (
            self.has_unfinished_requests()
            or self.has_finished_requests()
            or self.has_pending_kv_transfers()
        )

    def has_pending_kv_transfers(self) -> bool:
        """Whether a KV connector still moves blocks (held for a peer, or loading)."""
        return self.kv_transfer is not None and self.kv_transfer.has_pending()

    def make_stats(self) -> SchedulerStats:
        """Current queue sizes and KV usage, plus counters since the last call (reset here)."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=num_preemptions,
            num_blocks_total=self.kv_cache_manager.num_blocks,
            spec_decode=self.spec_decoding_stats.take() if self.spec_decoding_stats else None,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise AssertionError if the KV bookkeeping or the request sets are inconsistent:
        exactly the running requests hold blocks. Cheap; meant for tests and idle engines."""
        self.kv_cache_manager.check_integrity()
        running_ids = {r.request_id for r in self.running}
        expected = set(running_ids)
        if self.kv_transfer is not None:
            expected |= self.kv_transfer.block_holders(list(self.waiting))
        holders = set(self.kv_cache_manager.req_to_blocks)
        if expected != holders:
            raise AssertionError(
                f"running / transferring {sorted(expected)} but blocks held by {sorted(holders)}"
            )
        if len(running_ids) + len(self.waiting) != len(self.requests):
            raise AssertionError("a request is neither running nor waiting")
