"""reshape_and_cache: every row lands in its slot bit for bit, negative slots and every other
slot are untouched, strided key/value views work."""

from __future__ import annotations

import pytest
import torch

from tests.ops.triton.devices import TRITON_DEVICES


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_size,dtype",
    [
        (16, 2, 32, torch.float32),
        (8, 1, 64, torch.bfloat16),
        (4, 3, 24, torch.float16),
        (1, 4, 16, torch.float32),
    ],
)
def test_rows_land_in_their_slots(device, block_size, num_kv_heads, head_size, dtype):
    from pagedllm.ops.triton.reshape_and_cache import reshape_and_cache

    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 12, 11
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    kv_cache = kv_cache.to(dtype).to(device)
    before = kv_cache.clone()
    # Fused rows [T, (2 * Hkv + 1) * D]: key and value are strided views into them.
    row = num_kv_heads * head_size
    fused = torch.randn(num_tokens + 2, 2 * row + head_size, generator=gen).to(dtype).to(device)
    key = fused[:, :row].view(-1, num_kv_heads, head_size)
    value = fused[:, row : 2 * row].view(-1, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows
    reshape_and_cache(key, value, kv_cache, slots.to(device))

    flat = kv_cache.view(2, -1, num_kv_heads, head_size).cpu()
    real = slots >= 0
    assert torch.equal(flat[0, slots[real]], key[:num_tokens][real].cpu())
    assert torch.equal(flat[1, slots[real]], value[:num_tokens][real].cpu())
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots[real]] = False
    old = before.view(2, -1, num_kv_heads, head_size).cpu()
    assert torch.equal(flat[:, untouched], old[:, untouched])


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_no_rows_is_a_no_op(device):
    from pagedllm.ops.triton.reshape_and_cache import reshape_and_cache

    kv_cache = torch.zeros(2, 2, 16, 2, 16, device=device)
    key = torch.ones(0, 2, 16, device=device)
    reshape_and_cache(key, key, kv_cache, torch.zeros(0, dtype=torch.int64, device=device))
    assert not kv_cache.any()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_cache_stores_the_saturated_cast(device, fp8, dtype):
    """Into an fp8 cache each value goes as `x.float().clamp(-M, M).to(fp8)` stores it, bit
    for bit: subnormals, halfway cases, values past the format's range, infinities (saturated),
    NaN (kept NaN); negative slots skipped."""
    from pagedllm.ops.triton.reshape_and_cache import reshape_and_cache
    from tests.ops.test_fp8_kv import awkward_values

    gen = torch.Generator().manual_seed(3)
    hkv, d, bs = 2, 32, 8
    vals = torch.cat([awkward_values(200, gen), torch.tensor([float("inf"), -float("inf"), 1e-30])])
    rows = -(-vals.numel() // (2 * hkv * d)) + 1
    flat = torch.zeros(rows * 2 * hkv * d)
    flat[: vals.numel()] = vals[torch.randperm(vals.numel(), generator=gen)]
    flat[-5] = float("nan")
    kv_rows = flat.view(rows, 2, hkv, d).to(dtype)
    key, value = kv_rows[:, 0], kv_rows[:, 1]  # strided views
    cache = torch.zeros(2, 8, bs, hkv, d, dtype=fp8)
    slots = torch.randperm(8 * bs, generator=gen)[:rows]
    slots[1] = -1
    cache = cache.to(device)
    reshape_and_cache(key.to(device), value.to(device), cache, slots.to(device))
    got = cache.cpu().view(torch.uint8).view(2, -1, hkv, d)
    bound = torch.finfo(fp8).max
    real = slots >= 0
    for plane, x in ((0, key), (1, value)):
        want = x[real].float().clamp(-bound, bound).to(fp8)
        stored = got[plane, slots[real]]
        nan = want.float().isnan()
        assert torch.equal(stored[~nan], want.view(torch.uint8)[~nan])
        assert stored.view(fp8)[nan].float().isnan().all()
    untouched = torch.ones(got.shape[1], dtype=torch.bool)
    untouched[slots[real]] = False
    assert (got[:, untouched] == 0).all()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache_stores_values_times_the_inverse_scale(device, fp8):
    """With calculate_kv_scales' scales: `(x.float() * inv).clamp(-M, M).to(fp8)`, inv the
    fp32 reciprocal of the plane's scale, bit for bit (the native and torch stores' rule)."""
    import numpy as np

    from pagedllm.attention.fp8_kv import KVScales
    from pagedllm.ops.triton.reshape_and_cache import reshape_and_cache

    gen = torch.Generator().manual_seed(4)
    scales = KVScales(0.0371, 2.6)
    key = (torch.randn(9, 2, 32, generator=gen) * 3).to(torch.bfloat16)
    value = (torch.randn(9, 2, 32, generator=gen) * 300).to(torch.bfloat16)
    cache = torch.zeros(2, 4, 8, 2, 32, dtype=fp8).to(device)
    slots = torch.randperm(32, generator=gen)[:9]
    reshape_and_cache(key.to(device), value.to(device), cache, slots.to(device), scales)
    got = cache.cpu().view(torch.uint8).view(2, -1, 2, 32)
    bound = torch.finfo(fp8).max
    for plane, x, s in ((0, key, scales.k), (1, value, scales.v)):
        inv = float(np.float32(1.0) / np.float32(s))
        want = (x.float() * inv).clamp(-bound, bound).to(fp8).view(torch.uint8)
        assert torch.equal(got[plane, slots], want)
