"""TorchAttentionBackend against a dense per-request reference on randomized mixed batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.attention import torch_backend
from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.fp8_kv import UNIT_SCALES, KVScales
from pagedllm.attention.selector import get_attn_backend
from pagedllm.attention.torch_backend import TorchAttentionBackend

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

# Each scenario: (context_len, query_len) per request, in batch order. context_len tokens were
# written by earlier steps; query_len tokens are new this step.
SCENARIOS = {
    "prefill": [(0, 17), (0, 5), (0, 33), (0, 2)],
    "prefix_hit": [(16, 9), (32, 20), (48, 3)],
    "chunked_prefill": [(37, 12), (50, 30), (9, 11)],
    "decode": [(20, 1), (63, 1), (0, 1), (100, 1), (7, 1)],
    "spec_decode": [(10, 4), (45, 4), (33, 4)],  # short multi-token queries, batched
    "mixed": [(20, 1), (0, 24), (64, 1), (40, 13), (3, 4), (5, 1), (31, 8), (0, 1), (90, 1)],
}


class Batch:
    """A random paged batch plus its dense history, on which the reference attention runs."""

    def __init__(
        self,
        spec,
        *,
        block_size,
        num_heads,
        num_kv_heads,
        head_size,
        dtype,
        device,
        pad_rows=0,
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.spec, self.block_size = spec, block_size
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        seq_lens = [c + q for c, q in spec]
        blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
        max_blocks = max(blocks_per_req) + 2
        num_blocks = sum(blocks_per_req) + 7
        # Scattered, non-contiguous block ids; table entries past a request's blocks are -1.
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_table = torch.full((len(spec), max_blocks), -1, dtype=torch.int32)
        for r, nb in enumerate(blocks_per_req):
            self.block_table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
            perm = perm[nb:]

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        shape = TorchAttentionBackend.get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size
        )
        self.kv_cache = rand(*shape)  # random garbage everywhere a request did not write
        # Dense history per request: context (already cached) + the new tokens.
        self.k_hist = [rand(s, num_kv_heads, head_size) for s in seq_lens]
        self.v_hist = [rand(s, num_kv_heads, head_size) for s in seq_lens]
        for r, (ctx, _) in enumerate(spec):
            slots = self.slots(r, 0, ctx)
            self.kv_cache[0].view(-1, num_kv_heads, head_size)[slots] = self.k_hist[r][:ctx]
            self.kv_cache[1].view(-1, num_kv_heads, head_size)[slots] = self.v_hist[r][:ctx]

        num_tokens = sum(q for _, q in spec)
        self.query = rand(num_tokens + pad_rows, num_heads, head_size)
        self.key = torch.cat([k[c:] for k, (c, _) in zip(self.k_hist, spec)])
        self.value = torch.cat([v[c:] for v, (c, _) in zip(self.v_hist, spec)])
        if pad_rows:  # padding rows hold garbage that must not leak anywhere
            nan = torch.full((pad_rows, num_kv_heads, head_size), float("nan"), dtype=dtype)
            self.key, self.value = torch.cat([self.key, nan]), torch.cat([self.value, nan])
            self.query[num_tokens:] = float("nan")
        qsl = [0]
        for _, q in spec:
            qsl.append(qsl[-1] + q)
        slot_mapping = torch.cat([self.slots(r, c, c + q) for r, (c, q) in enumerate(spec)])
        self.common = CommonAttentionMetadata(
            num_reqs=len(spec),
            num_actual_tokens=num_tokens,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            seq_lens_cpu=seq_lens,
            block_table=self.block_table.to(device),
            slot_mapping=slot_mapping.to(device),
            max_query_len=max(q for _, q in spec),
            max_seq_len=max(seq_lens),
            block_size=block_size,
        )
        self.query_start_loc = qsl
        self.num_tokens = num_tokens
        for name in ("kv_cache", "query", "key", "value"):
            setattr(self, name, getattr(self, name).to(device))

    def slots(self, r: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = self.block_table[r].long()[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def reference(self, scale: float) -> torch.Tensor:
        """Causal softmax attention in fp32 per request over its dense history."""
        group = self.num_heads // self.num_kv_heads
        outs = []
        for r, (ctx, q_len) in enumerate(self.spec):
            s, e = self.query_start_loc[r], self.query_start_loc[r + 1]
            q = self.query[s:e].cpu().float()  # [Q, H, D]
            k = self.k_hist[r].float().repeat_interleave(group, dim=1)  # [L, H, D]
            v = self.v_hist[r].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            allowed = torch.arange(ctx + q_len)[None, :] <= torch.arange(ctx, ctx + q_len)[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        return torch.cat(outs)


def run(batch: Batch, backend: TorchAttentionBackend, kv_scales=UNIT_SCALES) -> torch.Tensor:
    head_size = batch.query.shape[-1]
    meta = backend.build_metadata(batch.common)
    return backend.forward(
        batch.query, batch.key, batch.value, batch.kv_cache, meta, head_size**-0.5, kv_scales
    )


TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def check(batch: Batch, out: torch.Tensor) -> None:
    head_size = batch.query.shape[-1]
    ref = batch.reference(head_size**-0.5)
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out[: batch.num_tokens].cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("head_size", [32, 64])
def test_matches_reference_fp32(device, scenario, block_size, num_heads, num_kv_heads, head_size):
    batch = Batch(
        SCENARIOS[scenario],
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.float32,
        device=device,
        seed=block_size + num_heads + num_kv_heads + head_size,
    )
    check(batch, run(batch, TorchAttentionBackend()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_reference_half(device, dtype, scenario):
    batch = Batch(
        SCENARIOS[scenario],
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        dtype=dtype,
        device=device,
        seed=1,
    )
    out = run(batch, TorchAttentionBackend())
    assert out.dtype == dtype
    check(batch, out)


@pytest.mark.parametrize("max_batched_query_len", [1, 4, 64])
def test_batching_threshold_does_not_change_results(max_batched_query_len):
    """The same batch through different splits between batched groups and per-request calls."""
    batch = Batch(
        SCENARIOS["mixed"],
        block_size=8,
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        device="cpu",
        seed=3,
    )
    backend = TorchAttentionBackend(max_batched_query_len=max_batched_query_len)
    meta = backend.build_metadata(batch.common)
    long = sum(q > max_batched_query_len for _, q in SCENARIOS["mixed"])
    assert len(meta.prefills) == long
    check(batch, run(batch, backend))


def test_uneven_decode_lengths_split_into_groups():
    """Decodes of very different lengths are attended in several padded groups, correctly."""
    spec = [(1000, 1), (3, 1), (990, 1), (10, 1), (500, 1), (7, 1), (480, 1), (12, 1)]
    batch = Batch(
        spec,
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        device="cpu",
        seed=4,
    )
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(batch.common)
    assert len(meta.groups) >= 2
    assert sum(g.num_reqs for g in meta.groups) == len(spec)
    check(batch, run(batch, backend))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "limit,value,num_chunks",
    [("_MASK_BUDGET", 1, [3, 2, 1]), ("_PREFILL_CHUNK_ROWS", 7, [6, 5, 3])],
)
def test_long_prefill_row_chunks(monkeypatch, block_size, limit, value, num_chunks):
    """Prefills over context cut into many row chunks give the same result."""
    monkeypatch.setattr(torch_backend, limit, value)  # _MASK_BUDGET=1: 16-row chunks
    spec = [(37, 40), (50, 30), (9, 16), (5, 1)]
    batch = Batch(
        spec,
        block_size=block_size,
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        device="cpu",
        seed=8,
    )
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(batch.common)
    assert [len(p.chunks) for p in meta.prefills] == num_chunks
    check(batch, run(batch, backend))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", ["mixed", "prefill"])
def test_kv_lands_in_its_slots_and_nowhere_else(device, scenario):
    batch = Batch(
        SCENARIOS[scenario],
        block_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        device=device,
        seed=5,
    )
    before = batch.kv_cache.clone()
    run(batch, TorchAttentionBackend())
    flat = batch.kv_cache.view(2, -1, 2, 32).cpu()
    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    for r, (ctx, q_len) in enumerate(batch.spec):
        slots = batch.slots(r, 0, ctx + q_len)
        torch.testing.assert_close(flat[0, slots], batch.k_hist[r], atol=0, rtol=0)
        torch.testing.assert_close(flat[1, slots], batch.v_hist[r], atol=0, rtol=0)
        written[batch.slots(r, ctx, ctx + q_len)] = True
    untouched = before.view(2, -1, 2, 32).cpu()[:, ~written]
    torch.testing.assert_close(flat[:, ~written], untouched, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_are_ignored(device):
    """Rows past num_actual_tokens (NaN here) neither reach the cache nor the real outputs."""
    batch = Batch(
        SCENARIOS["mixed"],
        block_size=16,
        num_heads=8,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        device=device,
        pad_rows=5,
        seed=6,
    )
    out = run(batch, TorchAttentionBackend())
    assert out.shape == batch.query.shape
    check(batch, out)
    assert not batch.kv_cache.isnan().any()
    assert torch.equal(out[batch.num_tokens :].cpu(), torch.zeros(5, 8, 32))


@pytest.mark.parametrize("scenario", ["mixed", "decode", "spec_decode", "chunked_prefill"])
def test_noncontiguous_qkv_views(scenario):
    """q/k/v split from one fused projection output (row stride > heads * head_size)."""
    batch = Batch(
        SCENARIOS[scenario],
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        device="cpu",
        seed=7,
    )
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
    q, k, v = fused.split([4 * 32, 2 * 32, 2 * 32], dim=1)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(batch.common)
    out = backend.forward(
        q.view(-1, 4, 32), k.view(-1, 2, 32), v.view(-1, 2, 32), batch.kv_cache, meta, 32**-0.5
    )
    check(batch, out)


def test_kv_cache_shape():
    assert TorchAttentionBackend.get_kv_cache_shape(10, 16, 4, 64) == (2, 10, 16, 4, 64)


def test_selector_rejects_unknown_device():
    with pytest.raises(ValueError, match="device"):
        get_attn_backend("meta")


def test_split_by_length():
    assert torch_backend._split_by_length([10] * 6, overhead=4) == [(0, 6)]
    assert torch_backend._split_by_length([100, 99, 3, 2], overhead=4) == [(0, 2), (2, 4)]
    skewed = [2**i for i in range(20, 0, -1)]
    cuts = torch_backend._split_by_length(skewed, overhead=1, max_ranges=3)
    assert len(cuts) == 3 and cuts[0][0] == 0 and cuts[-1][1] == len(skewed)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))


def _fp8(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 cache stores for `x`: saturated at the format's largest value, rounded."""
    bound = torch.finfo(cache_dtype).max
    return x.float().clamp(-bound, bound).to(cache_dtype)


