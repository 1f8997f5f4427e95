"""The attention-backend seam: the only place device-specific attention code plugs in.

The model runner builds one `CommonAttentionMetadata` per step (the flattened batch described
by offsets, lengths, block tables and slot mappings) and hands it to the backend's
`build_metadata`, once; every attention layer then calls `backend.forward` with its own
per-layer KV-cache tensor and the built metadata.

Flattened batch: the new tokens of all scheduled requests are concatenated, request i owning
rows `query_start_loc[i]:query_start_loc[i+1]`. Request i's context after this step holds
`seq_lens[i]` tokens; its new tokens are the last `query_len_i` of them (so positions run
`seq_lens[i] - query_len_i ... seq_lens[i] - 1`) and attend causally to everything before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales


@dataclass
class CommonAttentionMetadata:
    num_reqs: int
    num_actual_tokens: int  # rows of q/k/v that are real (inputs may be padded past this)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    query_start_loc_cpu: np.ndarray  # same, on the host (int64)
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    seq_lens_cpu: np.ndarray  # same, on the host
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64: block_id * block_size + offset
    max_query_len: int
    max_seq_len: int
    block_size: int

    @classmethod
    def from_numpy(
        cls,
        query_start_loc: np.ndarray,  # [num_reqs + 1]
        seq_lens: np.ndarray,  # [num_reqs]
        block_table: np.ndarray,  # [num_reqs, max_blocks_per_req]
        slot_mapping: np.ndarray,  # [num_tokens]
        block_size: int,
        device: torch.device,
    ) -> CommonAttentionMetadata:
        """Build from host arrays (the runner prepares a step's batch with numpy)."""
        query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int32)
        return cls(
            num_reqs=len(seq_lens),
            num_actual_tokens=int(query_start_loc[-1]),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.from_numpy(seq_lens).to(device),
            seq_lens_cpu=seq_lens,
            block_table=torch.from_numpy(block_table).to(device),
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
        )

    @classmethod
    def for_spans(
        cls,
        block_table: np.ndarray,  # [num_reqs, max_blocks_per_req] int32
        first_pos: np.ndarray,  # [num_reqs] position of each request's first new token
        num_rows: np.ndarray,  # [num_reqs] new tokens per request, each >= 1
        block_size: int,
        device: torch.device,
        max_position: int | None = None,
    ) -> tuple[CommonAttentionMetadata, np.ndarray]:
        """Metadata for running `num_rows[r]` consecutive tokens of request r from position
        `first_pos[r]` -> (metadata, positions [N] int64). Positions past `max_position` are
        clamped to it."""
        num_reqs = len(num_rows)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_rows, out=cu[1:])
        req_idx = np.repeat(np.arange(num_reqs), num_rows)  # [N]
        positions = first_pos[req_idx] + (np.arange(int(cu[-1])) - cu[:-1][req_idx])  # [N]
        if max_position is not None:
            np.minimum(positions, max_position, out=positions)
        bs = block_size
        slots = block_table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = positions[cu[1:] - 1] + 1  # last position + 1
        return cls.from_numpy(cu, seq_lens, block_table, slots, bs, device), positions


class AttentionBackend(ABC):
    """Stateless per step except for what `build_metadata` returns."""

    name: str = "abstract"

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor (keys and values together)."""

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks `src[i]` into `dst[i]` in every layer's cache (copy-on-write of a
        block beams share). Reads all sources before writing, so a block may be both.
        Default layout: blocks on dimension 1 (`get_kv_cache_shape` of the torch backend);
        a backend with another layout overrides this."""
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Precompute whatever all layers of this step share (masks, index tensors)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # get_kv_cache_shape(...)
        metadata: Any,  # what build_metadata returned
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """Write key/value into kv_cache at metadata's slot mapping, then return the attention
        output [num_tokens, num_heads, head_size] of each new token over its request's
        cached context plus the new tokens up to itself. An fp8 cache stores and reads rows
        with the layer's `kv_scales` (attention/fp8_kv.py)."""
