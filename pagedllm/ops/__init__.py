"""pagedllm's native operators (a C++ PyTorch extension) and how they are built and found.

`cpu_ops()` returns the `torch.ops.pagedllm` namespace, or None when the fast path is off
(`PAGEDLLM_CPU_KERNELS=0`) or cannot be had (no C++ compiler or ninja, a failed build): every
caller then keeps its pure-PyTorch code, which stays the reference the kernels are tested
against. See `pagedllm/ops/build.py` for where the build lives.
"""

from pagedllm.ops.build import cpu_ops, kernels_enabled

__all__ = ["cpu_ops", "kernels_enabled"]
