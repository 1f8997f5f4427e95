"""AsyncLLM: the asyncio front end that the OpenAI server runs on.

Requests are validated and tokenized here (`Processor`, on a tokenizer thread), sent to an `EngineCoreProc` through
`AsyncMPClient`, and their outputs come back through one output-handler task: it awaits the
client, turns `EngineCoreOutputs` into `RequestOutput`s (`OutputProcessor`, which detokenizes
and checks stop strings) and puts each into its request's `RequestOutputCollector`. The
consumer of `generate()` takes from that collector, so a slow consumer never stalls the
handler (DELTA outputs are merged while it lags). Stat loggers are fed from the same task.

If the engine process dies, every pending request gets `EngineDeadError`, and so does every
new one; `errored` turns true, `check_health()` raises and the periodic stats log stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.engine import EngineCoreRequest
from pagedllm.engine.core_client import AsyncMPClient, EngineCoreClient
from pagedllm.engine.exceptions import EngineDeadError, EngineGenerateError
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine.utils import ClientConfig
from pagedllm.metrics.loggers import EngineSnapshotLogger, LoggingStatLogger, StatLoggerBase
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_ENV = "PAGEDLLM_LOG_STATS_INTERVAL"
# Outputs processed between two yields to the event loop, so a big batch of outputs does not
# hold up the HTTP side.
_OUTPUT_CHUNK_SIZE = 128


_SUFFIX_BYTES = 4  # of the random suffix of an engine request id
_SUFFIX = re.compile(rf"-[0-9a-f]{{{2 * _SUFFIX_BYTES}}}$")


def caller_request_id(engine_request_id: str) -> str:
    """The caller's id of an engine request `AsyncLLM` added (any front end's): its id
    without the random suffix. Children of n > 1 keep their "<index>_" prefix."""
    return _SUFFIX.sub("", engine_request_id)


class AsyncLLM:
    """An engine for asyncio servers.

    Contract: use it from one event loop. `generate()` yields `RequestOutput`s per
    `sampling_params.output_kind` (CUMULATIVE: whole text so far; DELTA: only what is new;
    FINAL_ONLY: one output at the end); the last one has `finished=True`. Closing or
    cancelling the generator early aborts the request in the engine core, which frees its KV
    blocks. Bad input raises `ValueError` before anything is scheduled.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_stats: bool = True,
        log_requests: bool = True,
        stat_loggers: list[StatLoggerBase] | None = None,
        engine_core_cls: type | None = None,
        tokenizer: Any = None,
        client_config: ClientConfig | None = None,
    ) -> None:
        from pagedllm.transformers_utils.tokenizer import get_tokenizer_while

        self.config = config
        self.model_config = config.model_config
        self.log_stats = log_stats
        self.log_requests = log_requests
        mc = config.model_config

        def start_engine() -> AsyncMPClient:
            return EngineCoreClient.make_client(  # type: ignore[return-value]
                config,
                multiprocess_mode=True,
                asyncio_mode=True,
                engine_core_cls=engine_core_cls,
                client_config=client_config,
            )

        if tokenizer is None:
            tokenizer, self.engine_core = get_tokenizer_while(
                start_engine,
                mc.tokenizer,
                trust_remote_code=mc.trust_remote_code,
                tokenizer_mode=mc.tokenizer_mode,
            )
        else:
            self.engine_core = start_engine()
        self.tokenizer = tokenizer
        self.processor = Processor(config, tokenizer)
        # The one thread besides the event loop that tokenizes (prompts, chat templates,
        # request processing), so a long input never stalls the loop. One worker serializes
        # those calls: a Hugging Face fast tokenizer must not be reconfigured while another
        # thread encodes with it ("Already borrowed"). Detokenization stays on the loop.
        self.tokenizer_executor = ThreadPoolExecutor(1, thread_name_prefix="Tokenizer")
        self.output_processor = OutputProcessor(tokenizer, config.scheduler_config.stream_interval)
        config.cache_config.num_blocks = self.engine_core.num_blocks  # sized by the core
        engines = range(self.engine_core.num_engines)
        self.prometheus: PrometheusMetrics | None = None
        # Per engine (data-parallel rank): the loggers its outputs feed.
        self._engine_loggers: list[list[StatLoggerBase]]
        if stat_loggers is None and log_stats:
            self.prometheus = PrometheusMetrics(
                mc.name,
                [
                    dataclasses.replace(config.cache_config, num_blocks=n)
                    for n in self.engine_core.engine_num_blocks
                ],
                max_model_len=mc.max_model_len,
            )
            self._engine_loggers = [
                [LoggingStatLogger(r), self.prometheus.for_engine(r)] for r in engines
            ]
        else:
            self._engine_loggers = [list(stat_loggers or []) for _ in engines]
        self.stat_loggers: list[StatLoggerBase] = list(
            {id(lg): lg for loggers in self._engine_loggers for lg in loggers}.values()
        )
        # Whether outputs are timed for the loggers (TTFT, inter-token latency, ...).
        self._collect_iteration_stats = log_stats or bool(self.stat_loggers)
        self.stats_interval_s = float(os.environ.get(STATS_INTERVAL_ENV, "10"))
        self._output_handler: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._shutdown = False

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncLLM:
        """Build from `EngineArgs`; `log_stats` defaults to `not engine_args.disable_log_stats`."""
        kwargs.setdefault("log_stats", not getattr(engine_args, "disable_log_stats", False))
        return cls(engine_args.create_engine_config(), **kwargs)

    # --------------------------------------------------------------------------- state

    @property
    def errored(self) -> bool:
        return self._error is not None or self.engine_core.is_dead

    @property
    def dead_error(self) -> EngineDeadError:
        if isinstance(self._error, EngineDeadError):
            return self._error
        return self.engine_core._dead_error or EngineDeadError()

    @property
    def is_running(self) -> bool:
        return not self._shutdown and not self.errored

    async def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine core is gone."""
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def get_model_config(self) -> Any:
        return self.model_config

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine_core.call_utility_async("reset_prefix_cache"))

    @property
    def stalled_engines(self) -> dict[int, str]:
        """Live engines that make no progress: rank -> why (engine/stall.py). Updates the
        `vllm:engine_stalled` gauges."""
        stalled = self.engine_core.stalled_engines
        if self.prometheus is not None:
            for rank in range(self.engine_core.num_engines):
                self.prometheus.for_engine(rank).engine_stalled.set(1 if rank in stalled else 0)
        return stalled

    def add_stat_logger(self, stat_logger: StatLoggerBase, engine_index: int | None = None) -> None:
        """Feed `stat_logger` the stats of engine `engine_index` (None: of every engine) from
        now on. A logger that also has `record_snapshot` (`EngineSnapshotLogger`) gets the
        engines' dashboard snapshots once `set_engine_snapshots(True)` asked for them."""
        ranks = range(len(self._engine_loggers)) if engine_index is None else [engine_index]
        for rank in ranks:
            self._engine_loggers[rank].append(stat_logger)
        if all(lg is not stat_logger for lg in self.stat_loggers):
            self.stat_loggers.append(stat_logger)
        self._collect_iteration_stats = True

    async def set_engine_snapshots(self, enabled: bool) -> None:
        """Ask every engine for a dashboard snapshot about once a second (and one at once),
        or stop asking."""
        self._start_background_tasks()  # the output handler takes the snapshots in
        await self.engine_core.call_utility_async("set_snapshots", enabled)

    # --------------------------------------------------------------------------- requests

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        processed: tuple[str | None, EngineCoreRequest] | None = None,
    ) -> RequestOutputCollector:
        """Validate, register and send one request; its outputs arrive in the returned
        collector. Raises ValueError (bad input) or EngineDeadError. `processed`: what
        `processor.process_inputs` already returned for these arguments (the server validates
        before it starts a stream); it is not processed again (otherwise the processor runs
        on `tokenizer_executor`, off the event loop).

        `request_id` is the caller's: outputs report it, and `abort(request_id)` aborts every
        request added under it. Inside the engine the request gets a unique id of its own
        (`request_id` plus a random suffix, as vLLM does; the collector's `request_id`), so a
        caller reusing an id can never reach another request."""
        if self.errored:
            raise self.dead_error
        self._start_background_tasks()
        if processed is None:
            processed = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_executor,
                self.processor.process_inputs,
                request_id,
                prompt,
                params,
                arrival_time,
                priority,
            )
        prompt_text, request = processed
        internal_id = self._internal_request_id(request_id)
        request = msgspec.structs.replace(request, request_id=internal_id)
        queue = RequestOutputCollector(request.sampling_params.output_kind, internal_id)
        try:
            for child, parent_req, index in fan_out(request):
                self.output_processor.add_request(
                    child, prompt_text, parent_req, index, queue, external_req_id=request_id
                )
                await self.engine_core.add_request_async(child)
        except BaseException:
            self._abort_nowait(internal_id, request_id, reason="it could not be added")
            raise
        return queue

    def _internal_request_id(self, request_id: str) -> str:
        """`request_id` plus a random suffix no request in flight here has (the inverse:
        `caller_request_id`)."""
        op = self.output_processor
        while True:
            internal_id = f"{request_id}-{secrets.token_hex(_SUFFIX_BYTES)}"
            if internal_id not in op.request_states and internal_id not in op.parents:
                return internal_id

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int = 0,
        processed: tuple[str | None, EngineCoreRequest] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes (see the class contract);
        `processed` as in `add_request`. A beam search (`BeamSearchParams`) yields once."""
        start = time.monotonic()
        arrival = time.time()
        queue: RequestOutputCollector | None = None
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        num_output_tokens: dict[int, int] = {}
        try:
            queue = await self.add_request(
                request_id,
                prompt,
                sampling_params,
                arrival_time=arrival,
                priority=priority,
                processed=processed,
            )
            finished = False
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                for c in out.outputs if self.log_requests else ():
                    n_tok = len(c.token_ids)
                    num_output_tokens[c.index] = (
                        num_output_tokens.get(c.index, 0) + n_tok if delta else n_tok
                    )
                if finished and self.log_requests:
                    logger.info(
                        "Finished request %s: prompt_tokens=%d, output_tokens=%d, "
                        "finish_reason=%s, time=%.3fs",
                        request_id,
                        len(out.prompt_token_ids),
                        sum(num_output_tokens.values()),
                        ",".join(str(c.finish_reason) for c in out.outputs),
                        time.monotonic() - start,
                    )
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if queue is not None:
                self._abort_nowait(queue.request_id, request_id, reason="client went away")
            raise
        except (EngineDeadError, ValueError):
            raise
        except Exception as e:
            if queue is not None:
                self._abort_nowait(queue.request_id, request_id, reason=str(e))
            raise EngineGenerateError(f"request {request_id} failed: {e}") from e

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (ids as passed to `generate`: every request added under such an id);
        their KV blocks are freed."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for internal_id in self.output_processor.find_requests(rid):
                self._abort_nowait(internal_id, rid, reason="aborted by the caller")

    def _abort_nowait(self, internal_id: str, request_id: str, reason: str) -> None:
        """Forget request `internal_id` (a parent's id aborts its children) and abort it in the
        engine core; `request_id` is the caller's id, for the log line."""
        core_ids = self.output_processor.abort_requests([internal_id])
        if not core_ids:
            return
        try:
            self.engine_core.abort_requests_nowait(core_ids)
        except EngineDeadError:
            return
        if self.log_requests:
            logger.info("Aborted request %s (%s)", request_id, reason)

    # --------------------------------------------------------------------------- background

    def _start_background_tasks(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="AsyncLLM.output_handler"
            )
        if self._stats_task is None and self.stat_loggers and self.stats_interval_s > 0:
            self._stats_task = asyncio.get_running_loop().create_task(
                self._run_stats_logging(), name="AsyncLLM.stats"
            )

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if outputs.errored_requests is not None:
                    await self._fail_requests(outputs.errored_requests)
                    if self.prometheus is not None:
                        self.prometheus.for_engine(outputs.engine_index).engine_dead.set(1)
                    continue
                engine_loggers = self._engine_loggers[outputs.engine_index]
                if outputs.snapshot is not None:  # travels alone (EngineCoreProc)
                    for stat_logger in engine_loggers:
                        if isinstance(stat_logger, EngineSnapshotLogger):
                            stat_logger.record_snapshot(outputs.snapshot)
                    continue
                stats = IterationStats() if self._collect_iteration_stats else None
                batch = outputs.outputs
                for start in range(0, max(len(batch), 1), _OUTPUT_CHUNK_SIZE):
                    chunk = batch[start : start + _OUTPUT_CHUNK_SIZE]
                    processed = self.output_processor.process_outputs(
                        chunk, stats, outputs.timestamp
                    )
                    if processed.reqs_to_abort:
                        await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                    if start + _OUTPUT_CHUNK_SIZE < len(batch):
                        await asyncio.sleep(0)
                for stat_logger in engine_loggers:
                    stat_logger.record(outputs.scheduler_stats, stats)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"({e})")
            if not isinstance(e, EngineDeadError):
                logger.exception("AsyncLLM output handler failed")
            self._error = error
            self.output_processor.propagate_error(error)

    async def _fail_requests(self, errored: dict[str, str]) -> None:
        """A data-parallel engine died while the others serve on: its requests end with
        `EngineDeadError`."""
        errors = {rid: EngineDeadError(f"({text})") for rid, text in errored.items()}
        siblings = self.output_processor.fail_requests(errors)
        if siblings:
            await self.engine_core.abort_requests_async(siblings)

    @property
    def dead_engines(self) -> dict[int, str]:
        """Data-parallel engines that died while the others serve on: rank -> why."""
        return self.engine_core.dead_engines

    async def _run_stats_logging(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            if self.errored:  # the last stats describe an engine that is gone
                return
            for stat_logger in self.stat_loggers:
                stat_logger.log()

    def shutdown(self) -> None:
        """Stop the background tasks and the engine process. Idempotent."""
        self._shutdown = True
        for task in (self._output_handler, self._stats_task):
            if task is not None and not task.done():
                try:
                    task.cancel()
                except RuntimeError:
                    pass  # its event loop is already closed
        self.tokenizer_executor.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()