def fp8_batch(
    spec,
    cache_dtype: torch.dtype,
    dtype: torch.dtype,
    device="cpu",
    kv_scales=UNIT_SCALES,
    **kwargs,
) -> Batch:
    """`Batch` over an fp8 cache with `kv_scales`: the context already written is stored as
    fp8 of the values times 1 / scale, and the dense history the reference reads is what the
    cache gives back, fp8 times scale in the query's dtype (the new rows' too)."""
    batch = Batch(spec, dtype=dtype, device=device, **kwargs)
    ks = kv_scales

    def stored(x: torch.Tensor, inv: float) -> torch.Tensor:
        return _fp8(x.float() * inv, cache_dtype)

    def read(x: torch.Tensor, scale: float, inv: float) -> torch.Tensor:
        return (stored(x, inv).float() * scale).to(dtype)

    batch.kv_cache = torch.stack(
        [stored(batch.kv_cache[0], ks.k_inv), stored(batch.kv_cache[1], ks.v_inv)]
    )
    batch.k_hist = [read(k, ks.k, ks.k_inv) for k in batch.k_hist]
    batch.v_hist = [read(v, ks.v, ks.v_inv) for v in batch.v_hist]
    return batch


SCALED = KVScales(0.0371, 2.6)  # calculate_kv_scales-like scales, one below 1, one above


