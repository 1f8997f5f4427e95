"""OutputProcessor: EngineCoreOutputs -> RequestOutputs, in the front-end process.

Per request it keeps the detokenizer, the tokens and logprobs so far, and the timestamps the
metrics need. A stop string found here finishes the request in the front end; the caller must
then abort it in the engine core (`reqs_to_abort`). Requests created by `AsyncLLM` carry a
`RequestOutputCollector`: their outputs go there instead of being returned.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.metrics.stats import IterationStats, RequestStateStats
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class RequestOutputCollector:
    """One request's mailbox between the output handler and the consumer (AsyncLLM).

    The producer never blocks: if the consumer lags, DELTA outputs are merged into the one
    waiting and CUMULATIVE ones replace it; an exception is delivered as is. `request_id` is
    the engine-internal id of the request it serves (what aborting it takes)."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str = "") -> None:
        self.request_id = request_id
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
        elif isinstance(self.output, RequestOutput) and self.aggregate:
            _merge_delta(self.output, output)
        else:
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished = new.finished
    into.metrics = new.metrics


@dataclass
class RequestState:
    request_id: str
    external_req_id: str  # the caller's id, reported in RequestOutput.request_id
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    num_logprobs: int | None
    detokenizer: IncrementalDetokenizer | None
    parent: ParentRequest | None
    request_index: int
    queue: RequestOutputCollector | None
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    num_cached_tokens: int = 0
    sampling_params: SamplingParams | None = None
    stats: RequestStateStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = RequestStateStats(arrival_time=self.arrival_time)

    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        """`stream_interval` (vLLM's `--stream-interval`): a streamed (DELTA or CUMULATIVE)
        request's output goes out once this many new tokens have come since the last one
        sent; the first and the final outputs always go out at once."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        # Each token's text as logprobs entries show it, decoded once (at most the vocabulary):
        # 64 rows of 5 logprobs a step were ~380 tokenizer calls, ~2 ms a step.
        self._token_texts: dict[int, str] = {}
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
        external_req_id: str | None = None,
    ) -> None:
        """Track one engine-core request. `external_req_id` is the id its outputs report
        (default: its own id; for n > 1, the parent's); internal ids must be unique."""
        if request.request_id in self.request_states:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        params = request.sampling_params
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id,
            external_req_id=external_req_id
            or (parent_req.request_id if parent_req is not None else request.request_id),
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            num_logprobs=params.logprobs,
            detokenizer=detok,
            parent=parent_req,
            request_index=request_index,
            queue=queue,
            arrival_time=request.arrival_time,
            sampling_params=params,
        )
        if parent_req is not None:
            self.parents[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these requests (or parents); return the engine-core ids to abort."""
        to_abort: list[str] = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            ids = parent.child_ids if parent is not None else [rid]
            for cid in ids:
                if self.request_states.pop(cid, None) is not None:
                    to_abort.append(cid)
        return to_abort

    def find_requests(self, external_req_id: str) -> list[str]:
        """The ids `abort_requests` takes (a parent's for n > 1) of every request tracked under
        the caller's id `external_req_id`."""
        found: dict[str, None] = {}
        for state in self.request_states.values():
            if state.external_req_id == external_req_id:
                found[state.parent.request_id if state.parent else state.request_id] = None
        return list(found)

    def fail_requests(self, errors: dict[str, Exception]) -> list[str]:
        """These requests' engine died: each consumer gets its error and the request is
        dropped, with its siblings (n > 1) on other engines; returns those siblings' engine-core
        ids, still to abort."""
        to_abort: list[str] = []
        for request_id, error in errors.items():
            state = self.request_states.pop(request_id, None)
            if state is None:
                continue
            if state.queue is not None:
                state.queue.put(error)
            if state.parent is not None:
                to_abort += self.abort_requests([state.parent.request_id])
        return to_abort

    def propagate_error(self, error: Exception) -> None:
        """The engine died: every waiting consumer gets `error`; all requests are dropped."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(error)
        self.request_states.clear()
        self.parents.clear()

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        iteration_stats: IterationStats | None = None,
        engine_core_timestamp: float | None = None,
    ) -> OutputProcessorOutput:
        """`engine_core_timestamp`: the core's monotonic time of the step that made these
        outputs (`EngineCoreOutputs.timestamp`; default: now)."""
        now = time.time()
        engine_ts = engine_core_timestamp or time.monotonic()
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            state.stats.observe_events(out.events)
            if out.beam_sequences is not None:
                ro = self._beam_request_output(state, out)
                num_tokens = sum(len(c.token_ids) for c in ro.outputs)
                prompt_len = len(state.prompt_token_ids)
                state.stats.observe_tokens(num_tokens, prompt_len, now, engine_ts, iteration_stats)
                self._finish(state, out.finish_reason, now, iteration_stats)
                if state.queue is not None:
                    state.queue.put(ro)
                else:
                    request_outputs.append(ro)
                continue
            state.stats.observe_tokens(
                len(out.new_token_ids), len(state.prompt_token_ids), now, engine_ts, iteration_stats
            )
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None and out.new_token_ids:
                stop_str = state.detokenizer.update(
                    out.new_token_ids, finish_reason == FinishReason.STOP
                )
                if stop_str is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(out.request_id)
                    finish_reason, stop_reason = FinishReason.STOP, stop_str
            state.token_ids.extend(out.new_token_ids)
            self._add_logprobs(state, out)
            state.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            finished = finish_reason is not None
            ro = self._make_request_output(state, finish_reason, stop_reason, finished)
            if finished:
                self._finish(state, finish_reason, now, iteration_stats)
            if ro is None:
                continue
            if state.queue is not None:
                state.queue.put(ro)
            else:
                request_outputs.append(ro)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    # ---- helpers ---------------------------------------------------------------------------

    def _finish(
        self,
        state: RequestState,
        reason: FinishReason | None,
        now: float,
        it: IterationStats | None,
    ) -> None:
        self.request_states.pop(state.request_id, None)
        parent = state.parent
        if parent is not None:
            parent.observe_finished(len(state.token_ids))
            if parent.finished:
                self.parents.pop(parent.request_id, None)
        if it is None:
            return
        params = state.sampling_params
        it.finished_requests.append(
            state.stats.finished(
                str(reason),
                now,
                len(state.prompt_token_ids),
                state.num_cached_tokens,
                params.max_tokens if params is not None else None,
            )
        )
        if parent is None:  # n and the longest sample, once per user request
            it.n_params.append(1)
            it.max_num_generation_tokens.append(len(state.token_ids))
        elif parent.finished:
            it.n_params.append(parent.n)
            it.max_num_generation_tokens.append(parent.max_num_generation_tokens)

    def _add_logprobs(self, state: RequestState, out: EngineCoreOutput) -> None:
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is None:
            # Entry 0 (the first prompt token, which has no logprob) is already None.
            state.prompt_logprobs = [
                self._to_logprob_dict(entry) if entry is not None else None
                for entry in out.new_prompt_logprobs
            ]
        if state.num_logprobs is None or not out.new_logprobs:
            return
        for entry in out.new_logprobs:
            state.logprobs.append(self._to_logprob_dict(entry))
            state.cumulative_logprob += entry[1][0]

    def _to_logprob_dict(self, entry: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
        """One position's {token id: Logprob}."""
        ids, lps, rank = entry
        texts = self._token_texts
        result: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, lps)):
            if tid in result:
                continue
            text = None
            if self.tokenizer is not None:
                text = texts.get(tid)
                if text is None:
                    text = texts[tid] = decode_token(self.tokenizer, tid)
            result[tid] = Logprob(logprob=lp, rank=rank if j == 0 else j, decoded_token=text)
        return result

    def _beam_request_output(self, state: RequestState, out: EngineCoreOutput) -> RequestOutput:
        """A finished beam search: one CompletionOutput per beam, best first, each with its
        cumulative logprob and, per token, the chosen token's and the candidates' logprobs."""
        completions = []
        for index, beam in enumerate(out.beam_sequences or ()):
            text = ""
            if state.detokenizer is not None:
                assert state.sampling_params is not None
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, state.prompt_token_ids, state.sampling_params
                )
                detokenizer.update(beam.token_ids, stop_terminated=False)
                text = detokenizer.output_text
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=beam.token_ids,
                    cumulative_logprob=beam.cum_logprob,
                    logprobs=[self._to_logprob_dict(entry) for entry in beam.logprobs],
                    finish_reason=str(beam.finish_reason),
                    stop_reason=beam.stop_reason,
                )
            )
            state.token_ids.extend(beam.token_ids)  # counted as generated in the stats
        state.num_cached_tokens = out.num_cached_tokens
        return RequestOutput(
            request_id=state.external_req_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
            num_cached_tokens=out.num_cached_tokens,
            metrics=RequestMetrics(arrival_time=state.arrival_time),
        )

    def _make_request_output(
        self,
        state: RequestState,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        finished: bool,
    ) -> RequestOutput | None:
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if (
            self.stream_interval > 1
            and not finished
            and state.sent_tokens
            and len(state.token_ids) - state.sent_tokens < self.stream_interval
        ):
            return None
        delta = kind == RequestOutputKind.DELTA
        text = ""
        if state.detokenizer is not None:
            text, state.sent_text = state.detokenizer.get_text(finished, delta, state.sent_text)
        token_ids = state.token_ids[state.sent_tokens :] if delta else list(state.token_ids)
        logprobs = None
        if state.num_logprobs is not None:
            logprobs = state.logprobs[state.sent_tokens :] if delta else list(state.logprobs)
        prompt_logprobs = state.prompt_logprobs
        if delta and state.sent_tokens > 0:
            prompt_logprobs = None
        state.sent_tokens = len(state.token_ids)
        completion = CompletionOutput(
            index=state.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob if state.num_logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
        )
        completions = [completion]
        done = finished
        if state.parent is not None:
            got = state.parent.add_child_output(state.request_index, completion)
            if got is None:
                return None
            completions, done = got, state.parent.finished
        return RequestOutput(
            request_id=state.external_req_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=done,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
            metrics=RequestMetrics(
                arrival_time=state.arrival_time,
                first_token_time=state.stats.first_token_time,
                last_token_time=state.stats.last_token_time,
            ),
        )
