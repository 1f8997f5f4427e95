"""Paged attention on the CPU: decodes read K/V straight from the paged cache (native kernel).

`CpuAttentionBackend` is `TorchAttentionBackend` except for decode requests (query_len 1) of
bf16 and fp32 caches: instead of gathering their blocks into a padded buffer and masking, one native
call (`torch.ops.pagedllm.paged_decode_attention`, `pagedllm/ops/csrc/attention.h`) walks
each request's block table, one (request, KV head) pair per work item, its query heads
sharing every K/V row read. Prefills and short multi-token queries keep the SDPA path. The
step's K/V rows go into the cache by one native row copy (`reshape_and_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    _rows,
)


@dataclass
class NativeDecodes:
    """The step's decode requests, for the native kernel."""

    rows: torch.Tensor | slice  # their rows of the flattened batch
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seq_len: int


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    decodes: NativeDecodes | None = None


class CpuAttentionBackend(TorchAttentionBackend):
    """`TorchAttentionBackend` with decodes attended by the native paged kernel; for bf16
    and fp32 KV caches (the selector picks it only then), with `ops` = `torch.ops.pagedllm`."""

    name = "cpu"
    metadata_cls = CpuAttentionMetadata

    def __init__(self, ops, max_batched_query_len: int = 8) -> None:
        super().__init__(max_batched_query_len)
        self.ops = ops

    def _take_decodes(
        self, meta: TorchAttentionMetadata, common: CommonAttentionMetadata, decodes: np.ndarray
    ) -> np.ndarray:
        if not len(decodes):
            return decodes
        dev = common.block_table.device
        qsl = np.asarray(common.query_start_loc_cpu, dtype=np.int64)
        if len(decodes) == common.num_reqs:
            table, seq_lens = common.block_table, common.seq_lens
        else:
            idx = torch.from_numpy(decodes).to(dev)
            table = common.block_table.index_select(0, idx)
            seq_lens = common.seq_lens.index_select(0, idx)
        meta.decodes = NativeDecodes(
            rows=_rows(qsl[decodes], dev),
            block_table=table,
            seq_lens=seq_lens,
            max_seq_len=int(np.asarray(common.seq_lens_cpu)[decodes].max()),
        )
        return decodes[:0]

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: TorchAttentionMetadata,
    ) -> None:
        """The step's K/V rows into their cache slots: one native call (a row copy each)."""
        if metadata.num_actual_tokens:
            self.ops.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: CpuAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        d = metadata.decodes
        if d is not None and isinstance(d.rows, slice) and d.rows == slice(0, query.shape[0]):
            # A decode-only step: the kernel writes every row of the output.
            self.write_kv(key, value, kv_cache, metadata)
            return self.ops.paged_decode_attention(
                query, kv_cache, d.block_table, d.seq_lens, d.max_seq_len, scale
            )
        out = super().forward(query, key, value, kv_cache, metadata, scale)  # writes K/V first
        if d is not None:
            rows = d.rows
            q = query[rows] if isinstance(rows, slice) else query.index_select(0, rows)
            o = self.ops.paged_decode_attention(
                q, kv_cache, d.block_table, d.seq_lens, d.max_seq_len, scale
            )
            if isinstance(rows, slice):
                out[rows] = o
            else:
                out.index_copy_(0, rows, o)
        return out
