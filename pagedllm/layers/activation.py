"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.ops import cpu_ops


class SiluAndMul(nn.Module):
    """SwiGLU's gate: x [..., 2 * d] holding [gate | up] -> silu(gate) * up [..., d] (one
    native pass for bf16 rows on the CPU, same roundings)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_cpu:
            ops = cpu_ops()
            if ops is not None:
                return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
