"""One worker in the engine-core process itself."""

from __future__ import annotations

from concurrent.futures import Future

from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.execute_model(scheduler_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def idle_work(self) -> bool:
        return self.worker.idle_work()

    def finish_weight_move(self) -> None:
        self.worker.finish_weight_move()

    def shutdown(self) -> None:
        self.worker.shutdown()
