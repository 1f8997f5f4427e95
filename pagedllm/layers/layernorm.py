"""RMSNorm with an optional fused residual add (the pre-norm decoder's two hot spots in one)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.batch_invariant import mean_of_squares
from pagedllm.layers.linear import default_weight_loader, set_weight_loader
from pagedllm.ops import row_ops


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in float32 and cast back before the
    weight multiply (as transformers does, so outputs match it bit for bit in fp32).

    `forward(x)` returns the normalized x; `forward(x, residual)` first adds `residual` to x and
    returns `(normalized sum, sum)`: the sum is the next residual stream. bf16 rows on the CPU
    take the native kernel (one pass, same roundings; the residual is updated in place); so do
    fp32 rows (the sum of squares in another order: within a few ulps of this code).
    `batch_invariant` (set by `make_batch_invariant_`): the PyTorch path with a sequential
    sum of squares.
    """

    batch_invariant = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., hidden]
        dtype = x.dtype
        xf = x.to(torch.float32)
        if self.batch_invariant:
            variance = mean_of_squares(xf)
        else:
            variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.batch_invariant and x.dtype == self.weight.dtype:
            ops = row_ops(x)
            if ops is not None:
                if residual is None:
                    return ops.rms_norm(x, self.weight, self.eps)
                return ops.fused_add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
