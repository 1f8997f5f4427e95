"""Worker: owns one device, its model runner and its slice of the KV cache."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """One process's share of the model. With tensor parallelism there is one per rank."""

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        device_type = self.config.device_config.device
        if device_type == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # Unseeded random sampling draws from the global generator: seed it once.
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: an explicit override, the CPU byte budget, or what the GPU
        has left after the weights and a profiling forward pass. The default CPU budget is
        capped at what the scheduler can ever hold at once (max_num_seqs requests of
        max_model_len tokens): a small model never reserves the whole default."""
        cache = self.config.cache_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_now = total - free
            budget = int(total * cache.gpu_memory_utilization) - used_now
            # Leave room for the activations of one full-budget step (a rough upper bound).
            mc = self.config.model_config
            act = (
                self.config.scheduler_config.max_num_batched_tokens
                * (mc.hidden_size * 8 + mc.vocab_size)
                * 4
            )
            return max(budget - act, 0) // per_block
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes // per_block
        sched = self.config.scheduler_config
        # +1 block a request: speculative tokens may reach one block past max_model_len.
        usable = sched.max_num_seqs * (-(-sched.max_model_len // cache.block_size) + 1)
        num_blocks = min(cache.DEFAULT_CPU_KV_CACHE_BYTES // per_block, usable)
        logger.info(
            "KV cache: %d blocks, %.1f MiB (the default %d GiB, capped at max_num_seqs=%d "
            "requests of max_model_len=%d tokens; --kv-cache-memory-bytes sets it)",
            num_blocks,
            num_blocks * per_block / 2**20,
            cache.DEFAULT_CPU_KV_CACHE_BYTES >> 30,
            sched.max_num_seqs,
            sched.max_model_len,
        )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