@pytest.mark.parametrize("kv_scales", [UNIT_SCALES, SCALED], ids=["unit", "scaled"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fp8_cache_attends_to_the_stored_kv(scenario, dtype, cache_dtype, kv_scales):
    """kv_cache_dtype fp8: every row attends to K/V as the cache stores them, read back with
    the layer's scales, whether they were in the cache before the step (context) or are
    written by it (a prefill without context included), at the query dtype's precision; the
    new rows land quantized."""
    spec = SCENARIOS[scenario]
    batch = fp8_batch(
        spec, cache_dtype, dtype, block_size=8, num_heads=8, num_kv_heads=2, head_size=32,
        seed=9, kv_scales=kv_scales,
    )  # fmt: skip
    out = run(batch, TorchAttentionBackend(max_batched_query_len=4), kv_scales)
    assert out.dtype == dtype and batch.kv_cache.dtype == cache_dtype
    check(batch, out)
    flat = batch.kv_cache.view(2, -1, 2, 32)
    for r, (ctx, q_len) in enumerate(spec):
        slots = batch.slots(r, ctx, ctx + q_len)
        k, v = flat[0, slots].float() * kv_scales.k, flat[1, slots].float() * kv_scales.v
        assert torch.equal(k.to(dtype), batch.k_hist[r][ctx:])
        assert torch.equal(v.to(dtype), batch.v_hist[r][ctx:])


def check_fp8_write_saturates(backend: TorchAttentionBackend, cache_dtype: torch.dtype) -> None:
    """Values past the format's range are stored as its largest finite value (a bare cast
    to e5m2 would store inf), NaN stays NaN."""
    big = torch.finfo(cache_dtype).max
    cache = torch.zeros(backend.get_kv_cache_shape(1, 8, 1, 4), dtype=cache_dtype)
    one = np.array([0, 1]), np.array([1]), np.zeros((1, 1), np.int32), np.array([0])
    common = CommonAttentionMetadata.from_numpy(*one, block_size=8, device=torch.device("cpu"))
    key = torch.tensor([[[1e9, -1e9, 1.0, 0.3]]])  # [T, Hkv, D]
    value = torch.tensor([[[float("inf"), float("-inf"), float("nan"), -2.5]]])
    backend.write_kv(key, value, cache, backend.build_metadata(common))
    k, v = cache[0, 0, 0, 0].float(), cache[1, 0, 0, 0].float()
    rounded = _fp8(key[0, 0, 3], cache_dtype).float()  # 0.3 is no fp8 value
    assert k[:2].tolist() == [big, -big] and k[2] == 1.0 and k[3] == rounded != 0.3
    assert v[:2].tolist() == [big, -big] and v[2].isnan() and v[3] == -2.5


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_saturates(cache_dtype):
    check_fp8_write_saturates(TorchAttentionBackend(), cache_dtype)
