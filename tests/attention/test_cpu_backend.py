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
from tests.attention.test_torch_backend import SCENARIOS, Batch, check, run

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


def test_selector_picks_it_for_bf16_and_fp32_caches_only():
    assert isinstance(get_attn_backend("cpu", torch.bfloat16), CpuAttentionBackend)
    assert isinstance(get_attn_backend("cpu", torch.float32), CpuAttentionBackend)
    assert type(get_attn_backend("cpu", torch.float16)) is TorchAttentionBackend
