"""Executor: runs the workers. The engine core talks only to this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput

FailureCallback = Callable[[str], None]


class Executor(ABC):
    """Owns the workers' lifetime; `execute_model` returns the driver worker's output.

    Contract: `determine_num_kv_blocks` is agreed over all workers (the minimum), then
    `initialize_kv_cache`, then any number of `execute_model` calls. With
    `max_concurrent_batches > 1` (pipeline parallel), `execute_model(..., non_block=True)`
    returns a Future and up to that many batches may be in flight; their outputs come back in
    submission order. A worker that dies makes every pending and later call raise, and calls
    the registered failure callback once (so an idle engine notices too).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callback: FailureCallback | None = None
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The class for `parallel_config.distributed_executor_backend` (resolved by
        EngineArgs; unset counts as 'uni' for one rank and 'mp' otherwise)."""
        parallel = config.parallel_config
        backend = parallel.distributed_executor_backend or (
            "uni" if parallel.world_size == 1 else "mp"
        )
        if backend == "uni":
            from pagedllm.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from pagedllm.executor.multiproc_executor import MultiProcExecutor

            return MultiProcExecutor
        if backend == "ray":
            from pagedllm.executor.ray_executor import RayDistributedExecutor

            return RayDistributedExecutor
        raise ValueError(f"distributed_executor_backend={backend!r} is not supported")

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches the engine may keep in flight: one per pipeline stage."""
        return 1

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """`callback(reason)` runs (on some thread) when a worker dies."""
        self._failure_callback = callback

    def _report_failure(self, reason: str) -> None:
        if self._failure_callback is not None:
            self._failure_callback(reason)

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def determine_num_kv_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]: ...

    def idle_work(self) -> bool:
        """The next piece of every worker's idle work (Worker.idle_work); whether any
        remains."""
        return False

    def finish_weight_move(self) -> None:
        """Every worker's CPU weights onto huge pages now (Worker.finish_weight_move)."""
        return None

    def shutdown(self) -> None:
        return None


class WorkerDiedError(RuntimeError):
    """A worker died or failed; the executor is unusable from then on."""


class DistributedExecutor(Executor):
    """What the multi-rank executors share: every call runs on all ranks (`collective_rpc`),
    KV-cache sizes are agreed as the minimum over ranks, and `execute_model` returns the
    driver's output (the first tensor-parallel rank of the last pipeline stage)."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        super().__init__(config)

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> Any:
        """Run `Worker.<method>(*args)` on every rank; the list of their results, or only
        `unique_reply_rank`'s result. `non_block`: a Future of it."""

    def determine_num_kv_blocks(self) -> int:
        # Every rank holds the same block ids over its own layers: the smallest budget wins.
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def idle_work(self) -> bool:
        return any(self.collective_rpc("idle_work"))

    def finish_weight_move(self) -> None:
        self.collective_rpc("finish_weight_move")

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self.collective_rpc(
            "execute_model", (scheduler_output,), unique_reply_rank=self.output_rank,
            non_block=non_block,
        )  # fmt: skip
