"""CUDA graphs for decode steps ("captured mode", vLLM's full CUDA graphs for uniform decode).

A decode step launches hundreds of small kernels whose CPU launch cost exceeds their GPU time
at small batches. After the KV cache is allocated, `CUDAGraphRunner.capture` records the
model's forward once per capture size N (largest first, all graphs sharing one memory pool)
over persistent buffers: the token inputs (`input_ids`, `positions`, and whatever else the
forward takes per token) and the attention inputs (`query_start_loc`, `seq_lens`,
`block_table`, `slot_mapping`). At run time a decode-only batch of n <= max(N) requests
(one new token each) is copied into those buffers in place, padded to the next captured
size N, and the graph is replayed; any other batch (prefill chunks, speculative tokens, more
requests than the largest size) runs eagerly. Padding requests have no query rows and an
empty context (their query_start_loc stays at n, seq_len 0) and their slots are -1, so the
attention kernels skip them and their token rows come out as zeros nobody reads.

Only an attention backend that never reads a device value back to the host and sizes its
launches from host integers fixed at capture time can be captured (`supports_cuda_graph`:
TRITON_ATTN); `--enforce-eager` turns captured mode off.

The runner is generic over the forward's per-token inputs (`token_inputs`: name -> dtype and
trailing shape) so a pipeline stage can add its intermediate tensors. The graph's output is
a static buffer: valid until the next replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, then every 16 up to 512.
_DEFAULT_MAX_CAPTURE_SIZE = 512

Forward = Callable[[dict[str, torch.Tensor], Any], torch.Tensor]


def default_capture_sizes(
    max_num_seqs: int, max_size: int = _DEFAULT_MAX_CAPTURE_SIZE
) -> list[int]:
    """vLLM's list up to `max_size`, cut after the first size that holds `max_num_seqs`
    requests (a decode batch never has more)."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    sizes = [s for s in sizes if s <= max_size]
    covering = bisect.bisect_left(sizes, max_num_seqs)
    return sizes[: covering + 1]


def capture_sizes(config: EngineConfig) -> list[int]:
    """The sizes to capture: `compilation_config.cudagraph_capture_sizes`, else the default
    list up to `max_cudagraph_capture_size` (512) capped by max_num_seqs."""
    cc = config.compilation_config
    if cc.cudagraph_capture_sizes is not None:
        return sorted(set(cc.cudagraph_capture_sizes))
    max_size = cc.max_cudagraph_capture_size or _DEFAULT_MAX_CAPTURE_SIZE
    return default_capture_sizes(config.scheduler_config.max_num_seqs, max_size)


