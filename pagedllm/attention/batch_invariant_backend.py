"""`BATCH_INVARIANT` attention: every query row computed in one fixed order, whatever else
its step holds (the attention of batch-invariant mode, `layers/batch_invariant.py`).

Algorithm. After the step's K/V rows are written to the cache, each request's blocks are
gathered (keys padded to the step's longest request) and, for a query row at position p of
head h (float32 throughout):

    s_j = scale * cumsum_d(q_d * k_jd)[D - 1]           j <= p; masked (-inf) past p
    m   = max_j s_j                                     (exact, order-free)
    e_j = det_exp(s_j - m)
    out = cumsum_j(e_j * v_j)[p] / cumsum_j(e_j)[p]

Decodes are attended together (keys padded to the longest); a longer query request by
request, in chunks of rows, each reading keys only up to its own last row. A CPU `cumsum` is a
sequential loop along its dimension, so the value read at index p is
the same left-to-right sum over keys 0..p however long the padded row is, and an elementwise
op gives the same bits wherever its element sits. The result is thus a function of the row's
own query and its keys 0..p: the same in a prefill, a chunk of one, a decode, a batch of
one or of hundreds; grouping and chunking (which bound the [rows, H, L, D] temporaries)
change no row's numbers.

An fp8 cache (`kv_cache_dtype`) takes the torch backend's quantized write; its K/V are read
back as the float32 above, exactly (attention/fp8_kv.py), so the order argument is unchanged.

The cost: O(rows * H * L * D) memory traffic in float32 with no matrix-multiply kernel, a
few times the default backends' time (see BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales, dequantize_kv
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.layers.batch_invariant import det_exp

# Elements of a chunk's [rows, H, L, D] temporaries (float32): about 16 MB each.
_CHUNK_ELEMENTS = 1 << 22


@dataclass
class BatchInvariantMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    block_size: int
    # Decodes (query_len 1), attended together: their rows, blocks and positions.
    decode_rows: torch.Tensor | None  # [Bd] int64
    decode_block_ids: torch.Tensor | None  # [Bd * max_blocks] int64 (unused: block 0)
    decode_pos: torch.Tensor | None  # [Bd] int64
    # Longer queries, one by one: (first row, rows, first position, block ids [n] int64).
    prefills: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)


class BatchInvariantAttentionBackend(TorchAttentionBackend):
    """Paged attention whose per-row result does not depend on the batch (module docstring).
    The cache layout and the K/V write are the torch backend's."""

    name = "BATCH_INVARIANT"

    def __init__(self) -> None:
        super().__init__()

    def build_metadata(self, common: CommonAttentionMetadata) -> BatchInvariantMetadata:
        qsl = np.asarray(common.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(common.seq_lens_cpu, dtype=np.int64)
        query_lens = np.diff(qsl)
        bs = common.block_size
        dev = common.block_table.device
        need = -(-seq_lens // bs)  # [num_reqs] blocks per request
        meta = BatchInvariantMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            block_size=bs,
            decode_rows=None,
            decode_block_ids=None,
            decode_pos=None,
        )
        decodes = np.flatnonzero(query_lens == 1)
        if len(decodes):
            nb = int(need[decodes].max())
            idx = torch.from_numpy(decodes).to(dev)
            table = common.block_table.index_select(0, idx)[:, :nb].long()
            own = (
                torch.arange(nb, device=dev)[None, :]
                < torch.from_numpy(need[decodes]).to(dev)[:, None]
            )
            # Entries past a request's own blocks may be stale or -1: block 0 instead (masked,
            # and a sum read at the row's own position never reaches them).
            meta.decode_block_ids = torch.where(own, table, 0).reshape(-1)
            meta.decode_rows = torch.from_numpy(qsl[decodes]).to(dev)
            meta.decode_pos = torch.from_numpy(seq_lens[decodes] - 1).to(dev)
        for r in np.flatnonzero(query_lens > 1).tolist():
            ids = common.block_table[r, : int(need[r])].long()
            start, n = int(qsl[r]), int(query_lens[r])
            meta.prefills.append((start, n, int(seq_lens[r]) - n, ids))
        return meta

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: BatchInvariantMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        _, num_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[3]
        self.write_kv(key, value, kv_cache, metadata, kv_scales)
        out = torch.zeros_like(query)
        per_row = num_heads * head_size  # temporaries' elements per (row, key)

        def read(plane: int, block_ids: torch.Tensor) -> torch.Tensor:
            """Blocks of keys (0) or values (1); an fp8 cache's read with its scales in the
            query's dtype (exactly the fp8 values with unit scales: _attend widens them)."""
            t = kv_cache[plane].index_select(0, block_ids)
            if kv_scales.unit or t.dtype == query.dtype:
                return t
            return dequantize_kv(t, query.dtype, kv_scales.v if plane else kv_scales.k)

        if metadata.decode_rows is not None:
            rows, pos = metadata.decode_rows, metadata.decode_pos
            k = read(0, metadata.decode_block_ids)
            v = read(1, metadata.decode_block_ids)
            k = k.view(rows.shape[0], -1, num_kv_heads, head_size)  # [Bd, L, Hkv, D]
            v = v.view(rows.shape[0], -1, num_kv_heads, head_size)
            step = max(1, _CHUNK_ELEMENTS // (per_row * k.shape[1]))
            for r0 in range(0, rows.shape[0], step):
                r1 = r0 + step
                o = _attend(query[rows[r0:r1]], k[r0:r1], v[r0:r1], pos[r0:r1], scale)
                out.index_copy_(0, rows[r0:r1], o.to(query.dtype))
        for start, n, ctx, block_ids in metadata.prefills:
            k = read(0, block_ids).view(1, -1, num_kv_heads, head_size)
            v = read(1, block_ids).view(1, -1, num_kv_heads, head_size)
            step = max(1, _CHUNK_ELEMENTS // (per_row * k.shape[1]))
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                keys = ctx + r1  # the chunk's last row sees keys [0, ctx + r1)
                pos = torch.arange(ctx + r0, ctx + r1, device=query.device)
                o = _attend(query[start + r0 : start + r1], k[:, :keys], v[:, :keys], pos, scale)
                out[start + r0 : start + r1] = o.to(query.dtype)
        return out


def _attend(
    q: torch.Tensor,  # [R, H, D]
    k: torch.Tensor,  # [R or 1, L, Hkv, D]: each row's keys, or one request's for all rows
    v: torch.Tensor,  # [R or 1, L, Hkv, D]
    pos: torch.Tensor,  # [R] int64 position of each row (it sees keys 0..pos)
    scale: float,
) -> torch.Tensor:
    """[R, H, D] float32: each row's attention over its keys 0..pos, in the fixed order of
    the module docstring."""
    num_rows, num_heads, head_size = q.shape
    num_kv_heads, length = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    kt = k.float().permute(0, 2, 1, 3)[:, :, None]  # [R|1, Hkv, 1, L, D]
    vt = v.float().permute(0, 2, 1, 3)[:, :, None]  # [R|1, Hkv, 1, L, D]
    qg = q.float().view(num_rows, num_kv_heads, group, 1, head_size)  # [R, Hkv, G, 1, D]
    s = (qg * kt).cumsum(-1)[..., -1] * scale  # [R, Hkv, G, L]
    past = torch.arange(length, device=q.device)[None, :] > pos[:, None]  # [R, L]
    s = s.masked_fill(past[:, None, None, :], float("-inf"))
    e = det_exp(s - s.amax(dim=-1, keepdim=True))  # [R, Hkv, G, L]; 0 where masked
    at = pos.view(num_rows, 1, 1, 1).expand(-1, num_kv_heads, group, 1)  # [R, Hkv, G, 1]
    denom = e.cumsum(-1).gather(-1, at)  # [R, Hkv, G, 1]
    weighted = (e[..., None] * vt).cumsum(3)  # [R, Hkv, G, L, D]
    num = weighted.gather(3, at[..., None].expand(-1, -1, -1, -1, head_size))[..., 0, :]
    return (num / denom).view(num_rows, num_heads, head_size)
