"""Triton kernels, one a file: `unified_attention`, `reshape_and_cache`, `top_k_top_p`,
`rejection_sample`.

Each kernel runs compiled on CUDA tensors, or in Triton's interpreter on CPU tensors when
`TRITON_INTERPRET=1` was set before this package was imported (how `make test` checks them on
a machine without a GPU). `triton_usable(device)` tells whether a kernel can run on tensors of
`device` in this process; the callers fall back to (or are selected against) their PyTorch
reference otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in the interpreter (set before the kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def triton_usable(device: str | torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: compiled on CUDA, or in the
    interpreter on the CPU."""
    if not HAS_TRITON:
        return False
    device_type = torch.device(device).type
    if interpreter_enabled():
        return device_type == "cpu"
    return device_type == "cuda" and torch.cuda.is_available()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): tl.arange needs power-of-two extents."""
    return 1 << (max(n, 1) - 1).bit_length()
