"""Paged attention in plain PyTorch: one code path for the CPU and CUDA.

Algorithm. Each layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_size]` (keys
at index 0, values at 1). A step first scatters the new key/value rows into their slots with
one `index_copy_` each (rows viewed as `[num_slots, num_kv_heads * head_size]`). Attention then
runs over the scheduled requests, split by `build_metadata` into two kinds of work:

* Batched groups: requests with a short query (decodes, query_len 1; and, in a separate group,
  short multi-token queries such as speculative tokens, up to `max_batched_query_len`). Their
  blocks are gathered with one `index_select` of whole blocks per K and V (a block is one
  contiguous `block_size * num_kv_heads * head_size` run, so the gather is a memcpy of large
  pieces and needs no slot-level index), which yields `[B, Lpad, num_kv_heads, head_size]`
  that SDPA reads through a transposed view, without a further copy. One SDPA call per group
  covers it, with a boolean mask (built once per step) that hides the padding past each
  request's length and enforces causality for multi-token queries. For query_len 1 the
  `num_heads / num_kv_heads` query heads sharing a KV head are laid out as query rows of that
  KV head (`[B, num_kv_heads, group, head_size]`), so GQA/MQA needs no K/V expansion. A group
  whose lengths are very uneven is split (sorted by length, recursive best two-way cut) when
  the padding saved outweighs the fixed cost of another call.
* Long queries (prefill or chunked prefill) run request by request. Without cached context the
  request attends to its own new tokens only: SDPA reads `query/key/value` slices directly with
  `is_causal=True` and the cache is not read at all. With context (prefix-cache hit or earlier
  chunk) its blocks are gathered whole and a bottom-right causal mask (`key_pos <= ctx + i`)
  is applied, in chunks of query rows: chunk i reads only the keys up to its own last row
  (skipping most of the masked upper triangle, and bounding the mask's size), and every
  chunk's mask is a bottom-right-aligned slice of one `[chunk_rows, seq_len]` template.

Everything the layers share (group membership, block-id index tensors, masks, row indices and
the host-side bounds of each call) is built once in `build_metadata`; `forward` only issues
the scatter, gathers and SDPA calls, and never synchronizes with the device.

An fp8 cache (`kv_cache_dtype`, attention/fp8_kv.py) stores the rows quantized and the gathers
widen the blocks back to the query's dtype (one more copy, into a second workspace); a prefill
without context attends to the fp8 round trip of its own rows, so a request reads the same
K/V whether or not its tokens came from the cache (prefix-cache hit, earlier chunk,
preemption). A cache in the query's dtype takes none of these steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.fp8_kv import (
    UNIT_SCALES,
    KVScales,
    as_stored,
    quantize_kv,
    storage_view,
)

# A further batched SDPA call costs about as much as attending over this many padded key
# positions (CPU, a few heads of size 64-128); used only to decide when to split a group.
_GROUP_OVERHEAD_TOKENS = 512
# A prefill over cached context runs in chunks of at most this many query rows (each chunk
# skips the keys after its last row: ~20% faster than one call at 2k x 2k on the CPU), fewer
# when its mask ([rows, keys] elements) would exceed _MASK_BUDGET.
_PREFILL_CHUNK_ROWS = 256
_MASK_BUDGET = 1 << 22


@dataclass
class BatchedGroup:
    """Requests attended in one padded SDPA call (query_len <= max_batched_query_len)."""

    num_reqs: int
    max_query_len: int  # Qmax: queries are padded to this many rows per request
    num_blocks: int  # blocks gathered per request; keys padded to num_blocks * block_size
    # Rows of the flattened batch holding each request's queries, padded by repeating the last
    # row (so padded rows are well defined and never fully masked); a slice if contiguous.
    q_rows: torch.Tensor | slice  # [B * Qmax] int64
    block_ids: torch.Tensor  # [B * num_blocks] int64, unused entries point at block 0
    mask: torch.Tensor  # [B, 1, Qmax, num_blocks * block_size] bool, True = attend
    # Real rows of the padded [B * Qmax] result (None when Qmax == 1: all are real).
    out_src: torch.Tensor | None  # [n_real] int64
    out_rows: torch.Tensor | slice  # [n_real] int64 destination rows, or a slice if contiguous


@dataclass
class PrefillRequest:
    """One long query attended by its own SDPA call(s)."""

    start: int  # its rows in the flattened batch: start:end
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no context
    # Bottom-right causal template, True = attend: row r sees keys j <= seq_len - C + r. The
    # mask of a chunk of n rows whose last row is at key_len - 1 is mask[C - n:, seq_len -
    # key_len:]. None: no context, plain causal.
    mask: torch.Tensor | None  # [C, seq_len] bool
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (row start, end, key_len)


@dataclass
class TorchAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    block_size: int
    groups: list[BatchedGroup] = field(default_factory=list)
    prefills: list[PrefillRequest] = field(default_factory=list)
    max_gather_blocks: int = 0  # most blocks one call gathers (sizes the workspace)
    # Gather buffers reused by every layer of the step, keyed by (dtype, device), made by the
    # first layer. Fresh allocations of tens of MB per layer cost more than the gather on the
    # CPU (the allocator hands them back to the OS and page-faults them in again).
    workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def _buffer(
        self, dtype: torch.dtype, device: torch.device, n: int, block_numel: int
    ) -> torch.Tensor:
        """The step's workspace of `dtype` as [2, n, block_numel]."""
        buf = self.workspace.get((dtype, device))
        if buf is None or buf.numel() < 2 * self.max_gather_blocks * block_numel:
            buf = torch.empty((2, self.max_gather_blocks, block_numel), dtype=dtype, device=device)
            self.workspace[(dtype, device)] = buf
        return buf.view(-1)[: 2 * n * block_numel].view(2, n, block_numel)

    def gather_kv(
        self,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        dtype: torch.dtype,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks `block_ids` of keys and values in `dtype` (the query's), each
        [n, block_size * Hkv * D] (an fp8 cache's read with `kv_scales`)."""
        num_blocks_total = kv_cache.shape[1]
        block_numel = kv_cache[0, 0].numel()
        n = block_ids.shape[0]
        buf = self._buffer(kv_cache.dtype, kv_cache.device, n, block_numel)
        torch.index_select(kv_cache[0].view(num_blocks_total, -1), 0, block_ids, out=buf[0])
        torch.index_select(kv_cache[1].view(num_blocks_total, -1), 0, block_ids, out=buf[1])
        if kv_cache.dtype != dtype:  # an fp8 cache: widened (attention/fp8_kv.py)
            raw, buf = buf, self._buffer(dtype, kv_cache.device, n, block_numel)
            if kv_scales.unit:  # exactly
                buf.copy_(raw)
            else:  # times the scale in fp32, rounded to dtype
                buf[0].copy_(raw[0].float().mul_(kv_scales.k))
                buf[1].copy_(raw[1].float().mul_(kv_scales.v))
        return buf[0], buf[1]


def _split_by_length(
    lengths: list[int], overhead: int, max_ranges: int = 8
) -> list[tuple[int, int]]:
    """Cut `lengths` (sorted descending) into at most `max_ranges` ranges [lo, hi) so that the
    padded cost sum(count * first_length) plus `overhead` per range is small: recursive best
    two-way cut."""
    out: list[tuple[int, int]] = []
    todo = [(0, len(lengths))]
    while todo:
        lo, hi = todo.pop()
        best, best_cut = (hi - lo) * lengths[lo], -1
        for cut in range(lo + 1, hi if len(out) + len(todo) + 1 < max_ranges else lo + 1):
            cost = (cut - lo) * lengths[lo] + (hi - cut) * lengths[cut] + overhead
            if cost < best:
                best, best_cut = cost, cut
        if best_cut < 0:
            out.append((lo, hi))
        else:
            todo += [(best_cut, hi), (lo, best_cut)]
    return sorted(out)


def _rows(rows: np.ndarray, device: torch.device) -> torch.Tensor | slice:
    """An index tensor for `rows` (int64), or the equivalent slice when they are consecutive."""
    if len(rows) and (np.diff(rows) == 1).all():
        return slice(int(rows[0]), int(rows[0]) + len(rows))
    return torch.from_numpy(rows).to(device)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention`.

    `max_batched_query_len`: requests with at most this many new tokens are attended in padded
    batches (decodes in one batch, other short queries in another); longer ones one by one.
    """

    name = "TORCH_SDPA"
    metadata_cls: type[TorchAttentionMetadata] = TorchAttentionMetadata

    def __init__(self, max_batched_query_len: int = 8) -> None:
        if max_batched_query_len < 1:
            raise ValueError(f"max_batched_query_len={max_batched_query_len} must be >= 1")
        self.max_batched_query_len = max_batched_query_len

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    # ---------------------------------------------------------------- per-step metadata

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl = np.asarray(common.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(common.seq_lens_cpu, dtype=np.int64)  # (tests may pass lists)
        meta = self.metadata_cls(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            block_size=common.block_size,
        )
        query_lens = np.diff(qsl)
        decodes = self._take_decodes(meta, common, np.flatnonzero(query_lens == 1))
        multi = self._take_multi(meta, common, np.flatnonzero(query_lens > 1))
        shorts = multi[query_lens[multi] <= self.max_batched_query_len]
        for r in multi[query_lens[multi] > self.max_batched_query_len].tolist():
            meta.prefills.append(self._build_prefill(common, r))
        bs = common.block_size
        for reqs in (decodes, shorts):
            if not len(reqs):
                continue
            by_len = reqs[np.argsort(-seq_lens[reqs], kind="stable")]
            blocks = (-(-seq_lens[by_len] // bs)).tolist()
            cuts = _split_by_length(blocks, -(-_GROUP_OVERHEAD_TOKENS // bs))
            if len(cuts) == 1:  # keep batch order: rows stay a contiguous slice more often
                meta.groups.append(self._build_group(common, reqs, qsl, seq_lens))
                continue
            for lo, hi in cuts:
                meta.groups.append(self._build_group(common, by_len[lo:hi], qsl, seq_lens))
        gathers = [g.num_reqs * g.num_blocks for g in meta.groups]
        gathers += [p.block_ids.shape[0] for p in meta.prefills if p.block_ids is not None]
        meta.max_gather_blocks = max(gathers, default=0)
        return meta

    def _take_decodes(
        self, meta: TorchAttentionMetadata, common: CommonAttentionMetadata, decodes: np.ndarray
    ) -> np.ndarray:
        """The decode requests (query_len 1) left to batched SDPA groups: all of them here; a
        subclass with its own decode kernel records them in `meta` and returns fewer."""
        return decodes

    def _take_multi(
        self, meta: TorchAttentionMetadata, common: CommonAttentionMetadata, reqs: np.ndarray
    ) -> np.ndarray:
        """The multi-token requests left to SDPA (batched if short, one by one if long): all of
        them here; a subclass with its own kernel for them records them and returns fewer."""
        return reqs

    def _build_group(
        self,
        common: CommonAttentionMetadata,
        reqs: np.ndarray,  # [B] request indices
        qsl: np.ndarray,  # [num_reqs + 1] query start locations
        seq_lens: np.ndarray,  # [num_reqs]
    ) -> BatchedGroup:
        bs = common.block_size
        dev = common.block_table.device
        num_reqs = len(reqs)
        starts = qsl[reqs]  # [B]
        query_lens = qsl[reqs + 1] - starts  # [B]
        max_q = int(query_lens.max())
        need = -(-seq_lens[reqs] // bs)  # [B] blocks per request
        num_blocks = int(need.max())

        # Query row i of request b: its row min(i, q_len - 1) (padding repeats the last one).
        i = np.arange(max_q)
        j = np.minimum(i[None, :], query_lens[:, None] - 1)  # [B, Qmax]
        q_rows = (starts[:, None] + j).reshape(-1)
        q_pos = (seq_lens[reqs] - query_lens)[:, None] + j  # [B, Qmax] key position
        real = i[None, :] < query_lens[:, None]  # [B, Qmax]

        req_idx = torch.from_numpy(reqs).to(dev)
        table = common.block_table.index_select(0, req_idx)[:, :num_blocks].long()
        cols = torch.arange(num_blocks, device=dev)
        # Entries past a request's own blocks may be stale or -1: point them at block 0.
        need_t = torch.from_numpy(need).to(dev)
        table = torch.where(cols[None, :] < need_t[:, None], table, 0)  # [B, num_blocks]

        key_pos = torch.arange(num_blocks * bs, device=dev)  # [Lpad]
        q_pos_t = torch.from_numpy(q_pos).to(dev)  # [B, Qmax]
        mask = key_pos[None, None, :] <= q_pos_t[:, :, None]  # [B, Qmax, Lpad]
        return BatchedGroup(
            num_reqs=num_reqs,
            max_query_len=max_q,
            num_blocks=num_blocks,
            q_rows=_rows(q_rows, dev),
            block_ids=table.reshape(-1),
            mask=mask.unsqueeze(1),
            out_src=None if max_q == 1 else torch.from_numpy(np.flatnonzero(real)).to(dev),
            out_rows=_rows((starts[:, None] + i[None, :])[real], dev),
        )

    def _build_prefill(self, common: CommonAttentionMetadata, r: int) -> PrefillRequest:
        start, end = int(common.query_start_loc_cpu[r]), int(common.query_start_loc_cpu[r + 1])
        seq_len = int(common.seq_lens_cpu[r])
        ctx = seq_len - (end - start)
        if ctx == 0:
            return PrefillRequest(start, end, seq_len, None, None)
        dev = common.block_table.device
        num_blocks = -(-seq_len // common.block_size)
        block_ids = common.block_table[r, :num_blocks].long()
        rows = min(end - start, _PREFILL_CHUNK_ROWS, max(16, _MASK_BUDGET // seq_len))
        last_q_pos = torch.arange(seq_len - rows, seq_len, device=dev)  # [C]
        mask = torch.arange(seq_len, device=dev)[None, :] <= last_q_pos[:, None]  # [C, L]
        chunks = [
            (s, min(s + rows, end), ctx + min(s + rows, end) - start)
            for s in range(start, end, rows)
        ]
        return PrefillRequest(start, end, seq_len, block_ids, mask, chunks)

    # ---------------------------------------------------------------- per-layer forward

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: TorchAttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_size = query.shape
        n = metadata.num_actual_tokens
        self.write_kv(key, value, kv_cache, metadata, kv_scales)
        out = torch.empty(
            (num_tokens, num_heads, head_size), dtype=query.dtype, device=query.device
        )
        for group in metadata.groups:
            self._attend_group(out, query, kv_cache, group, metadata, scale, kv_scales)
        for p in metadata.prefills:
            self._attend_prefill(out, query, key, value, kv_cache, p, metadata, scale, kv_scales)
        if n < num_tokens:
            out[n:].zero_()  # padding rows: defined values, nothing else reads them
        return out

    @staticmethod
    def write_kv(
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: TorchAttentionMetadata,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> None:
        """Scatter the step's real key/value rows into their cache slots (quantized into an
        fp8 cache, with `kv_scales`)."""
        n = metadata.num_actual_tokens
        if n == 0:
            return
        row = key.shape[1] * key.shape[2]
        k, v = key[:n].reshape(n, row), value[:n].reshape(n, row)
        if kv_cache.dtype != key.dtype:
            k = quantize_kv(k, kv_cache.dtype, kv_scales.k_inv)
            v = quantize_kv(v, kv_cache.dtype, kv_scales.v_inv)
            kv_cache, k, v = storage_view(kv_cache), storage_view(k), storage_view(v)
        kv_cache[0].view(-1, row).index_copy_(0, metadata.slot_mapping, k)
        kv_cache[1].view(-1, row).index_copy_(0, metadata.slot_mapping, v)

    @staticmethod
    def _attend_group(
        out: torch.Tensor,  # [T, H, D]
        query: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,
        g: BatchedGroup,
        meta: TorchAttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> None:
        _, num_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[3]
        B, Q, L = g.num_reqs, g.max_query_len, g.num_blocks * meta.block_size
        # Whole-block gathers: [B * num_blocks, block_size * Hkv * D] -> [B, Hkv, L, D] (view).
        k, v = meta.gather_kv(kv_cache, g.block_ids, query.dtype, kv_scales)
        k = k.view(B, L, num_kv_heads, head_size).transpose(1, 2)
        v = v.view(B, L, num_kv_heads, head_size).transpose(1, 2)
        q = query[g.q_rows] if isinstance(g.q_rows, slice) else query.index_select(0, g.q_rows)
        if Q == 1:
            # The query heads of one KV head become that head's query rows: no GQA expansion.
            q = q.reshape(B, num_kv_heads, num_heads // num_kv_heads, head_size)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
            o = o.view(B, num_heads, head_size)  # [B, H, D]
        else:
            q = q.reshape(B, Q, num_heads, head_size).transpose(1, 2)  # [B, H, Q, D]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
            o = o.transpose(1, 2).reshape(B * Q, num_heads, head_size)
            o = o.index_select(0, g.out_src)  # [n_real, H, D]
        if isinstance(g.out_rows, slice):
            out[g.out_rows] = o
        else:
            out.index_copy_(0, g.out_rows, o)

    @staticmethod
    def _attend_prefill(
        out: torch.Tensor,  # [T, H, D]
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        p: PrefillRequest,
        meta: TorchAttentionMetadata,
        scale: float,
        kv_scales: KVScales = UNIT_SCALES,
    ) -> None:
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        head_size = query.shape[2]
        gqa = num_heads != num_kv_heads
        if p.mask is None:
            q = query[p.start : p.end].transpose(0, 1)[None]  # [1, H, Q, D]
            ks = kv_scales
            k = as_stored(key[p.start : p.end], kv_cache.dtype, ks.k, ks.k_inv)
            v = as_stored(value[p.start : p.end], kv_cache.dtype, ks.v, ks.v_inv)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            out[p.start : p.end] = o[0].transpose(0, 1)  # [Q, H, D]
            return
        # [num_blocks, block_size * Hkv * D]
        k, v = meta.gather_kv(kv_cache, p.block_ids, query.dtype, kv_scales)
        k = k.view(-1, num_kv_heads, head_size).transpose(0, 1)[None]  # [1, Hkv, Lpad, D]
        v = v.view(-1, num_kv_heads, head_size).transpose(0, 1)[None]
        chunk_rows = p.mask.shape[0]
        for start, end, key_len in p.chunks:
            q = query[start:end].transpose(0, 1)[None]  # [1, H, n, D]
            mask = p.mask[chunk_rows - (end - start) :, p.seq_len - key_len :]  # [n, key_len]
            o = F.scaled_dot_product_attention(
                q,
                k[:, :, :key_len],
                v[:, :, :key_len],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:end] = o[0].transpose(0, 1)  # [n, H, D]
