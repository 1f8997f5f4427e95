"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.ops import row_ops


class SiluAndMul(nn.Module):
    """SwiGLU's gate: x [..., 2 * d] holding [gate | up] -> silu(gate) * up [..., d] (one
    native pass for bf16 or fp32 rows on the CPU, same roundings; fp32's exp differs from
    PyTorch's in the last bits)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = row_ops(x)
        if ops is not None:
            return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
