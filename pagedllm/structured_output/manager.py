"""StructuredOutputManager: the engine core's side of structured outputs.

A request with `structured_outputs` enters the scheduler in WAITING_FOR_FSM while its grammar
compiles on a small thread pool (compiled grammars are cached by spec, so a repeated schema is
ready at once). The scheduler asks `is_ready` before admitting it; once compiled, the request
gets its own matcher and becomes WAITING. Every step, `fill_bitmask` writes packed int32 rows of
allowed tokens for the structured requests that sample this step into the SchedulerOutput (the
model runner masks those logits rows with them); after sampling, `accept_token` advances the
matcher with each appended token, and a matcher that has terminated (accepted a stop token)
finishes the request with reason "stop".

Speculative decoding (vLLM V1's scheme): the drafts proposed for a structured request are cut
to the longest prefix its grammar accepts (`validate_tokens`, when the scheduler stores them),
so a scheduled draft is always valid. A request verifying k drafts gets k + 1 rows: the mask
now, then after tentatively accepting draft 1, ..., draft k; the matcher is rolled back after
filling them. `accept_token` then advances it over the tokens the target accepted.

State lives here, keyed by request id, from `add_request` to `free_request`. Preemption keeps
it: a preempted request recomputes its prompt and generated tokens without sampling them again,
so its matcher, which already accepted them, stays where it is. `n > 1` children are separate
requests with separate matchers over one shared compiled grammar. A partial prefill chunk does
not sample, so it gets no bitmask row. A request whose grammar is not ready never drafts.

Reasoning models (`reasoning_parser` set, vLLM's `reasoning_end` scheme): a request whose
prompt leaves it reasoning (`ReasoningParser.is_reasoning_end` is False on the prompt) is not
constrained until it generates the end-of-reasoning token: it gets no bitmask rows, its drafts
are cut before that token (so only the step's last, sampled token can end the reasoning), and
`accept_token` does not advance the matcher until then. The grammar starts at the next token.

The manager is built unconditionally but costs nothing until the first structured request:
the tokenizer, TokenizerInfo and compiler are created then, on the pool.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.sched.output import SchedulerOutput
    from pagedllm.reasoning import ReasoningParser
    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (oldest dropped first).
MAX_CACHED_GRAMMARS = 256


@dataclass
class _RequestGrammar:
    """One structured request's grammar: compiling (`future`), ready (`grammar`), or failed."""

    future: Future
    grammar: XgrammarGrammar | None = None
    error: str | None = None
    reasoning_ended: bool = True  # False while a reasoning model thinks (unconstrained)


