"""GPU memory sizing: how many KV blocks fit under `--gpu-memory-utilization`.

vLLM's rule. This engine may use `requested = gpu_memory_utilization * total` bytes of the
device. Beside the KV cache that holds the weights, the activation peak of the largest step
the scheduler can send, and whatever the process holds outside PyTorch's allocator (CUDA
context, cuBLAS workspaces). So the worker

1. notes the free memory at start-up (fewer free bytes than `requested` is an error: another
   process holds the memory this engine was promised),
2. measures the weights as the allocator's growth over loading,
3. runs one profiling forward (`profile_run`): `max_num_batched_tokens` tokens spread over
   `min(max_num_seqs, max_num_batched_tokens)` fresh prompts, then logits and top-k/top-p
   sampling for each, and reads the allocator's peak above its level before the run,
4. counts as non-torch memory the process's growth in used device memory that PyTorch has not
   reserved,

and gives the KV cache `requested - weights - peak - non_torch` bytes. An explicit
`num_gpu_blocks_override` wins over all of it. Memory is read through a `MemoryReader`, so the
arithmetic and the flow are tested on the CPU with a fake one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GIB = 1 << 30


class MemoryReader(Protocol):
    """What the sizing reads from a device (torch.cuda's functions of the same names)."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes on the device

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def memory_reserved(self) -> int: ...

    def reset_peak_memory_stats(self) -> None: ...

    def empty_cache(self) -> None: ...


class CudaMemoryReader:
    """`MemoryReader` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass
class MemoryProfile:
    """Bytes of one device, as measured for sizing the KV cache."""

    total: int
    utilization: float
    weights: int
    activation_peak: int
    non_torch: int

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def kv_cache_bytes(self) -> int:
        """What is left for the KV cache (may be <= 0: nothing fits)."""
        return self.requested - self.weights - self.activation_peak - self.non_torch

    def describe(self, num_blocks: int) -> str:
        return (
            f"GPU memory: {self.total / _GIB:.2f} GiB total x gpu_memory_utilization "
            f"{self.utilization} = {self.requested / _GIB:.2f} GiB; weights "
            f"{self.weights / _GIB:.2f} GiB, activation peak {self.activation_peak / _GIB:.2f} "
            f"GiB, non-torch {self.non_torch / _GIB:.2f} GiB -> KV cache "
            f"{self.kv_cache_bytes / _GIB:.2f} GiB ({num_blocks} blocks)"
        )


@dataclass
class StartupMemory:
    free: int  # bytes free on the device
    reserved: int  # bytes PyTorch's allocator held


def check_free_at_start(reader: MemoryReader, utilization: float) -> StartupMemory:
    """The device's memory now (at start-up); a ValueError when fewer bytes are free than this
    engine may use."""
    reader.empty_cache()
    free, total = reader.mem_get_info()
    if free < int(total * utilization):
        raise ValueError(
            f"the GPU has {free / _GIB:.2f} GiB free of {total / _GIB:.2f} GiB at start-up, "
            f"less than gpu_memory_utilization={utilization} asks for "
            f"({total * utilization / _GIB:.2f} GiB): another process holds GPU memory; "
            "lower gpu_memory_utilization"
        )
    return StartupMemory(free, reader.memory_reserved())


def profile_memory(
    reader: MemoryReader,
    utilization: float,
    at_start: StartupMemory,
    weights: int,
    run: Callable[[], None],
) -> MemoryProfile:
    """Run `run()` (the profiling forward) and measure what the KV cache must leave free."""
    reader.empty_cache()
    reader.reset_peak_memory_stats()
    before = reader.memory_allocated()
    run()
    activation_peak = max(reader.max_memory_allocated() - before, 0)
    reader.empty_cache()
    free, total = reader.mem_get_info()
    # The process's growth in device memory that PyTorch's allocator does not account for.
    growth = at_start.free - free
    non_torch = max(growth - (reader.memory_reserved() - at_start.reserved), 0)
    return MemoryProfile(total, utilization, weights, activation_peak, non_torch)


@torch.inference_mode()
def profile_run(runner: ModelRunner, num_tokens: int, num_reqs: int) -> None:
    """One forward of `num_tokens` tokens over `num_reqs` fresh prompts on a scratch KV cache
    (freed afterwards; `initialize_kv_cache` binds the real one), then the logits of each
    prompt's last token and top-k/top-p sampling of them: the largest step's activations."""
    num_reqs = max(1, min(num_reqs, num_tokens))
    device = runner.device
    lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    lens[: num_tokens % num_reqs] += 1
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with runner.scratch_prompts(lens) as (common, positions):
        # Every rank runs this together: a stage's forward receives from the previous stage,
        # and only the ranks holding the LM head (the last stage) compute logits and sample.
        hidden = runner.forward(common, input_ids, positions)
        if hidden is not None:
            last_rows = torch.from_numpy(np.cumsum(lens) - 1).to(device)
            logits = runner.model.compute_logits(hidden[last_rows])
            if logits is not None:  # the driver's gathered vocabulary
                params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
                metadata = SamplingMetadata.build(
                    [params] * num_reqs,
                    [[0]] * num_reqs,
                    [[] for _ in range(num_reqs)],
                    [None] * num_reqs,
                    vocab_size=logits.shape[-1],
                    device=device,
                )
                runner.sampler(logits, metadata, overwrite=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
