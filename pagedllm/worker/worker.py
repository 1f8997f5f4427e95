"""Worker: owns one device, its model runner and its slice of the KV cache."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.distributed import destroy_distributed, init_distributed
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.gpu_memory import (
    CudaMemoryReader,
    MemoryReader,
    StartupMemory,
    check_free_at_start,
    profile_memory,
    profile_run,
)
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """One process's share of the model: one per rank (tensor x pipeline parallel), the same
    class in-process (`UniProcExecutor`), in a worker process (`MultiProcExecutor`) or in a Ray
    actor (`RayDistributedExecutor`).

    `distributed_init_method` (e.g. `tcp://HOST:PORT`) is where the ranks meet when the world
    has more than one; `node_id` names the machine (ranks sharing one use shared memory)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str = "env://",
        node_id: str = "",
        memory_reader: MemoryReader | None = None,
    ) -> None:
        """`memory_reader`: where GPU memory is read for sizing the KV cache (on CUDA the
        device's own by default; tests pass a fake one on the CPU). Without one the KV cache
        is sized by `kv_cache_memory_bytes`."""
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.node_id = node_id
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.memory_reader = memory_reader
        self.memory_at_start: StartupMemory | None = None
        self.weights_memory = 0  # device bytes the weights took

    def init_device(self) -> None:
        device_type = self.config.device_config.device
        if device_type == "cuda":
            self.device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(self.device)
            self.memory_reader = self.memory_reader or CudaMemoryReader(self.device)
        else:
            self.device = torch.device("cpu")
        parallel = self.config.parallel_config
        if parallel.world_size > 1:
            init_distributed(
                parallel.world_size,
                self.rank,
                tensor_parallel_size=parallel.tensor_parallel_size,
                distributed_init_method=self.distributed_init_method,
                backend="nccl" if device_type == "cuda" else "gloo",
                node_id=self.node_id,
            )
        if self.memory_reader is not None:
            utilization = self.config.cache_config.gpu_memory_utilization
            self.memory_at_start = check_free_at_start(self.memory_reader, utilization)
        # Unseeded random sampling draws from the global generator: seed it once.
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        before = self.memory_reader.memory_allocated() if self.memory_reader else 0
        self.model_runner.load_model()
        if self.memory_reader is not None:
            self.weights_memory = self.memory_reader.memory_allocated() - before

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit: `num_gpu_blocks_override`, else `kv_cache_memory_bytes`,
        else on a GPU what `gpu_memory_utilization` leaves after the weights and a profiling
        forward pass (worker/gpu_memory.py), else the CPU default, capped at what the
        scheduler can ever hold at once (max_num_seqs requests of max_model_len tokens): a
        small model never reserves the whole default."""
        cache = self.config.cache_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        # Per worker, like vLLM's VLLM_CPU_KVCACHE_SPACE: each rank holds its own layers' share.
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes // per_block
        if self.memory_reader is not None:
            sched = self.config.scheduler_config
            profile = profile_memory(
                self.memory_reader,
                cache.gpu_memory_utilization,
                self.memory_at_start,
                self.weights_memory,
                lambda: profile_run(
                    self.model_runner, sched.max_num_batched_tokens, sched.max_num_seqs
                ),
            )
            num_blocks = max(profile.kv_cache_bytes, 0) // per_block
            logger.info(profile.describe(num_blocks))
            return num_blocks
        sched = self.config.scheduler_config
        # +1 block a request: speculative tokens may reach one block past max_model_len.
        usable = sched.max_num_seqs * (-(-sched.max_model_len // cache.block_size) + 1)
        num_blocks = min(cache.DEFAULT_CPU_KV_CACHE_BYTES // per_block, usable)
        logger.info(
            "KV cache: %d blocks, %.1f MiB of %s (the default %d GiB, capped at max_num_seqs=%d "
            "requests of max_model_len=%d tokens; --kv-cache-memory-bytes sets it)",
            num_blocks,
            num_blocks * per_block / 2**20,
            str(self.config.kv_cache_torch_dtype).removeprefix("torch."),
            cache.DEFAULT_CPU_KV_CACHE_BYTES >> 30,
            sched.max_num_seqs,
            sched.max_model_len,
        )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode CUDA graphs over it (CUDA only).
        With calculate_kv_scales, first the fp8 cache's scales (worker/kv_scales.py)."""
        if self.config.cache_config.calculate_kv_scales:
            from pagedllm.worker.kv_scales import calculate_kv_scales

            calculate_kv_scales(self.model_runner)
        self.model_runner.initialize_kv_cache(num_blocks)
        self.model_runner.capture_model()

    def idle_work(self) -> bool:
        """While the engine is idle: the next piece of the weights' move onto huge pages or
        of the CPU KV cache's faulting in; whether any remains (ModelRunner.idle_work)."""
        return self.model_runner.idle_work()

    def finish_weight_move(self) -> None:
        self.model_runner.finish_weight_move()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on the rank that samples (the first tensor-parallel rank of the
        last pipeline stage); None on the others."""
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.model_runner is not None:
            self.model_runner.shutdown()
        if self.config.parallel_config.world_size > 1:
            destroy_distributed()
