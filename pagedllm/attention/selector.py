"""Picks the attention backend for a device: the seam where a Triton backend plugs in for CUDA.

Today every device gets `TorchAttentionBackend` (SDPA over gathered paged blocks), which runs
unchanged on the CPU and on CUDA.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.torch_backend import TorchAttentionBackend


def get_attn_backend(device: str | torch.device) -> AttentionBackend:
    """The attention backend for `device` ("cpu", "cuda", "cuda:1" or a torch.device)."""
    device_type = torch.device(device).type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} has no attention backend; use 'cpu' or 'cuda'")
    return TorchAttentionBackend()