class StructuredOutputManager:
    """Compiles grammars, fills token bitmasks and advances matchers for the Scheduler.

    Not thread-safe: every method is called from the engine core's thread; only compiles run
    on the pool (and touch nothing but the backend)."""

    def __init__(self, config: EngineConfig, max_workers: int | None = None) -> None:
        self.config = config
        self.vocab_size = config.model_config.vocab_size
        self.max_workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._tokenizer = None
        self._reasoner: ReasoningParser | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._requests: dict[str, _RequestGrammar] = {}

    # ---- backend -----------------------------------------------------------------------------

    @property
    def backend(self) -> XgrammarBackend:
        """The xgrammar backend, built on first use (loads the tokenizer)."""
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

                tokenizer = self._get_tokenizer()
                stops = list(self.config.model_config.eos_token_ids)
                if tokenizer.eos_token_id is not None:
                    stops.append(tokenizer.eos_token_id)
                self._backend = XgrammarBackend(
                    tokenizer, self.vocab_size, stops, max_threads=self.max_workers
                )
            return self._backend

    def _get_tokenizer(self):
        if self._tokenizer is None:  # callers hold _backend_lock
            from pagedllm.transformers_utils.tokenizer import get_tokenizer

            mc = self.config.model_config
            self._tokenizer = get_tokenizer(
                mc.tokenizer,
                trust_remote_code=mc.trust_remote_code,
                tokenizer_mode=mc.tokenizer_mode,
            )
        return self._tokenizer

    @property
    def reasoner(self) -> ReasoningParser | None:
        """The configured reasoning parser (None without one), built on first use."""
        name = self.config.structured_outputs_config.reasoning_parser
        if name is None:
            return None
        with self._backend_lock:
            if self._reasoner is None:
                from pagedllm.reasoning import ReasoningParserManager

                cls = ReasoningParserManager.get_reasoning_parser(name)
                self._reasoner = cls(self._get_tokenizer())
            return self._reasoner

    def _compile_async(self, request: Request) -> Future:
        spec = request.sampling_params.structured_outputs
        key = spec.cache_key()
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix="pagedllm-grammar"
            )
        future = self._executor.submit(lambda: self.backend.compile(spec))
        self._compiled[key] = future
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return future

    # ---- request lifetime (Scheduler hooks) -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Start compiling a structured request's grammar; it waits in WAITING_FOR_FSM unless
        the grammar is already compiled. No-op for other requests."""
        if request.sampling_params.structured_outputs is None:
            return
        state = _RequestGrammar(future=self._compile_async(request))
        reasoner = self.reasoner
        if reasoner is not None and not self.config.structured_outputs_config.enable_in_reasoning:
            state.reasoning_ended = reasoner.is_reasoning_end(request.prompt_token_ids)
        self._requests[request.request_id] = state
        request.status = RequestStatus.WAITING_FOR_FSM
        self.is_ready(request)

    def is_ready(self, request: Request) -> bool:
        """Whether a WAITING_FOR_FSM request's grammar is compiled; if so it gets its matcher
        and becomes WAITING. A compile that failed in the core (the front end validates first,
        so this is not expected) is logged, and the request may then only stop."""
        state = self._requests.get(request.request_id)
        if state is None:
            return True
        if state.grammar is None and state.error is None:
            if not state.future.done():
                return False
            try:
                state.grammar = self.backend.new_grammar(state.future.result())
            except Exception as e:  # noqa: BLE001 - reported per request, engine keeps going
                state.error = f"{type(e).__name__}: {e}"
                logger.error(
                    "structured outputs of request %s failed to compile, so it can only stop: %s",
                    request.request_id,
                    state.error,
                )
        if request.status == RequestStatus.WAITING_FOR_FSM:
            request.status = RequestStatus.WAITING
        return True

    def free_request(self, request_id: str) -> None:
        """Forget a finished or aborted request (its compiled grammar stays cached)."""
        self._requests.pop(request_id, None)

    # ---- per step ---------------------------------------------------------------------------

    def fill_bitmask(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Set `output.grammar_bitmask` (numpy int32 [rows, ceil(vocab / 32)]) and
        `output.structured_output_request_ids` (req id -> its first bitmask row) for the
        structured requests that sample in `output`. A request with k drafts scheduled owns
        k + 1 consecutive rows, one per verified position, in `num_scheduled_tokens` order.
        Call before the scheduled requests' `num_computed_tokens` are advanced."""
        if not self._requests:
            return
        spec = output.scheduled_spec_decode_tokens
        rows: dict[str, int] = {}
        num_rows = 0
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or not state.reasoning_ended:
                continue
            request = requests[req_id]
            if request.num_computed_tokens + num_tokens < request.num_tokens:
                continue  # a partial prefill chunk: nothing is sampled
            rows[req_id] = num_rows
            num_rows += 1 + len(spec.get(req_id, ()))
        if not rows:
            return
        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for req_id, row in rows.items():
            grammar = self._requests[req_id].grammar
            drafts = spec.get(req_id, [])
            if grammar is not None:
                _fill_draft_rows(grammar, bitmask, row, drafts)
            else:
                for r in range(row, row + 1 + len(drafts)):
                    self._fill_stop_only(bitmask, r, requests[req_id])
        output.structured_output_request_ids = rows
        output.grammar_bitmask = bitmask.numpy()

    def validate_tokens(self, request_id: str, token_ids: list[int]) -> list[int]:
        """The drafts worth scheduling for a request: the longest prefix of `token_ids` its
        grammar accepts; all of them for an unconstrained request; none while its grammar
        is not ready (or failed); while it reasons, those before the end of reasoning."""
        state = self._requests.get(request_id)
        if state is None:
            return token_ids
        if state.grammar is None:
            return []
        if not state.reasoning_ended:
            for i, token_id in enumerate(token_ids):
                if self.reasoner.is_reasoning_end_streaming((), (token_id,)):
                    return token_ids[:i]
            return token_ids
        return state.grammar.validate_tokens(token_ids)

    def _fill_stop_only(self, bitmask: torch.Tensor, row: int, request: Request) -> None:
        """A row that allows only the request's stop tokens (for a failed grammar)."""
        params = request.sampling_params
        stops = set(params.all_stop_token_ids)
        for eos in (request.eos_token_id, params.eos_token_id):
            if eos is not None:
                stops.add(eos)
        words = bitmask[row].numpy().view(np.uint32)
        words[:] = 0 if stops else 0xFFFFFFFF
        for t in stops:
            if t < self.vocab_size:
                words[t // 32] |= np.uint32(1 << (t % 32))

    def accept_token(self, request: Request, token_id: int) -> bool:
        """Advance the request's matcher by one appended token. True (and the request is
        FINISHED_STOPPED) when the grammar has ended or cannot take the token. Always False
        for requests without structured outputs."""
        state = self._requests.get(request.request_id)
        if state is None:
            return False
        if not state.reasoning_ended:
            ids = request.all_token_ids
            state.reasoning_ended = self.reasoner.is_reasoning_end_streaming(ids, (token_id,))
            return False  # the grammar starts with the next token
        grammar = state.grammar
        if grammar is None:
            ended = True
        elif not grammar.accept_token(token_id):
            logger.warning(
                "request %s: token %d is not allowed by its grammar; stopping it",
                request.request_id,
                token_id,
            )
            ended = True
        else:
            ended = grammar.is_terminated()
        if ended:
            request.status = RequestStatus.FINISHED_STOPPED
        return ended

    # ---- queries ----------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _fill_draft_rows(
    grammar: XgrammarGrammar, bitmask: torch.Tensor, row: int, drafts: list[int]
) -> None:
    """Rows row .. row + len(drafts): the mask after the first j drafts, for j = 0..k; the
    matcher ends where it started. Should the matcher refuse draft j (validated drafts never
    are refused) or have terminated (draft j was a stop token), the rows after it are set
    to all-allowed: the verifier never reads them, because a refused draft is masked out of
    the row before it (the target rejects it there) and the scheduler stops the request at
    an accepted stop token, dropping whatever follows."""
    advanced = 0
    for j in range(len(drafts) + 1):
        if advanced < j or grammar.is_terminated():
            bitmask[row + j] = -1
            continue
        grammar.fill_bitmask(bitmask, row + j)
        if j < len(drafts) and grammar.accept_token(drafts[j]):
            advanced += 1
    grammar.rollback(advanced)
