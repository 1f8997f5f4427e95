"""CPU GEMMs on weights laid out once, after loading, for the kernel that multiplies them.

Three layouts, chosen per weight by `pack_linear_weight_` (called by the layers'
`process_weights_after_loading`):

- **Panels** (`weight_panels`, pagedllm's own C++ kernel, `pagedllm/ops/csrc/gemm.h`): on CPUs
  with AVX512-BF16 and without AMX (AMD Zen 4/5, Intel Cooper Lake). One layout serves every
  batch size: it streams the weights at memory bandwidth for decode-sized batches (oneDNN
  reaches ~40-60% of it at M = 1) and matches oneDNN's throughput for large ones. int8
  weights (`weight_scale` set, weight-only quantization) use the same layout and kernel on any
  CPU with AVX512-BF16.
- **oneDNN prepacked** (`weight_packed`): other x86 CPUs, AMX ones included (oneDNN picks AMX
  for large batches by itself). `F.linear` on a row-major bf16 weight would reorder it on
  every call; reordering once is 1.5-2.5x faster at decode sizes and bit-identical.
- **Plain** `F.linear`: fp32 weights (kept exactly as transformers computes them, for the
  greedy oracle), and everything when `PAGEDLLM_CPU_PACK_WEIGHTS=0`. int8 weights without
  the native kernel are widened per call (correct, not fast).

A packed copy replaces the plain weight (whose storage is freed), so packing costs no memory;
only `packed_linear` reads it. `PAGEDLLM_CPU_KERNELS=0` disables the panels (pure PyTorch).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedllm.config import env_flag
from pagedllm.ops import cpu_ops

PANEL = 64  # output channels per panel (gemm.h's kPanel)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN prepacking applies to this weight."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and env_flag("PAGEDLLM_CPU_PACK_WEIGHTS", True)
    )


@functools.cache
def _panel_ops(allow_amx: bool):
    """The native ops when this CPU runs the panel GEMM (AVX512-BF16; AMX CPUs only when
    `allow_amx`, i.e. for int8, which oneDNN does not cover), else None."""
    ops = cpu_ops()
    if ops is None or not ops.cpu_has_avx512_bf16():
        return None
    if not allow_amx and torch.cpu._is_amx_tile_supported():
        return None
    return ops


def can_use_panels(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in], bf16 or int8 with scales) goes to the panel kernel."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and weight.dtype in (torch.bfloat16, torch.int8)
        and env_flag("PAGEDLLM_CPU_PACK_WEIGHTS", True)
        and _panel_ops(allow_amx=weight.dtype == torch.int8) is not None
    )


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 64), K / 2, 64, 2]: panels of 64 output channels, k-pairs inside
    (zero rows pad N to a whole panel)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % PANEL)) if n % PANEL else weight
    # A k-pair moves as one integer of twice the width: a plain 2-D transpose per panel,
    # ~5x faster than permuting the pairs' two elements separately.
    pair = {1: torch.int16, 2: torch.int32}[weight.element_size()]
    pairs = padded.contiguous().view(pair).reshape(-1, PANEL, k // 2)
    return pairs.transpose(1, 2).contiguous().view(weight.dtype).reshape(-1, k // 2, PANEL, 2)


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `to_panels`: the [n, K] weight."""
    return panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * 2)[:n]


def pack_linear_weight_(module: torch.nn.Module) -> None:
    """Lay out `module.weight` ([out, in]) for its CPU kernel (see the module docstring) and
    free the plain copy's storage. No-op where no packing applies."""
    weight = module.weight.data
    bf16_activations = getattr(module, "activation_dtype", weight.dtype) == torch.bfloat16
    if can_use_panels(weight) and bf16_activations:  # the kernel multiplies bf16 x
        module.weight_panels = to_panels(weight)
    elif weight.dtype == torch.bfloat16 and can_pack(weight):
        module.weight_packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    else:
        return
    module.weight_out_features = weight.shape[0]
    module.weight.data = torch.empty(0, dtype=weight.dtype)


def packed_linear(
    module: torch.nn.Module,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the module's weight W in whichever layout it has, times
    `module.weight_scale` per output channel for int8 weights; the result is in `out_dtype`
    (default: x's dtype)."""
    flat = x.reshape(-1, x.shape[-1])
    scale = getattr(module, "weight_scale", None)
    panels = getattr(module, "weight_panels", None)
    if panels is not None:
        y = cpu_ops().linear(
            flat.contiguous(),
            panels,
            scale,
            bias,
            module.weight_out_features,
            out_dtype == torch.float32,
        )
    else:
        packed = getattr(module, "weight_packed", None)
        if packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed, bias, "none", [], "")
        elif scale is not None:  # int8 without the native kernel
            y = F.linear(flat, module.weight.to(x.dtype)).float() * scale
            y = y if bias is None else y + bias
        else:
            y = F.linear(flat, module.weight, bias)
        if out_dtype is not None:
            y = y.to(out_dtype)
        elif y.dtype != x.dtype:
            y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
