"""The unified paged-attention kernel against the dense fp32 reference of the torch backend's
tests, over block sizes, head counts, GQA ratios, head sizes, chunk lengths, full and empty
blocks and mixed prefill + decode batches (in Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_torch_backend import TOL, Batch
from tests.ops.triton.devices import TRITON_DEVICES

# (context_len, query_len) per request, block_size, num_heads, num_kv_heads, head_size.
CASES = {
    "decode": ([(20, 1), (63, 1), (0, 1), (100, 1), (7, 1)], 16, 8, 2, 32),
    "prefill": ([(0, 17), (0, 5), (0, 2)], 8, 4, 4, 16),
    "prefix_hit_full_blocks": ([(16, 9), (32, 16)], 16, 4, 1, 64),
    "chunked_prefill_gqa3": ([(37, 12), (9, 11)], 4, 6, 2, 24),
    "spec_decode": ([(10, 4), (45, 4), (31, 4)], 32, 8, 8, 32),
    "mixed": ([(20, 1), (0, 24), (40, 13), (3, 4), (5, 1), (64, 1)], 16, 4, 2, 32),
    "block_size_1": ([(5, 3), (0, 1), (2, 2)], 1, 4, 2, 16),
    "group_16": ([(7, 3), (30, 1)], 16, 32, 2, 16),
    "group_32": ([(7, 2), (33, 1)], 8, 32, 1, 16),
    "ends_on_block_edges": ([(24, 8), (31, 1), (0, 32)], 16, 4, 2, 16),
    # Requests without query rows (a CUDA-graph batch padded to its captured size).
    "empty_requests": ([(10, 2), (0, 0), (5, 1), (0, 0)], 16, 4, 2, 16),
}


def _attend(batch: Batch, device: str) -> torch.Tensor:
    from pagedllm.ops.triton.unified_attention import unified_attention

    common = batch.common
    out = torch.full_like(batch.query, float("nan"))
    scale = batch.query.shape[-1] ** -0.5
    unified_attention(
        out,
        batch.query,
        batch.kv_cache,
        common.block_table,
        common.seq_lens,
        common.query_start_loc,
        scale,
    )
    return out


def _make(case: str, dtype: torch.dtype, device: str, **kwargs) -> Batch:
    spec, block_size, num_heads, num_kv_heads, head_size = CASES[case]
    batch = Batch(
        spec,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        device=device,
        seed=len(case),
        **kwargs,
    )
    # The kernel reads the step's own keys from the cache: write them as reshape_and_cache does.
    flat = batch.kv_cache.view(2, -1, num_kv_heads, head_size)
    slots = batch.common.slot_mapping
    flat[0, slots] = batch.key[: batch.num_tokens]
    flat[1, slots] = batch.value[: batch.num_tokens]
    return batch


def _check(batch: Batch, out: torch.Tensor) -> None:
    ref = batch.reference(batch.query.shape[-1] ** -0.5)
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out[: batch.num_tokens].cpu().float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(device, case):
    batch = _make(case, torch.float32, device)
    _check(batch, _attend(batch, device))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(device, dtype):
    batch = _make("mixed", dtype, device)
    out = _attend(batch, device)
    assert out.dtype == dtype
    _check(batch, out)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_padding_rows_are_not_written(device):
    """Rows past the last request's queries (NaN inputs) are left as they were."""
    batch = _make("decode", torch.float32, device, pad_rows=3)
    out = _attend(batch, device)
    _check(batch, out)
    assert out[batch.num_tokens :].isnan().all()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_noncontiguous_query_view(device):
    """A query split from one fused projection (row stride > heads * head_size)."""
    from pagedllm.ops.triton.unified_attention import unified_attention

    batch = _make("mixed", torch.float32, device)
    fused = torch.cat([batch.query.flatten(1), batch.query.flatten(1)], dim=1)
    query = fused[:, : batch.query[0].numel()].view(batch.query.shape)
    assert not query.is_contiguous()
    out = torch.empty_like(batch.query)
    c = batch.common
    unified_attention(
        out,
        query,
        batch.kv_cache,
        c.block_table,
        c.seq_lens,
        c.query_start_loc,
        batch.query.shape[-1] ** -0.5,
    )
    _check(batch, out)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixed", "chunked_prefill_gqa3", "block_size_1"])
def test_fp8_cache_is_the_widened_cache(device, case, dtype, fp8):
    """Over an fp8 cache (every finite code of the format, scaled so that scores stay a few
    units) the kernel gives the bits it gives over that cache widened to the query's dtype:
    each tile is widened exactly before the same products."""
    batch = _make(case, dtype, device)
    gen = torch.Generator().manual_seed(len(case))
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(fp8).float())]
    shape = batch.kv_cache.shape
    raw = finite[torch.randint(finite.numel(), tuple(shape), generator=gen)]
    fp8_cache = raw.view(fp8).to(batch.kv_cache.device)
    batch.query = (batch.query.float() * 0.02).to(dtype)
    batch.kv_cache = fp8_cache.to(dtype)
    widened = _attend(batch, device)
    batch.kv_cache = fp8_cache
    out = _attend(batch, device)
    n = batch.num_tokens
    assert torch.isfinite(out[:n].float()).all()
    assert torch.equal(out[:n], widened[:n])


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_with_scales_is_the_cache_read_back(device, dtype):
    """With K / V scales: the bits over the cache read back as fp8 value times scale in
    fp32, rounded to the query's dtype."""
    from pagedllm.attention.fp8_kv import KVScales
    from pagedllm.ops.triton.unified_attention import unified_attention

    batch = _make("mixed", dtype, device)
    fp8_cache = batch.kv_cache.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = KVScales(0.0371, 2.6)
    common, scale = batch.common, batch.query.shape[-1] ** -0.5
    args = (common.block_table, common.seq_lens, common.query_start_loc, scale)
    out, ref = torch.zeros_like(batch.query), torch.zeros_like(batch.query)
    unified_attention(out, batch.query, fp8_cache, *args, scales)
    read = torch.stack([(fp8_cache[0].float() * scales.k), (fp8_cache[1].float() * scales.v)])
    unified_attention(ref, batch.query, read.to(dtype), *args)
    n = batch.num_tokens
    assert torch.equal(out[:n], ref[:n])
