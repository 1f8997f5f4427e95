"""CPU GEMMs on oneDNN-prepacked weights.

On x86 CPUs with AVX-512-BF16 / AMX, `F.linear` on a plain row-major bf16 weight reorders it
into oneDNN's blocked layout on every call. Reordering once after loading and calling oneDNN's
linear directly is 1.5-2.5x faster for decode-sized batches and as fast for prefill, with
bit-identical results (see BENCHMARKS.md). The packed copy replaces the plain weight (whose storage is freed), so
packing costs no memory; only `packed_linear` reads it.

fp32 weights are left alone (they stay exactly as transformers computes them, for the greedy
oracle). `PAGEDLLM_CPU_PACK_WEIGHTS=0` turns packing off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.config import env_flag

_PACKABLE_DTYPES = (torch.bfloat16,)


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and env_flag("PAGEDLLM_CPU_PACK_WEIGHTS", True)
    )


def pack_linear_weight_(module: torch.nn.Module) -> None:
    """Reorder `module.weight` ([out, in]) into oneDNN's layout as `module.weight_packed` (an
    opaque mkldnn tensor) and free the plain copy's storage. No-op where packing doesn't apply."""
    weight = module.weight
    if not can_pack(weight.data):
        return
    module.weight_packed = torch.ops.mkldnn._reorder_linear_weight(weight.data.contiguous())
    weight.data = torch.empty(0, dtype=weight.dtype)


def packed_linear(
    module: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`F.linear(x, module.weight, bias)`, through the packed weight when there is one."""
    packed = getattr(module, "weight_packed", None)
    if packed is None:
        return F.linear(x, module.weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
