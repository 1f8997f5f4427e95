"""EngineCore: the scheduler and the executor, stepped together.

`step()` is the whole engine in three lines: the scheduler picks this step's tokens, the
executor runs them, the scheduler folds the sampled tokens back into its requests and reports
what is new. `EngineCoreProc` (core_proc.py) runs this same object in its own process.

With pipeline parallelism (an executor with `max_concurrent_batches > 1`) `step()` keeps that
many batches in flight instead (vLLM's batch queue): while the oldest batch is still in the
pipeline it schedules and submits the next one, so every stage has work; the scheduler never
puts a request in two in-flight batches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine import EngineCoreOutputs, EngineCoreRequest, EngineSnapshot
from pagedllm.engine.snapshot import BlockMap, StepTimes, make_engine_snapshot
from pagedllm.executor.abstract import Executor
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# A step with nothing to compute that only waits for KV transfers sleeps this long, so an
# engine polling its connector does not spin a core.
_KV_TRANSFER_POLL_S = 0.005


class EngineCore:
    """Owns the Scheduler and the Executor. Not thread-safe: one caller steps it."""

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None):
        self.config = config
        t0 = time.monotonic()
        if config.kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

            KVConnectorFactory.prepare(config)  # before the worker and scheduler sides exist
        self.executor = (executor_class or Executor.get_class(config))(config)
        try:
            self.num_blocks = self._initialize_kv_cache()
            # Lazy: loads the tokenizer and xgrammar only when a structured request arrives.
            self.structured_output_manager = StructuredOutputManager(config)
            self.scheduler = Scheduler(config, self.structured_output_manager)
        except BaseException:
            # No worker process (nor its queues) outlives a start-up that failed here.
            self.executor.shutdown()
            raise
        # Pipeline parallel: batches in flight, newest first (see the module docstring).
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        # Where steps spend their time (the dashboard's split; engine/snapshot.py).
        self.step_times = StepTimes()
        self.block_map = BlockMap()
        logger.info(
            "EngineCore ready in %.1fs: %d KV blocks of %d tokens (%d tokens, %s)",
            time.monotonic() - t0,
            self.num_blocks,
            config.cache_config.block_size,
            self.num_blocks * config.cache_config.block_size,
            str(config.kv_cache_torch_dtype).removeprefix("torch."),
        )

    def _initialize_kv_cache(self) -> int:
        cache = self.config.cache_config
        num_blocks = self.executor.determine_num_kv_blocks()
        max_len = self.config.model_config.max_model_len
        needed = -(-max_len // cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens, fewer "
                f"than one request of max_model_len={max_len} needs ({needed} blocks); raise "
                "kv_cache_memory_bytes (or num_gpu_blocks_override / gpu_memory_utilization) or "
                "lower max_model_len"
            )
        cache.num_blocks = num_blocks
        self.executor.initialize_kv_cache(num_blocks)
        return num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Whether stepping has work: requests, batches in flight, or KV transfers a connector
        still moves."""
        sched = self.scheduler
        return (
            sched.has_unfinished_requests()
            or bool(self.batch_queue)
            or sched.has_pending_kv_transfers()
        )

    def step(self) -> EngineCoreOutputs:
        if self.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(outputs=[], scheduler_stats=self.scheduler.make_stats())
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        model_output = self.executor.execute_model(scheduler_output)
        t2 = time.perf_counter()
        if scheduler_output.is_empty and self.scheduler.kv_transfer is not None:
            time.sleep(_KV_TRANSFER_POLL_S)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        sampling = getattr(model_output, "sampling_time_s", 0.0)
        self.step_times.add(t1 - t0, t2 - t1, sampling, time.perf_counter() - t2)
        return outputs

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Submit a new batch while there is room and something to run; otherwise (or when
        the oldest batch is already done) wait for the oldest and fold its output back. A call
        that only submitted returns no outputs and no stats."""
        queue = self.batch_queue
        submitted = False
        if len(queue) < self.max_concurrent_batches and self.scheduler.has_requests():
            so = self.scheduler.schedule()
            # An empty batch still tells the workers which requests finished.
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                queue.appendleft((self.executor.execute_model(so, non_block=True), so))
                submitted = so.total_num_scheduled_tokens > 0
        if not queue:
            return EngineCoreOutputs(outputs=[], scheduler_stats=self.scheduler.make_stats())
        if submitted and len(queue) < self.max_concurrent_batches and not queue[-1][0].done():
            return EngineCoreOutputs(outputs=[])
        future, so = queue.pop()
        return self.scheduler.update_from_output(so, future.result())

    def make_snapshot(self) -> EngineSnapshot:
        """The dashboard's view of this engine now (engine/snapshot.py)."""
        return make_engine_snapshot(self.scheduler, self.step_times, self.block_map)

    def idle_work(self) -> bool:
        """The next piece of every rank's idle work (the CPU weights' move onto huge pages,
        the CPU KV cache's pages; ModelRunner.idle_work); whether any remains."""
        return self.executor.idle_work()

    def finish_weight_move(self) -> None:
        """Every rank's CPU weights onto huge pages now (for an engine that is never idle)."""
        self.executor.finish_weight_move()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
        if self.scheduler.kv_transfer is not None:
            self.scheduler.kv_transfer.connector.shutdown()
