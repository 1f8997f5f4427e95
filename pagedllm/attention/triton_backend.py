"""Paged attention in Triton: the default on CUDA (vLLM's TRITON_ATTN).

Same KV-cache layout as the torch backend (`[2, num_blocks, block_size, num_kv_heads,
head_size]`), in the model's dtype or fp8 (`kv_cache_dtype`, stored by the same rule:
ops/triton/fp8.py), so either backend reads what the other wrote. Per layer: one launch of
`reshape_and_cache` writes the step's keys and values at their slots (negative slots, padding,
skipped), then one launch of `unified_attention` attends every request, prefill chunks and
decodes alike, over its paged context.

`build_metadata` only keeps references to the device tensors of `CommonAttentionMetadata`;
nothing here reads a device value back to the host, and a launch's grid depends on host
integers only (rows and requests), so a forward can be captured in a CUDA graph
(`supports_cuda_graph`): the graph runner builds this metadata once per captured size over
its persistent buffers and refills them in place before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales
from pagedllm.attention.torch_backend import TorchAttentionBackend


@dataclass
class TritonAttentionMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, < 0: padding


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels of `pagedllm/ops/triton/`."""

    name = "TRITON_ATTN"
    supports_cuda_graph = True

    def __init__(self) -> None:
        # Imported here: importing the kernels defines them (interpreted or compiled, fixed by
        # TRITON_INTERPRET at that moment), which only a process that selects Triton should do.
        from pagedllm.ops.triton.reshape_and_cache import reshape_and_cache
        from pagedllm.ops.triton.unified_attention import unified_attention

        self._reshape_and_cache = reshape_and_cache
        self._unified_attention = unified_attention

    get_kv_cache_shape = staticmethod(TorchAttentionBackend.get_kv_cache_shape)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        qsl = common.query_start_loc
        return TritonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=qsl if qsl.dtype == torch.int32 else qsl.to(torch.int32),
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
        )

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: TritonAttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        self._reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        # Zeroed: rows past the real tokens (padding) are never written by the kernel.
        out = torch.zeros_like(query, memory_format=torch.contiguous_format)
        return self._unified_attention(
            out,
            query,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            kv_scales,
        )
