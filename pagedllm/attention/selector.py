"""Picks the attention backend for a device: the seam where a Triton backend plugs in for CUDA.

`TorchAttentionBackend` (SDPA over gathered paged blocks) runs unchanged on the CPU and on
CUDA; bf16 caches on the CPU get `CpuAttentionBackend`, its decodes attended by the native
paged kernel, when the native ops are available (`pagedllm.ops`).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.cpu_backend import CpuAttentionBackend
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.ops import cpu_ops


def get_attn_backend(
    device: str | torch.device, kv_cache_dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The attention backend for `device` ("cpu", "cuda", "cuda:1" or a torch.device) and a
    KV cache of `kv_cache_dtype`."""
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} has no attention backend; use 'cpu' or 'cuda'")
    if device_type == "cpu" and kv_cache_dtype == torch.bfloat16:
        ops = cpu_ops()
        if ops is not None:
            return CpuAttentionBackend(ops)
    return TorchAttentionBackend()
