"""CpuAttentionBackend (decodes and multi-token queries through the native paged kernels)
against the dense reference and against TorchAttentionBackend, on the same randomized mixed
batches; head size 48, which the prefill kernel lacks, takes the SDPA path for those."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.selector import get_attn_backend
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.ops import cpu_ops
from tests.attention.test_torch_backend import (
    SCENARIOS,
    Batch,
    check,
    check_fp8_write_saturates,
    fp8_batch,
    run,
)

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="native CPU ops not built here")


@pytest.mark.parametrize("scenario", ["decode", "mixed", "spec_decode"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("pad_rows", [0, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 48])
def test_matches_reference_and_torch_backend(
    scenario, num_heads, num_kv_heads, pad_rows, dtype, head_size
):
    def batch():
        return Batch(
            SCENARIOS[scenario],
            block_size=16,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            device="cpu",
            pad_rows=pad_rows,
            seed=num_heads + num_kv_heads,
        )

    fast, slow = batch(), batch()
    out = run(fast, CpuAttentionBackend(cpu_ops()))
    check(fast, out)
    ref = run(slow, TorchAttentionBackend())
    n = fast.num_tokens
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out[:n], ref[:n], atol=tol, rtol=tol)
    assert torch.equal(fast.kv_cache, slow.kv_cache)  # the same K/V written
    assert not out[n:].any()  # padding rows zeroed, no NaN leaked


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 48])
@pytest.mark.parametrize("scenario", ["decode", "prefill", "mixed"])
def test_fp8_cache_matches_torch_backend(scenario, head_size, dtype, cache_dtype):
    """An fp8 KV cache (kv_cache_dtype): the native kernels store the very bytes the torch
    backend stores and attend to the same K/V (the dense reference over the stored values)."""

    def batch():
        return fp8_batch(
            SCENARIOS[scenario],
            cache_dtype,
            dtype,
            block_size=16,
            num_heads=8,
            num_kv_heads=2,
            head_size=head_size,
            pad_rows=3,
            seed=11,
        )

    fast, slow = batch(), batch()
    out = run(fast, CpuAttentionBackend(cpu_ops()))
    ref = run(slow, TorchAttentionBackend())
    assert torch.equal(fast.kv_cache.view(torch.uint8), slow.kv_cache.view(torch.uint8))
    check(fast, out)
    n = fast.num_tokens
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out[:n], ref[:n], atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_write_saturates(cache_dtype):
    check_fp8_write_saturates(CpuAttentionBackend(cpu_ops()), cache_dtype)


def test_selector_picks_it_for_bf16_and_fp32_caches_only():
    assert isinstance(get_attn_backend("cpu", torch.bfloat16), CpuAttentionBackend)
    assert isinstance(get_attn_backend("cpu", torch.float32), CpuAttentionBackend)
    assert type(get_attn_backend("cpu", torch.float16)) is TorchAttentionBackend
