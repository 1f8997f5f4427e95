"""attention/layer.py: the CPU KV cache reads as zeros everywhere, yet no page of it is
touched (or committed) until the model writes there."""

from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm.attention.layer import Attention, allocate_kv_caches
from pagedllm.attention.torch_backend import TorchAttentionBackend


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_kv_cache_is_zeroed_lazily():
    model = nn.ModuleList(
        [Attention(4, 64, 0.125, num_kv_heads=2, prefix=f"layer{i}") for i in range(2)]
    )
    before = _rss_bytes()
    caches = allocate_kv_caches(
        model, TorchAttentionBackend(), 8192, 16, torch.bfloat16, torch.device("cpu")
    )
    size = sum(c.numel() * c.element_size() for c in caches)  # 2 x 64 MiB
    assert _rss_bytes() - before < size // 4
    assert [layer.kv_cache for layer in model] == caches
    for cache in caches:
        assert cache.shape == (2, 8192, 16, 2, 64) and cache.dtype == torch.bfloat16
        assert cache.is_contiguous() and cache.data_ptr() % 64 == 0
        assert not cache[:, ::1024].any()  # never-written blocks read as zeros
    caches[0][1, 7].fill_(1.5)
    assert (caches[0][1, 7] == 1.5).all() and not caches[0][1, 6].any()
    assert not caches[1][1, 7].any()