def use_cuda_graphs(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """Captured mode: on CUDA, unless enforce_eager, a KV connector or more than one rank, with
    a backend that can be captured and at least one capture size (`cudagraph_capture_sizes=[]`
    turns it off, as in vLLM)."""
    if device.type != "cuda" or config.enforce_eager:
        return False
    if config.kv_transfer_config is not None:
        # The connector's per-layer load / save hooks are Python a graph replay would skip.
        logger.info("a KV connector is configured: decode runs eagerly (no CUDA graphs)")
        return False
    if config.parallel_config.world_size > 1:
        # The collectives (NCCL all-reduce, the stage-to-stage sends) stay outside graphs.
        logger.info("tensor / pipeline parallelism: decode runs eagerly (no CUDA graphs)")
        return False
    if not getattr(backend, "supports_cuda_graph", False):
        logger.info(
            "attention backend %s cannot be captured in CUDA graphs: decode runs eagerly",
            backend.name,
        )
        return False
    return bool(capture_sizes(config))


class CUDAGraphRunner:
    """Captures `forward(token_inputs, attn_metadata)` per size and replays decode batches.

    `token_inputs`: per-token input name -> (dtype, trailing shape), e.g. `input_ids` ->
    (int64, ()); `max_blocks_per_req`: block-table width (max_model_len / block_size).
    """

    def __init__(
        self,
        forward: Forward,
        backend: AttentionBackend,
        sizes: list[int],
        token_inputs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        assert sizes and min(sizes) >= 1, sizes  # CompilationConfig validated them
        self.forward = forward
        self.backend = backend
        self.sizes = sorted(set(sizes))
        self.block_size = block_size
        self.device = device
        n = self.sizes[-1]
        self.inputs = {
            name: torch.zeros((n, *shape), dtype=dtype, device=device)
            for name, (dtype, shape) in token_inputs.items()
        }
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((n, max_blocks_per_req), dtype=torch.int32, device=device)
        # size -> (replay, its static output)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._pool: Any = None
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size holding `num_reqs` requests; None above the largest."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def size_for(self, common: CommonAttentionMetadata) -> int | None:
        """The captured size that runs this batch, or None (run it eagerly): only decode-only
        batches (one new token per request) that fit the largest size replay a graph."""
        if common.max_query_len != 1 or common.num_actual_tokens != common.num_reqs:
            return None
        if common.block_table.shape[1] > self.block_table.shape[1]:
            return None
        return self.padded_size(common.num_reqs)

    # ---- buffers ------------------------------------------------------------------------

    def _metadata(self, size: int) -> Any:
        """The backend's metadata over the buffers' first `size` rows (built once per size:
        the graph reads the buffers, which are refilled in place before each replay)."""
        common = CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=np.arange(size + 1, dtype=np.int64),
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=np.ones(size, dtype=np.int32),  # unused by capturable backends
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
            block_size=self.block_size,
        )
        return self.backend.build_metadata(common)

    def prepare(
        self, size: int, token_inputs: dict[str, torch.Tensor], common: CommonAttentionMetadata
    ) -> None:
        """Copy a decode batch of n = common.num_reqs requests into the buffers in place,
        padded to `size` with empty requests; device-to-device copies, no host sync."""
        n = common.num_reqs
        for name, buf in self.inputs.items():
            buf[:n].copy_(token_inputs[name][:n])
            buf[n:size].zero_()
        self.query_start_loc[: n + 1].copy_(common.query_start_loc)
        self.query_start_loc[n + 1 : size + 1].fill_(n)
        self.seq_lens[:n].copy_(common.seq_lens)
        self.seq_lens[n:size].zero_()
        self.slot_mapping[:n].copy_(common.slot_mapping[:n])
        self.slot_mapping[n:size].fill_(-1)
        self.block_table[:n, : common.block_table.shape[1]].copy_(common.block_table)

    def _fill_dummy(self, size: int) -> None:
        """A valid decode batch for capture: each request a 1-token context in block 0 whose
        K/V write is skipped (slot -1)."""
        for buf in self.inputs.values():
            buf[:size].zero_()
        self.query_start_loc[: size + 1].copy_(torch.arange(size + 1, device=self.device))
        self.seq_lens[:size].fill_(1)
        self.slot_mapping[:size].fill_(-1)
        self.block_table[:size].zero_()

    # ---- capture and replay -----------------------------------------------------------

    def capture(self) -> None:
        """Record one graph per size, largest first (smaller ones reuse its pool memory)."""
        t0 = time.monotonic()
        for size in reversed(self.sizes):
            self._fill_dummy(size)
            inputs = {name: buf[:size] for name, buf in self.inputs.items()}
            meta = self._metadata(size)
            self.forward(inputs, meta)  # warm-up outside the graph: lazy inits, JIT compiles
            self.graphs[size] = self._record(inputs, meta)
        logger.info(
            "captured %d CUDA graphs for decode batches of %d..%d requests in %.1fs",
            len(self.sizes),
            self.sizes[0],
            self.max_size,
            time.monotonic() - t0,
        )

    def _record(self, inputs: dict[str, torch.Tensor], meta: Any) -> tuple[Callable, torch.Tensor]:
        """Record the forward into a CUDA graph -> (replay, static output)."""
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(inputs, meta)
        return graph.replay, out

    def run(
        self, size: int, token_inputs: dict[str, torch.Tensor], common: CommonAttentionMetadata
    ) -> torch.Tensor:
        """Replay the graph of `size` on this batch -> the forward's output rows [n, ...]
        (a view of the static output, valid until the next replay)."""
        self.prepare(size, token_inputs, common)
        replay, out = self.graphs[size]
        replay()
        self.num_replays += 1
        return out[: common.num_reqs]
