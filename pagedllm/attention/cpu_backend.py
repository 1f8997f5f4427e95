"""Paged attention on the CPU: decodes read K/V straight from the paged cache (native kernel).

`CpuAttentionBackend` is `TorchAttentionBackend` except for decode requests (query_len 1) of
bf16 and fp32 models, over caches in their dtype or fp8 (`kv_cache_dtype`): instead of
gathering their blocks into a padded buffer and masking, one native call
(`torch.ops.pagedllm.paged_decode_attention`, `pagedllm/ops/csrc/attention.h`) walks each
request's block table, one (request, KV head) pair per work item, its query heads sharing
every K/V row read. Multi-token queries (prefills, their chunks, prefix-cache hits,
speculative tokens) go to the native prefill kernel on AVX2 CPUs (`paged_prefill_attention`:
all of a step's in one call, causal, K/V from the paged cache, an online softmax over blocks of
8 keys); elsewhere, or for a head size it lacks, the SDPA path. The step's K/V rows go into the
cache by one native row copy (`reshape_and_cache`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales
from pagedllm.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    _rows,
)

# Head sizes of the native prefill kernel (ops/csrc/attention.h, prefill_head_size_ok).
PREFILL_HEAD_SIZES = (32, 64, 80, 96, 128)


@dataclass
class NativeDecodes:
    """The step's decode requests, for the native kernel."""

    rows: torch.Tensor | slice  # their rows of the flattened batch
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seq_len: int


@dataclass
class NativeMulti:
    """The step's multi-token requests (prefills, chunks, prefix-cache hits), for the native
    prefill kernel: indices into the step's requests, and the step's per-request tensors."""

    reqs: torch.Tensor  # [P] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    common: CommonAttentionMetadata  # for the SDPA path (head sizes the kernel lacks)


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    decodes: NativeDecodes | None = None
    multi: NativeMulti | None = None


class CpuAttentionBackend(TorchAttentionBackend):
    """`TorchAttentionBackend` with decodes attended by the native paged kernel; for bf16
    and fp32 models with KV caches in their dtype or fp8 (the selector picks it only then),
    with `ops` = `torch.ops.pagedllm`."""

    name = "cpu"
    metadata_cls = CpuAttentionMetadata

    def __init__(self, ops, max_batched_query_len: int = 8) -> None:
        super().__init__(max_batched_query_len)
        self.ops = ops

    @functools.cached_property
    def _native_multi(self) -> bool:
        """Whether the native prefill kernel runs here (it is AVX2 + FMA code)."""
        return bool(self.ops.cpu_has_avx2_fma())

    def _take_multi(
        self, meta: TorchAttentionMetadata, common: CommonAttentionMetadata, reqs: np.ndarray
    ) -> np.ndarray:
        if not len(reqs) or not self._native_multi:
            return reqs
        meta.multi = NativeMulti(
            reqs=torch.from_numpy(reqs.astype(np.int64)),
            query_start_loc=torch.from_numpy(
                np.asarray(common.query_start_loc_cpu, dtype=np.int64)
            ),
            block_table=common.block_table,
            seq_lens=common.seq_lens,
            common=common,
        )
        return reqs[:0]

    def _sdpa_instead(self, meta: CpuAttentionMetadata) -> None:
        """A head size the native prefill kernel lacks: the multi-token requests go back to the
        SDPA path (one request at a time), decided at the step's first layer."""
        m, meta.multi = meta.multi, None
        meta.prefills = [self._build_prefill(m.common, r) for r in m.reqs.tolist()]
        gathers = [p.block_ids.shape[0] for p in meta.prefills if p.block_ids is not None]
        meta.max_gather_blocks = max([meta.max_gather_blocks, *gathers])

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

    def decode_only(self, metadata: CpuAttentionMetadata, num_tokens: int) -> NativeDecodes | None:
        """The step's decodes when every one of its `num_tokens` rows is one (a decode-only
        step), else None: for a caller that runs the whole layer natively
        (layers/cpu_fused.py), the K/V write and this backend's decode kernel included."""
        d = metadata.decodes
        if d is not None and isinstance(d.rows, slice) and d.rows == slice(0, num_tokens):
            return d
        return None

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: TorchAttentionMetadata,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> None:
        """The step's K/V rows into their cache slots: one native call (a row copy each)."""
        if metadata.num_actual_tokens:
            self.ops.reshape_and_cache(
                key, value, kv_cache, metadata.slot_mapping, kv_scales.k, kv_scales.v
            )

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: CpuAttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        if metadata.multi is not None and query.shape[2] not in PREFILL_HEAD_SIZES:
            self._sdpa_instead(metadata)
        d, m = metadata.decodes, metadata.multi
        ks, vs = kv_scales.k, kv_scales.v
        if self.decode_only(metadata, query.shape[0]) is not None:
            # A decode-only step: the kernel writes every row of the output.
            self.write_kv(key, value, kv_cache, metadata, kv_scales)
            return self.ops.paged_decode_attention(
                query, kv_cache, d.block_table, d.seq_lens, d.max_seq_len, scale, ks, vs
            )
        if m is None:  # (writes K/V)
            out = super().forward(query, key, value, kv_cache, metadata, scale, kv_scales)
        else:  # every request is native: the multi-token ones here, decodes below
            self.write_kv(key, value, kv_cache, metadata, kv_scales)
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            self.ops.paged_prefill_attention(
                query, out, kv_cache, m.block_table, m.seq_lens, m.query_start_loc, m.reqs,
                scale, ks, vs,
            )  # fmt: skip
            if metadata.num_actual_tokens < query.shape[0]:
                out[metadata.num_actual_tokens :].zero_()  # padding rows: defined values
        if d is not None:
            rows = d.rows
            q = query[rows] if isinstance(rows, slice) else query.index_select(0, rows)
            o = self.ops.paged_decode_attention(
                q, kv_cache, d.block_table, d.seq_lens, d.max_seq_len, scale, ks, vs
            )
            if isinstance(rows, slice):
                out[rows] = o
            else:
                out.index_copy_(0, rows, o)
        return out
