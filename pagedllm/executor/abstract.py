"""Executor: runs the workers. The engine core talks only to this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput


class Executor(ABC):
    """Owns the workers' lifetime; `execute_model` returns the driver worker's output."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        if config.parallel_config.world_size == 1:
            from pagedllm.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        raise ValueError(
            f"tensor_parallel_size={config.parallel_config.tensor_parallel_size} / "
            f"pipeline_parallel_size={config.parallel_config.pipeline_parallel_size}: "
            "multi-device execution is not available yet; use 1"
        )

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def determine_num_kv_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        return None
