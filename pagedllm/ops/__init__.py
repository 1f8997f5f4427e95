"""pagedllm's native operators: a C++ PyTorch extension for the CPU (how it is built and
found: below), and Triton kernels for CUDA (`ops/triton/`, one kernel a file).

`cpu_ops()` returns the `torch.ops.pagedllm` namespace, or None when the fast path is off
(`PAGEDLLM_CPU_KERNELS=0`) or cannot be had (no C++ compiler or ninja, a failed build): every
caller then keeps its pure-PyTorch code, which stays the reference the kernels are tested
against. See `pagedllm/ops/build.py` for where the build lives.
"""

import torch

from pagedllm.ops.build import cpu_ops, kernels_enabled

NATIVE_DTYPES = (torch.bfloat16, torch.float32)  # what the CPU kernels take
# The KV cache dtypes the CPU attention kernels read and write (with bf16 / fp32 queries): the
# model's own, or fp8 (kv_cache_dtype="fp8" / "fp8_e4m3" / "fp8_e5m2", scale 1: stored with
# saturation at the format's largest finite value, rounded to nearest even).
NATIVE_KV_DTYPES = (*NATIVE_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)


def row_ops(x: torch.Tensor):
    """The native ops for the elementwise row kernels on `x` (2-D CPU rows of bf16 or fp32),
    else None: other tensors, no native build, and inside torch.compile (Dynamo cannot trace
    the kernels; Inductor fuses the PyTorch code instead)."""
    if x.is_cpu and x.dim() == 2 and x.dtype in NATIVE_DTYPES and not torch.compiler.is_compiling():
        return cpu_ops()
    return None


__all__ = ["NATIVE_DTYPES", "NATIVE_KV_DTYPES", "cpu_ops", "kernels_enabled", "row_ops"]
